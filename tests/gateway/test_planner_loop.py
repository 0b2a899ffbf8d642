"""The planner inside the gateway (gateway/planner_loop.py): signals from the registry and
the latency histograms, flips through the admin path, metrics. No sockets: the control
plane is never started, so what it would send is only recorded."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from gateway.admin_roles import RoleFlips
from gateway.control_plane import ClusterConfig, ControlPlane
from gateway.planner import PlannerConfig, PlannerSettings
from gateway.planner_loop import HistogramWindow, PlannerCollector, PlannerLoop
from pdserve.common import protocol as p
from pdserve.common.slo import Slo


class _Events:
    def deliver(self, sender: str, wid: str, event: Any) -> None: ...

    def lost(self, w: Any) -> None: ...


class _Control(ControlPlane):
    def __init__(self) -> None:
        super().__init__(ClusterConfig(), _Events())
        self.sent: list[tuple[str, p.Message]] = []

    def send(self, worker_id: str, msg: p.Message) -> None:
        self.sent.append((worker_id, msg))


def _register(control: ControlPlane, wid: str, role: str, now: float = 0.0) -> None:
    reg = p.RegisterWorker(wid, role, "host", "", "", "hash", 100, 16, 0, 1)
    assert control.registry.register(reg, now).accepted
    control.registry.heartbeat(p.Heartbeat(wid, 0, 100, 100, 1 if role == "decode" else 0, 0), now)


def _loop(mode: str, prefill: int = 2, decode: int = 2) -> tuple[PlannerLoop, _Control, Histogram]:
    control = _Control()
    for i in range(prefill):
        _register(control, f"p{i}", "prefill")
    for i in range(decode):
        _register(control, f"d{i}", "decode")
    r = CollectorRegistry()
    ttft = Histogram("ttft", "", buckets=(0.5, 1.0, 2.0, 4.0), registry=r)
    cfg = PlannerConfig(Slo(1.0, 0.05), dwell_s=10.0, cooldown_s=10.0)
    return PlannerLoop(PlannerSettings(cfg, mode=mode), control.registry, RoleFlips(control), ttft), control, ttft


def test_histogram_window_forgets_what_is_older_than_the_window() -> None:
    h = Histogram("h", "", buckets=(0.1, 1.0, 10.0), registry=CollectorRegistry())
    w = HistogramWindow(h, window_s=10.0)
    assert w.quantile(0.9, 0.0) is None
    for _ in range(10):
        h.observe(5.0)
    assert w.quantile(0.9, 1.0) == 10.0
    for _ in range(10):
        h.observe(0.05)
    assert w.quantile(0.5, 12.0) == 0.1  # the slow ones fell out of the window
    h.observe(50.0)
    assert w.quantile(0.99, 13.0) == 20.0  # past the last bucket: twice its bound


@pytest.mark.parametrize("mode", ["flip", "replicas"])
def test_sustained_slow_ttft_moves_a_decode_worker_to_prefill(mode: str) -> None:
    loop, control, ttft = _loop(mode)
    t = 0.0
    actions = []
    while t <= 30.0:
        for _ in range(5):
            ttft.observe(3.0)  # 3x the TTFT target, ITL idle
        d = loop.tick(t)
        actions.append(d.action.value if d else "pending")
        t += 2.0
    assert actions.count("to_prefill") == 1
    assert actions.index("to_prefill") == 5  # wanted from t=0, acted once 10 s of dwell passed
    text = generate_latest(_registry_of(loop)).decode()
    assert 'llm_planner_desired_workers{role="prefill"} 3.0' in text
    assert 'llm_planner_decisions_total{action="to_prefill"} 1.0' in text
    assert set(actions[6:]) == {"pending"}  # nothing decided while the split is under way
    if mode == "replicas":  # the autoscaler moves a worker: the planner decides again
        assert control.sent == [] and all(not w.draining for w in control.registry.all())
        control.registry.remove("d1")
        _register(control, "p9", "prefill")
        assert loop.tick(t) is not None
        return
    (wid, msg), = control.sent
    assert msg == p.SwitchRole(wid, "prefill") and wid.startswith("d")
    assert control.registry.get(wid).draining  # type: ignore[union-attr]
    _register(control, wid, "prefill", now=1e9)  # the worker came back as prefill
    assert loop.flips.pending() == {}
    assert loop.tick(1e9 + 1) is not None


def test_the_last_worker_of_a_role_is_never_flipped() -> None:
    loop, control, ttft = _loop("flip", prefill=1, decode=1)
    for t in range(0, 60, 2):
        ttft.observe(9.0)
        loop.tick(float(t))
    assert control.sent == []
    assert loop.flips.request("d0", "prefill").status == 409


def test_decode_itl_comes_from_the_decode_workers_heartbeats() -> None:
    """Two decode workers with 4 running sequences each; d0 decodes 80 tokens in 2 s
    (ITL 4 * 2 / 80 = 0.1 s), d1 twice as fast: the slower one counts (2x the target)."""
    loop, control, _ = _loop("flip", prefill=2, decode=2)

    def beat(t: float, tokens: dict[str, float]) -> None:
        for wid, n in tokens.items():
            control.registry.heartbeat(p.Heartbeat(wid, 0, 80, 100, 4, 0, gauges={"llm_decode_tokens_count": n}), t)

    beat(0.0, {"d0": 0.0, "d1": 0.0})
    assert loop.sample(0.0).itl_s is None
    beat(2.0, {"d0": 80.0, "d1": 160.0})
    s = loop.sample(2.0)
    assert s.itl_s == pytest.approx(0.1) and s.kv_usage == pytest.approx(0.2)
    actions = []
    for i in range(2, 12):
        beat(2.0 * i, {"d0": 40.0 * i, "d1": 80.0 * i})
        d = loop.tick(2.0 * i)
        actions.append(d.action.value if d else "pending")
    assert "to_decode" in actions  # ITL 2x its target, prefill idle: a prefill worker moves
    (wid, msg), = control.sent
    assert msg == p.SwitchRole(wid, "decode") and wid.startswith("p")


def _registry_of(loop: PlannerLoop) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(PlannerCollector(loop))
    return r
