"""How the thread governor is wired into a worker: the governed node times each engine
step and sizes it from the node's token count, counts switches in the role's metrics,
composes with a borrower's core grant, and the CLI picks the policy."""

from __future__ import annotations

import pytest

from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.up import _worker_cmds
from pdserve.cli.workers import thread_policy
from pdserve.common import protocol as p
from pdserve.worker.cpu_cores import CoreGrant
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import NodeLoad
from pdserve.worker.spin_throttle import available as spin_throttle_available
from pdserve.worker.thread_governor import Mode, ThreadGovernor
from pdserve.worker.thread_policy import GovernedNode, governed_grant, governor_for


class FakeNode:
    """Each step computes `per_step` tokens and takes `cost[threads]` on the fake clock."""

    role = "colocated"

    def __init__(self, clock: list[float], threads: list[int], cost: dict[int, float]) -> None:
        self.clock, self.threads, self.cost = clock, threads, cost
        self.tokens, self.per_step, self.work = 0, 16, True

    def step(self) -> bool:
        if not self.work:
            return False
        self.clock[0] += self.cost[self.threads[-1]]
        self.tokens += self.per_step
        return True

    def load(self) -> NodeLoad:
        return NodeLoad(0, 10, 10, 1, 0, tokens=self.tokens)

    def handle(self, msg: p.Message) -> None: ...
    def busy(self) -> bool: return self.work
    def close(self) -> None: ...


def governed(cost: dict[int, float]) -> tuple[GovernedNode, FakeNode, ThreadGovernor, WorkerMetrics]:
    clock, threads = [0.0], [2]
    gov = ThreadGovernor(2, clock=lambda: clock[0], apply=threads.append)
    node = FakeNode(clock, threads, cost)
    metrics = WorkerMetrics("colocated", "w1")
    return GovernedNode(node, gov, metrics, timer=lambda: clock[0]), node, gov, metrics


def sample(metrics: WorkerMetrics, prefix: str) -> float:
    line = next(x for x in metrics.render().decode().splitlines() if x.startswith(prefix))
    return float(line.rsplit(" ", 1)[1])


def test_the_governed_node_times_steps_and_counts_the_switch() -> None:
    gnode, node, gov, metrics = governed({2: 0.02, 1: 0.03})
    for _ in range(40):  # the main loop: a step, then the load
        gnode.step()
        gnode.load()
    assert gov.level(2, 16) == pytest.approx(0.02)  # 16 tokens a step: bucket 16
    assert sample(metrics, "llm_torch_threads{") == 2.0
    node.cost = {2: 0.2, 1: 0.03}  # a busy neighbour
    for _ in range(6):  # 3 collapsed steps, then 3 of the probe
        gnode.step()
        gnode.load()
    assert node.threads[-1] == 1 and sample(metrics, "llm_torch_threads{") == 1.0
    assert sample(metrics, 'llm_thread_switches_total{reason="contention"') == 1.0


def test_steps_without_a_load_read_between_are_still_observed_once() -> None:
    gnode, node, gov, _ = governed({2: 0.02, 1: 0.03})
    for _ in range(4):
        gnode.step()  # nobody calls load(): the next step settles the last one
    node.work = False
    assert gnode.step() is False  # an idle tick is not a step
    gnode.load()
    assert gov.level(2, 16) == pytest.approx(0.02)
    assert gov.level(2, 1) is None  # the idle tick was not recorded as a 0-token step
    node.work, node.per_step = True, 0  # steps that compute nothing (KV polling)
    for _ in range(10):
        gnode.step()
        gnode.load()
    assert gov.level(2, 1) is None and len(gov._times[(Mode(2), 16)]) == 4


def test_a_borrowers_grant_is_applied_with_the_governors_count() -> None:
    gov = ThreadGovernor(1, apply=lambda n: None)
    applied: list[CoreGrant] = []
    apply = governed_grant(gov, applied.append)
    apply(CoreGrant((1, 0), 2))  # widened: the governor may use both
    gov.low = True  # contention seen: it runs 1 thread
    apply(CoreGrant((1,), 1))
    apply(CoreGrant((1, 0), 2))
    assert applied == [CoreGrant((1, 0), 2), CoreGrant((1,), 1), CoreGrant((1, 0), 1)]
    assert gov.ceiling == 2


def _worker(*argv: str) -> str:
    args = build_parser().parse_args(["worker", "--colocated", "--gateway", "tcp://127.0.0.1:1", *argv])
    return thread_policy(args)


def test_the_cli_defaults_to_adaptive_where_a_cpu_worker_has_a_choice() -> None:
    assert _worker("--threads", "2") == "adaptive"
    assert _worker("--threads", "1") == "fixed"  # nothing to choose
    assert _worker("--threads", "2", "--thread-policy", "fixed") == "fixed"
    assert _worker("--threads", "2", "--device", "cuda") == "fixed"
    assert _worker("--threads", "2", "--tensor-parallel-size", "2") == "fixed"
    for argv in (("--device", "cuda"), ("--pipeline-parallel-size", "2")):
        with pytest.raises(UsageError, match="--thread-policy"):
            _worker("--thread-policy", "adaptive", *argv)
    decode = build_parser().parse_args(["decode", "--gateway", "tcp://127.0.0.1:1", "--cpu-cores", "0",
                                        "--borrow-cores", "1", "--core-share", "/x"])
    assert thread_policy(decode) == "adaptive"  # 1 thread of its own, 2 while it borrows


def test_up_passes_the_policy_through() -> None:
    def policies(*argv: str) -> list[str | None]:
        cmds = _worker_cmds(build_parser().parse_args(["up", "--colocated", *argv]), "tcp://x:1")
        return [c[c.index("--thread-policy") + 1] if "--thread-policy" in c else None for c in cmds]

    assert policies() == [None]  # each worker's own default
    assert policies("--thread-policy", "fixed") == ["fixed"]
    assert policies("--thread-policy", "adaptive") == ["adaptive"]


def test_a_worker_governor_throttles_waits_on_libgomp_unless_the_policy_is_passive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    if not spin_throttle_available():
        pytest.skip("torch's OpenMP here is not libgomp")
    assert governor_for(2).low_mode == Mode(2, throttled=True)
    assert governor_for(1).low_mode == Mode(1)  # one thread: nothing spins
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")  # the team never spins: 1 thread is the other choice
    assert governor_for(2).low_mode == Mode(1)
