"""RoleSwitcher and the misrouted-request answer (pdserve/worker/role_switch.py), with builders
that record what they build and clean up (the e2e flip is tests/e2e/test_role_flip.py)."""

from __future__ import annotations

from typing import Any

from pdserve.common import protocol as p
from pdserve.common.sampling_params import SamplingParams
from pdserve.worker.main import NodeParts, WorkerOptions
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.role_switch import RoleSwitcher, misrouted


class _Node:
    def __init__(self, role: str, log: list[str]) -> None:
        self.role, self.log = role, log

    def close(self) -> None:
        self.log.append(f"close {self.role}")


class _Links:
    def send(self, msg: p.Message) -> None: ...
    def wake(self) -> None: ...


def _switcher(log: list[str], fail: str = "", **opts: Any) -> RoleSwitcher:
    def builder(role: str) -> Any:
        def build(cfg: Any, o: WorkerOptions, parts: NodeParts) -> tuple[Any, list[Any]]:
            assert o.role == role and parts.metrics.gauges() is not None
            if role == fail:
                raise RuntimeError("no memory")
            log.append(f"build {role}")
            return _Node(role, log), [lambda: log.append(f"cleanup {role}")]
        return build

    o = WorkerOptions(role="decode", gateways=("tcp://127.0.0.1:1",), **opts)
    return RoleSwitcher(None, o, {"prefill": builder("prefill"), "decode": builder("decode")},  # type: ignore[arg-type]
                        lambda role: NodeParts("w1", _Links(), WorkerMetrics(role, "w1"), None))  # type: ignore[arg-type]


def test_switch_closes_and_cleans_up_the_old_node_before_building_the_new_one() -> None:
    log: list[str] = []
    sw = _switcher(log)
    node = sw.build("decode")
    assert sw.metrics is not None and sw.metrics._role == "decode"
    node = sw.switch(node, "prefill")
    assert log == ["build decode", "close decode", "cleanup decode", "build prefill"]
    assert (node.role, sw.role, sw.flips) == ("prefill", "prefill", 1)
    assert sw.metrics._role == "prefill"
    sw.close()
    sw.close()  # once only
    assert log[-1] == "cleanup prefill" and log.count("cleanup prefill") == 1


def test_a_failed_build_brings_the_old_role_back() -> None:
    log: list[str] = []
    sw = _switcher(log, fail="prefill")
    node = sw.switch(sw.build("decode"), "prefill")
    assert (node.role, sw.role, sw.flips) == ("decode", "decode", 0)
    assert log == ["build decode", "close decode", "cleanup decode", "build decode"]


def test_refusals() -> None:
    assert _switcher([]).refusal("prefill").ok
    assert "can only switch to" in _switcher([]).refusal("colocated").reason
    assert "--core-share" in _switcher([], core_share="/tmp/share").refusal("prefill").reason
    colocated = _switcher([])
    colocated.role = "colocated"
    assert "does not switch" in colocated.refusal("decode").reason


def test_requests_for_the_role_left_behind_fail_retryably() -> None:
    payload = p.RequestPayload([1, 2, 3], SamplingParams(max_tokens=2))
    prefill_req = p.PrefillRequest("r1#1", payload)
    reserve = p.DecodeReserve("r2#1", "x1", payload)
    failed = misrouted("decode", prefill_req)
    assert failed == p.RequestFailed("r1#1", "this worker serves decode now", retryable=True)
    assert misrouted("prefill", reserve) is not None
    assert misrouted("prefill", p.RunRequest("r3#1", payload)) is not None
    assert misrouted("prefill", prefill_req) is None
    assert misrouted("decode", reserve) is None
    assert misrouted("colocated", prefill_req) is None
    assert misrouted("decode", p.Abort(["r1#1"], "x")) is None
