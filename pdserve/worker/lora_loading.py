"""A node that reads LoRA adapters without stalling its loop.

A request under an adapter the engine does not hold (loaded at run time through the
gateway, evicted since, or one a decode worker meets first on a handoff) would read,
check and convert the adapter's files inside `handle`, on the loop every other row is
stepped from. `LoraLoadingNode` wraps the role's node instead:

1. `handle`: a `PrefillRequest`/`DecodeReserve`/`RunRequest` whose adapter is not held
   is parked (not handed to the node, so never stepped) and its adapter read on the
   loader's thread (pdserve/engine/lora/loader.py); later messages for a parked request
   (`TransferTarget`, `StartDecode`) wait behind it; an `Abort` drops it.
2. `step`: first the reads that finished are installed (`LLMEngine.install_lora`, between
   two steps), and each parked request is handed to the node in arrival order, its
   later messages after it; then the node steps every request it holds.
3. A read that failed answers each request that waited for it with a non-retryable
   `RequestFailed` naming the problem (as a bad request is answered at once), and the
   engine holds nothing of the adapter or the requests.

Requests of held adapters and of the base model go straight through, so they keep
stepping while a read runs.
"""

from __future__ import annotations

import logging
from collections import deque

from pdserve.common import protocol as p
from pdserve.common.logs import request_fields
from pdserve.common.lora import LoraRef
from pdserve.engine.lora.loader import LoadDone, LoraLoader
from pdserve.worker.node_api import CoreDemand, Node, NodeLoad, NodeWrapper
from pdserve.worker.node_base import EngineNode

log = logging.getLogger(__name__)

_STARTS = (p.PrefillRequest, p.DecodeReserve, p.RunRequest)


class LoraLoadingNode(NodeWrapper):
    """`node`, its requests under adapters it lacks held back until a thread read them."""

    def __init__(self, node: Node, loader: LoraLoader | None = None) -> None:
        super().__init__(node)
        assert isinstance(node, EngineNode)
        self.inner: EngineNode = node
        registry = node.engine.loras
        assert registry is not None, "LoraLoadingNode wraps a node whose engine serves LoRA"
        self.loader: LoraLoader = loader if loader is not None else LoraLoader(registry.read)
        # request id -> (adapter fingerprint, its messages in arrival order)
        self._parked: dict[str, tuple[str, deque[p.Message]]] = {}

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.Abort):
            self._drop([rid for rid in msg.request_ids if rid in self._parked])
            self.node.handle(msg)
            return
        rid = getattr(msg, "request_id", None)
        if rid is not None and rid in self._parked:
            self._parked[rid][1].append(msg)
            return
        if isinstance(msg, _STARTS) and msg.payload.lora is not None and not self._held(msg.payload.lora):
            lora = msg.payload.lora
            self.loader.start(lora)
            self._parked[msg.request_id] = (lora.fingerprint, deque([msg]))
            log.debug("request %s waits for LoRA adapter %r to be read", msg.request_id, lora.name,
                      extra=request_fields(msg.request_id))
            return
        self.node.handle(msg)

    def step(self) -> bool:
        installed = self._install()
        return self.node.step() or installed

    def busy(self) -> bool:
        return bool(self._parked) or self.node.busy()

    def core_demand(self) -> CoreDemand:
        """A parked request starts computing in the step its adapter is installed: its
        worker keeps its cores meanwhile (and borrows none until then)."""
        inner = self.node.core_demand()
        return inner._replace(keep=inner.keep or bool(self._parked))

    def load(self) -> NodeLoad:
        load = self.node.load()
        return load._replace(waiting_seqs=load.waiting_seqs + len(self._parked))

    def close(self) -> None:
        self.loader.close()
        self.node.close()

    def waiting(self) -> tuple[str, ...]:
        """Ids of the requests parked for an adapter read, in arrival order."""
        return tuple(self._parked)

    # ----------------------------------------------------------------- internals
    def _held(self, lora: LoraRef) -> bool:
        registry = self.inner.engine.loras
        fp = lora.fingerprint
        return registry is not None and registry.holds(fp) and not self.loader.reading(fp)

    def _install(self) -> bool:
        done = self.loader.finished() if len(self.loader) else []
        for d in done:
            self._settle(d)
        return bool(done)

    def _settle(self, done: LoadDone) -> None:
        fp = done.ref.fingerprint
        if done.weights is not None:
            self.inner.engine.install_lora(done.ref, done.weights)
        for rid in [r for r, (f, _) in self._parked.items() if f == fp]:
            _, msgs = self._parked.pop(rid)
            if done.weights is None:
                log.info("request %s refused: LoRA adapter %r: %s", rid, done.ref.name, done.error,
                         extra=request_fields(rid))
                self.inner.send(p.RequestFailed(rid, f"invalid request: {done.error}", retryable=False))
                continue
            for m in msgs:
                self.node.handle(m)

    def _drop(self, rids: list[str]) -> None:
        for rid in rids:
            del self._parked[rid]
            self.inner.metrics.aborts.inc()
            log.debug("request %s aborted while its LoRA adapter was read", rid, extra=request_fields(rid))


def lora_loading(node: Node) -> Node:
    """`node` wrapped in a `LoraLoadingNode` when it is an engine node serving LoRA; as it
    is otherwise."""
    if isinstance(node, EngineNode) and node.engine.loras is not None:
        return LoraLoadingNode(node)
    return node
