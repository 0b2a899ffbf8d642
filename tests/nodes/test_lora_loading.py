"""LoRA adapters read off the worker's loop (pdserve/worker/lora_loading.py,
pdserve/engine/lora/loader.py), through a real colocated node and engine.

The read is held at the file-reading boundary (a gate in front of the registry's own
`read`, which the test opens): while it is held, a base-model request and a request of
a held adapter keep producing tokens step after step, and the request that needs the
adapter is not stepped at all; once the gate opens its tokens are exactly those of the
adapter registered up front. A read that fails answers its waiting requests with a
non-retryable error naming the problem and leaves nothing behind; an abort while the
read runs drops the request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pdserve.common import protocol as p
from pdserve.common.lora import LoraRef, lora_ref
from pdserve.common.roles import Role
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.lora.checkpoint import LoraWeights
from pdserve.engine.lora.loader import LoraLoader
from pdserve.worker.colocated import ColocatedNode
from pdserve.worker.lora_loading import LoraLoadingNode, lora_loading
from pdserve.worker.metrics import WorkerMetrics
from tests.engine.test_engine import assert_idle
from tests.engine.test_lora_checks import _bad_adapters
from tests.engine.test_lora_peft import PROMPTS, lora_engine, run_all

pytestmark = pytest.mark.usefixtures("one_torch_thread")
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


class Gate:
    """The registry's `read`, held until `open` is set."""

    def __init__(self, read: Callable[[LoraRef], LoraWeights]) -> None:
        self.read = read
        self.entered = threading.Event()
        self.open = threading.Event()

    def __call__(self, ref: LoraRef) -> LoraWeights:
        self.entered.set()
        assert self.open.wait(60), "the test never opened the gate"
        return self.read(ref)


class Node:
    def __init__(self, base: Path, gated: bool = True) -> None:
        self.engine = lora_engine(base, max_loras=2)
        self.out: list[p.Message] = []
        inner = ColocatedNode("c", self.engine, self.engine.runner, self.out.append, WorkerMetrics(Role.COLOCATED, "c"))
        assert self.engine.loras is not None
        self.gate = Gate(self.engine.loras.read)
        wrapped = lora_loading(inner) if not gated else LoraLoadingNode(inner, LoraLoader(self.gate))
        assert isinstance(wrapped, LoraLoadingNode)
        self.node = wrapped

    def run(self, rid: str, prompt: list[int], lora: LoraRef | None = None) -> None:
        self.node.handle(p.RunRequest(rid, p.RequestPayload(prompt, PARAMS, lora=lora)))

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.out if isinstance(m, p.TokenBatch) for d in m.deltas if d.request_id == rid
                for t in d.token_ids]

    def failures(self) -> dict[str, p.RequestFailed]:
        return {m.request_id: m for m in self.out if isinstance(m, p.RequestFailed)}

    def step_until(self, cond: Callable[[], bool], what: str) -> int:
        """Steps taken until `cond` holds (a generous deadline, never a sleep)."""
        deadline, steps = time.monotonic() + 60, 0
        while not cond():
            assert time.monotonic() < deadline, what
            self.node.step()
            steps += 1
        return steps


def _alone(base: Path, ref: LoraRef | None, prompt: list[int]) -> list[int]:
    engine = lora_engine(base, max_loras=2)
    engine.add_request("a", prompt, PARAMS, lora=ref)
    return run_all(engine)["a"]


