"""`prompt_logprobs` (vLLM's) and `echo` + `logprobs` through real processes: for llama,
qwen2 and mistral checkpoints served colocated, 1P+1D and 1P+2D (the prefill worker computes
them and ships them with the first token), every prompt token's logprob and top-n equal
transformers' float32 log-softmax within 1e-4, colocated equals 1P+1D equals 1P+2D, a prompt the
prefix cache already holds gives the same values, and the generated tokens are those
of the request without them; chat requests report them on the response. Bad values are
a 400 naming the parameter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.e2e.cluster import Cluster, http, sse
from tests.e2e.test_moe_serving import _servable
from tests.engine.test_hf_equivalence import prompt_of

ATOL = 1e-4
TOP = 2


def _hf_logprobs(model_dir: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)


def _check(entries: list[Any], want: torch.Tensor, prompt: list[int]) -> None:
    assert len(entries) == len(prompt) and entries[0] is None
    for pos in range(1, len(prompt)):
        entry = {int(k): v["logprob"] for k, v in entries[pos].items()}
        ref = want[pos - 1]
        vals, ids = torch.topk(ref, TOP)
        assert set(entry) == {prompt[pos], *ids.tolist()}, pos
        for tok, lp in entry.items():
            assert abs(lp - float(ref[tok])) <= ATOL, (pos, tok)


LAYOUTS = {"colocated": {"colocated": 1}, "1p1d": {"prefill": 1, "decode": 1}, "1p2d": {"prefill": 1, "decode": 2}}


def _cluster(log_dir: Path, model: Path, layout: str) -> Cluster:
    log_dir.mkdir(parents=True, exist_ok=True)
    c = Cluster(log_dir)
    c.start_gateway("--model", str(model), wait=False)
    for role, n in LAYOUTS[layout].items():
        for _ in range(n):
            c.add_worker("worker" if role == "colocated" else role, "--model", str(model))
    c.wait_gateway()
    c.wait_roles(**LAYOUTS[layout])
    return c


@pytest.fixture(scope="module")
def builtin(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = _cluster(tmp_path_factory.mktemp("builtin-1p1d"), model_dir, "1p1d")
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_prompt_logprobs_colocated_equal_1p1d_equal_1p2d_equal_transformers(
    tiny_model_dir: Callable[..., Path], model_dir: Path, tmp_path: Path, family: str,
) -> None:
    d = _servable(tiny_model_dir(family), model_dir, tmp_path / family)
    prompt = prompt_of(37, 352)
    want = _hf_logprobs(d, prompt)
    body = {"model": d.name, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    answers = {}
    for layout in LAYOUTS:
        c = _cluster(tmp_path / f"{family}-{layout}", d, layout)
        try:
            status, plain = http("POST", f"{c.url}/v1/completions", body)  # fills the prefix cache
            assert status == 200, plain
            status, out = http("POST", f"{c.url}/v1/completions", {**body, "prompt_logprobs": TOP})
            assert status == 200, out
            choice = out["choices"][0]
            _check(choice["prompt_logprobs"], want, prompt)
            assert choice["text"] == plain["choices"][0]["text"]
            # echo + logprobs: the prompt's tokens lead the logprobs, the first one null.
            status, echo = http("POST", f"{c.url}/v1/completions", {**body, "echo": True, "logprobs": TOP})
            assert status == 200, echo
            lp = echo["choices"][0]["logprobs"]
            assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(prompt) + 4
            for pos in range(1, len(prompt)):
                assert abs(lp["token_logprobs"][pos] - float(want[pos - 1][prompt[pos]])) <= ATOL
            answers[layout] = (choice["prompt_logprobs"], lp["token_logprobs"])
            for w in c.wait_idle():  # every KV block came back
                assert w["free_blocks"] == w["total_blocks"]
        finally:
            c.stop()
    assert answers["colocated"] == answers["1p1d"] == answers["1p2d"]  # bit for bit


def test_chat_and_streamed_completion_report_prompt_logprobs(builtin: Cluster, model_dir: Path) -> None:
    from gateway.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dir)
    msgs = [{"role": "user", "content": "Tell me about the sea."}]
    status, out = http("POST", f"{builtin.url}/v1/chat/completions",
                       {"messages": msgs, "max_tokens": 3, "prompt_logprobs": TOP})
    assert status == 200, out
    ids = list(tok.encode_chat(msgs))
    _check(out["prompt_logprobs"], _hf_logprobs(model_dir, ids), ids)

    prompt = "Once upon a time"
    chunks = sse(f"{builtin.url}/v1/completions", {"prompt": prompt, "max_tokens": 4, "stream": True,
                                                    "prompt_logprobs": 0, "echo": True})
    firsts = [ch for ch in chunks if isinstance(ch, dict) and ch.get("choices")]
    assert firsts[0]["choices"][0]["text"].startswith(prompt)
    assert len(firsts[0]["choices"][0]["prompt_logprobs"]) == len(tok.encode(prompt, add_special_tokens=True))
    assert all("prompt_logprobs" not in ch["choices"][0] for ch in firsts[1:])


@pytest.mark.parametrize("extra,param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"), ({"prompt_logprobs": "2"}, "prompt_logprobs"),
    ({"echo": "yes"}, "echo"),
])
def test_bad_prompt_logprobs_are_400(builtin: Cluster, extra: dict[str, Any], param: str) -> None:
    status, out = http("POST", f"{builtin.url}/v1/completions", {"prompt": "hi", "max_tokens": 2, **extra})
    assert status == 400 and out["error"]["param"] == param, out
