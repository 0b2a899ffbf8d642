"""A live role flip: one worker process turns from prefill into decode or back.

The flip happens inside the process, not by re-exec: the worker keeps its id, its
gateway channels, its metrics port and its heartbeat thread, so the gateway sees the
same worker register again with another role (the admin call and the planner name it
by id before and after), and nothing outside the process (a supervisor, a Kubernetes
pod, `pdserve up`) has to learn about a new process. Only the node is rebuilt.

Life of a flip (the runtime's main loop runs every step):

1. `SwitchRole` arrives. The gateway that sent it stopped routing to the worker
   first, so every request it routed here arrived before it; the worker also sends
   `Deregister(final=False)` to every gateway so the others stop too.
2. Drain: the loop keeps ticking (finishing running streams, pushing KV, answering
   aborts) until the node is idle, for at most the drain timeout. Still busy then:
   the flip is cancelled and the worker registers again in its old role.
3. Switch: the old node closes (its KV pool and transfer sockets go with it, and its
   cleanup runs), the other role's node is built from the same engine config.
4. Register again with every gateway (a registration clears its draining mark) and
   publish the new, empty prefix cache as a snapshot.

A request for the old role that a second gateway sent just before it saw the
`Deregister` reaches the new node, which answers it `RequestFailed` (retryable), so
that gateway re-routes it: it never fails.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from pdserve.common import protocol as p
from pdserve.common.protocol import FLIP_ROLES
from pdserve.common.roles import Role

if TYPE_CHECKING:
    from pdserve.engine.core.config import EngineConfig
    from pdserve.worker.metrics import WorkerMetrics
    from pdserve.worker.node_api import Node
    from pdserve.worker.options import NodeBuilder, NodeParts, WorkerOptions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FlipRefusal:
    """Why a worker will not switch to a role ('' : it will)."""

    reason: str = ""

    @property
    def ok(self) -> bool:
        return not self.reason


class RoleSwitcher:
    """Builds the worker's node for a role and owns the current node's cleanup.

    `builders` maps every role this worker may serve to its node builder; the CLI
    (the one place that knows every role package) supplies them."""

    def __init__(self, engine_cfg: EngineConfig, opts: WorkerOptions,
                 builders: Mapping[Role, NodeBuilder],
                 parts_for: Callable[[Role], NodeParts],
                 wrap: Callable[[Node, WorkerMetrics], Node] | None = None) -> None:
        self.engine_cfg = engine_cfg
        self.wrap = wrap  # applied to every node built (the thread policy's GovernedNode)
        self.opts = opts
        self.builders = dict(builders)
        self.parts_for = parts_for
        self.role = opts.role
        self.flips = 0
        self._cleanup: list[Callable[[], Any]] = []
        self.metrics: WorkerMetrics | None = None

    def refusal(self, role: Role) -> FlipRefusal:
        if role not in FLIP_ROLES:
            return FlipRefusal(f"a worker can only switch to {' or '.join(FLIP_ROLES)}, not {role!r}")
        if self.role not in FLIP_ROLES:
            return FlipRefusal(f"a {self.role} worker does not switch roles")
        if role not in self.builders:
            return FlipRefusal(f"this worker cannot build a {role} node")
        if self.opts.core_share:
            return FlipRefusal("a worker sharing cores (--core-share) keeps its role")
        return FlipRefusal()

    def build(self, role: Role) -> Node:
        """The node for `role`; its cleanup is kept until the next switch or `close`."""
        parts = self.parts_for(role)
        node, cleanup = self.builders[role](self.engine_cfg, replace(self.opts, role=role), parts)
        self.metrics = parts.metrics
        from pdserve.worker.lora_loading import lora_loading

        node = lora_loading(node)  # adapters read off the loop (imported here: it needs the engine)
        if self.wrap is not None:
            node = self.wrap(node, parts.metrics)
        self._cleanup = list(cleanup)
        self.role = role
        return node

    def switch(self, old: Node, role: Role) -> Node:
        """Close `old` and build `role`'s node. If that fails, the old role's node is
        built again (and the error logged), so the worker stays in service."""
        previous = self.role
        old.close()
        self.close()
        try:
            node = self.build(role)
        except Exception:
            log.exception("building the %s node failed; serving as %s again", role, previous)
            return self.build(previous)
        self.flips += 1
        log.info("switched role: %s -> %s", previous, role)
        return node

    def close(self) -> None:
        cleanup, self._cleanup = self._cleanup, []
        for fn in cleanup:
            fn()


# The messages that start work on a role's node; any other role's node ignores them.
_STARTS: dict[Role, tuple[type[p.Message], ...]] = {
    Role.PREFILL: (p.PrefillRequest,),
    Role.DECODE: (p.DecodeReserve, p.RunRequest),
}


def misrouted(role: Role, msg: p.Message) -> p.RequestFailed | None:
    """A retryable failure for a request sent to this worker's previous role (a gateway
    that had not yet seen it drain), so that gateway re-routes it; None otherwise."""
    if role not in _STARTS or isinstance(msg, _STARTS[role]):
        return None
    for other, starts in _STARTS.items():
        if other != role and isinstance(msg, starts):
            rid = msg.request_id  # type: ignore[attr-defined]
            return p.RequestFailed(rid, f"this worker serves {role} now", retryable=True)
    return None