def test_other_requests_keep_stepping_while_an_adapter_is_read(lora_model: Any) -> None:
    base, adapters = lora_model
    held, late = lora_ref("held", adapters["attn-r4"]), lora_ref("late", adapters["all-r16"])
    n = Node(base)
    n.engine.add_request("warm", PROMPTS[1], SamplingParams(max_tokens=1), lora=held)  # registered up front
    n.step_until(lambda: not n.engine.has_unfinished(), "warm-up request")
    n.run("base", PROMPTS[0])
    n.run("held", PROMPTS[1], held)
    n.run("late", PROMPTS[0], late)
    assert n.gate.entered.wait(30), "the read never started"
    assert n.node.waiting() == ("late",) and n.node.busy()
    assert n.node.load().waiting_seqs == n.node.node.load().waiting_seqs + 1  # counted as waiting
    # The read is held: the others step to 12 tokens each, the late request not at all.
    steps = n.step_until(lambda: min(len(n.tokens("base")), len(n.tokens("held"))) >= 12, "others stepping")
    assert steps >= 12 and n.tokens("late") == [] and n.node.waiting() == ("late",)
    assert n.engine.loras is not None and not n.engine.loras.holds(late.fingerprint)
    n.gate.open.set()
    n.step_until(lambda: len(n.tokens("late")) == PARAMS.max_tokens and not n.node.busy(), "the late request")
    assert n.tokens("late") == _alone(base, late, PROMPTS[0])
    assert n.tokens("held") == _alone(base, held, PROMPTS[1])
    assert n.tokens("base") == _alone(base, None, PROMPTS[0]) != n.tokens("late")
    assert n.failures() == {}
    assert_idle(n.engine)


def test_a_failed_read_is_a_clear_error_and_leaves_nothing(lora_model: Any, tmp_path: Path) -> None:
    base, adapters = lora_model
    bad_dir, words = _bad_adapters(adapters["all-r16"], tmp_path)["wrong-shape"]
    bad, good = lora_ref("bad", bad_dir), lora_ref("good", adapters["mlp-r8-rslora"])
    n = Node(base, gated=False)
    n.run("base", PROMPTS[0])
    n.run("bad-1", PROMPTS[0], bad)
    n.run("bad-2", PROMPTS[1], bad)  # one read for both
    n.step_until(lambda: {"bad-1", "bad-2"} <= set(n.failures()), "the refusals")
    for rid in ("bad-1", "bad-2"):
        failed = n.failures()[rid]
        assert not failed.retryable and words in failed.reason and failed.reason.startswith("invalid request"), failed
    registry = n.engine.loras
    assert registry is not None and not registry.holds(bad.fingerprint) and not registry.knows(bad.fingerprint)
    assert registry.counts().loads == 0 and n.node.waiting() == ()
    n.run("good", PROMPTS[1], good)  # the node still serves adapters after the refusal
    n.step_until(lambda: not n.node.busy(), "the other requests")
    assert n.tokens("good") == _alone(base, good, PROMPTS[1])
    assert n.tokens("base") == _alone(base, None, PROMPTS[0])
    assert n.tokens("bad-1") == n.tokens("bad-2") == []
    assert_idle(n.engine)


def test_a_request_aborted_while_its_adapter_is_read_never_runs(lora_model: Any) -> None:
    base, adapters = lora_model
    late = lora_ref("late", adapters["all-r16"])
    n = Node(base)
    n.run("late", PROMPTS[0], late)
    # It computes in the step its adapter is installed: a core-sharing worker keeps its cores.
    assert n.node.core_demand().keep and not n.node.node.core_demand().keep
    assert not n.node.core_demand().borrow
    n.node.handle(p.Abort(["late"], "client gone"))
    assert n.node.waiting() == () and not n.node.busy() and not n.node.core_demand().keep
    n.gate.open.set()
    registry = n.engine.loras
    assert registry is not None
    n.step_until(lambda: registry.holds(late.fingerprint), "the read to be installed")
    n.node.step()
    assert n.tokens("late") == [] and n.failures() == {} and not n.engine.has_unfinished()
    n.run("again", PROMPTS[0], late)  # held now: straight to the engine
    assert n.node.waiting() == ()
    n.step_until(lambda: not n.node.busy(), "the second request")
    assert n.tokens("again") == _alone(base, late, PROMPTS[0])
    assert_idle(n.engine)
