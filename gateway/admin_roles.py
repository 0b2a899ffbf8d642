"""Live role flips: the admin call and the bookkeeping behind it.

`POST /admin/workers/{worker_id}/role` with `{"role": "decode"}` (or `"prefill"`) and
`Authorization: Bearer <admin token>` (`--admin-token` / `PDSERVE_ADMIN_TOKEN`; without
one configured the admin routes answer 404, with a wrong or missing token 401) asks a
worker to switch roles. The answer is 202 and the flip runs on its own:

1. The gateway marks the worker draining (no new work is routed to it) and only then
   sends it `SwitchRole`, so every request it routed there arrives before it.
2. The worker drains (its in-flight requests finish), rebuilds its node for the new
   role in the same process and registers again under the same id
   (pdserve/worker/role_switch.py); the registration clears the draining mark and the worker
   takes traffic in its new role.

A flip is refused (409) for a colocated worker, one already in the asked role, one
draining, stalled or already switching, and for the last routable worker of its pool:
no flip ever leaves a role with no worker. The planner (gateway/planner_loop.py) flips
through `RoleFlips.request` too. Completed flips are counted by the control plane
(`llm_role_flips_total{from_role,to_role}`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.auth import check_authorization
from gateway.body import json_object
from gateway.control_plane import ControlPlane
from gateway.errors import APIError
from gateway.registry import WorkerInfo
from gateway.state import STATE
from pdserve.common import protocol as p
from pdserve.common.roles import Role

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4096


@dataclass(frozen=True)
class FlipResult:
    """The outcome of a flip request: an HTTP status and why (or what was started)."""

    status: int  # 202 started, 400 bad role, 404 unknown worker, 409 refused
    message: str
    from_role: str = ""
    to_role: str = ""
    inflight: int = 0  # requests the worker still held when it started draining


@dataclass(frozen=True)
class PendingFlip:
    worker_id: str
    from_role: Role
    to_role: Role
    since: float


class RoleFlips:
    """Starts flips and knows which are still under way (the planner waits for them)."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control
        self._pending: dict[str, PendingFlip] = {}

    def refusal(self, w: WorkerInfo | None, role: str) -> FlipResult | None:
        if role not in p.FLIP_ROLES:
            return FlipResult(400, f"role must be one of {', '.join(p.FLIP_ROLES)}")
        if w is None:
            return FlipResult(404, "no such worker")
        if w.role not in p.FLIP_ROLES:
            return FlipResult(409, f"a {w.role} worker does not switch roles")
        if w.role == role:
            return FlipResult(409, f"worker is already a {role} worker")
        if w.worker_id in self.pending() or w.draining or w.stalled:
            return FlipResult(409, "worker is draining, stalled or already switching")
        if [x.worker_id for x in self.control.registry.pool(w.role)] == [w.worker_id]:
            return FlipResult(409, f"worker is the last {w.role} worker; a role never drops to zero")
        return None

    def request(self, worker_id: str, role: str, now: float | None = None) -> FlipResult:
        """Start flipping `worker_id` to `role` (see the module docstring)."""
        w = self.control.registry.get(worker_id)
        refused = self.refusal(w, role)
        if refused is not None:
            return refused
        assert w is not None
        role = Role(role)  # the request's name, checked by `refusal`
        w.draining = True  # before SwitchRole: nothing routed here can arrive after it
        self.control.send(worker_id, p.SwitchRole(worker_id, role))
        self._pending[worker_id] = PendingFlip(worker_id, w.role, role, time.monotonic() if now is None else now)
        log.info("flipping worker %s: %s -> %s", worker_id, w.role, role)
        return FlipResult(202, "switching", w.role, role, len(w.inflight))

    def pending(self) -> dict[str, PendingFlip]:
        """Flips not yet seen through: the worker has not registered again since."""
        for wid, flip in list(self._pending.items()):
            w = self.control.registry.get(wid)
            if w is None or (w.registered_at > flip.since and not w.draining):
                del self._pending[wid]
        return dict(self._pending)


class FlipCollector(Collector):
    """`llm_role_flips_total{from_role,to_role}`: flips the control plane saw complete."""

    def __init__(self, control: ControlPlane) -> None:
        self.control = control

    def collect(self) -> Iterable[Metric]:
        fam = CounterMetricFamily("llm_role_flips", "Live role flips completed (worker registered again "
                                  "in another role)", labels=["from_role", "to_role"])
        for (src, dst), count in sorted(self.control.role_flips.items()):
            fam.add_metric([src, dst], count)
        yield fam


ROLE_FLIPS: web.AppKey[RoleFlips | None] = web.AppKey("pdserve_role_flips", object)  # type: ignore[arg-type]


def check_admin(request: web.Request) -> None:
    """404 without an admin token configured, 401 unless the request carries it."""
    token = request.app[STATE].config.admin_token
    if token is None:
        raise APIError(404, "the admin API is not enabled (--admin-token)", code="not_found")
    try:
        check_authorization(request.headers.get("Authorization"), [token])
    except APIError as e:  # the same 401, worded for the admin token rather than an API key
        raise APIError(401, "this endpoint needs the admin token: send 'Authorization: Bearer <admin token>'",
                       code="invalid_admin_token", headers=e.headers, reason="unauthorized") from None


def _flips(request: web.Request) -> RoleFlips:
    flips = request.app.get(ROLE_FLIPS)
    if flips is None:
        raise APIError(404, "the admin API is not enabled (--admin-token)", code="not_found")
    check_admin(request)
    return flips


async def set_role(request: web.Request) -> web.Response:
    flips = _flips(request)
    data = await json_object(request, MAX_BODY_BYTES, request.app[STATE].config.connections.body_timeout_s)
    role = data.get("role")
    if not isinstance(role, str):
        raise APIError(400, 'expected {"role": "prefill" | "decode"}', param="role", code="bad_request")
    result = flips.request(request.match_info["worker_id"], role)
    if result.status != 202:
        raise APIError(result.status, result.message, param="role" if result.status == 400 else None,
                       code="conflict" if result.status == 409 else None)
    out = {"worker": request.match_info["worker_id"], "from": result.from_role, "to": result.to_role,
           "status": result.message, "inflight": result.inflight}
    return web.Response(status=202, body=json.dumps(out).encode(), content_type="application/json")


def add_admin_routes(app: web.Application, flips: RoleFlips | None) -> None:
    """The admin routes; `flips` None (no worker cluster behind the app): they answer 404."""
    app[ROLE_FLIPS] = flips
    app.router.add_post("/admin/workers/{worker_id}/role", set_role)
