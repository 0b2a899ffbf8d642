"""LoRA adapters through real processes and the official `openai` client.

`pdserve up --colocated --enable-lora --lora-modules ...` and a gateway with one
prefill and one decode worker: a request naming an adapter gets exactly the text the
single-process engine gives under that adapter (float32), with the base model and
other adapters running concurrently and the same prompt repeated under each (a
prefix-cache hit never crosses adapters); `/v1/models` lists the adapters with their
parent; adapters load and unload at run time behind the API key; bad adapters and
unknown names get clear OpenAI-shaped errors and the server keeps serving.
"""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.lora import LoraRef, lora_ref
from pdserve.common.sampling_params import SamplingParams
from tests.e2e.cluster import DTYPE, Cluster, http, metric_value, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up
from tests.helpers.lora_adapters import AdapterSpec, make_peft_adapter

KEY = "sk-lora-test-key"
ADAPTERS = (AdapterSpec("story-attn", 8, 16.0, ("q_proj", "k_proj", "v_proj", "o_proj"), seed=11),
            AdapterSpec("story-mlp", 4, 8.0, ("gate_proj", "up_proj", "down_proj"), rslora=True, seed=12),
            AdapterSpec("story-late", 16, 16.0, ("q_proj", "down_proj"), seed=13))
PROMPTS = ("Once upon a time", "The little dog")
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {s.name: make_peft_adapter(model_dir, root / s.name, s) for s in ADAPTERS}


@pytest.fixture(scope="module")
def lora_engine(model_dir: Path, reference: Reference, adapters: dict[str, Path]) -> Any:
    """greedy(adapter or "", prompt, max_tokens): the single-process engine's text."""
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.lora.config import LoraConfig

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype=DTYPE, num_threads=1,
                                    cache=CacheConfig(num_blocks=256),
                                    lora=LoraConfig(max_loras=3, max_lora_rank=16)))
    refs: dict[str, LoraRef | None] = {"": None, **{n: lora_ref(n, p) for n, p in adapters.items()}}

    def greedy(name: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
        engine.add_request("r", reference.completion_ids(prompt),
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                           lora=refs[name])
        toks: list[int] = []
        while engine.has_unfinished():
            for o in engine.step():
                toks.extend(o.outputs[0].token_ids)
        return reference.text(toks)

    return greedy


@pytest.fixture(scope="module")
def lora_reference(lora_engine: Any, adapters: dict[str, Path]) -> dict[tuple[str, str], str]:
    """The single-process engine's greedy text per (adapter or "", prompt)."""
    out = {(n, p): lora_engine(n, p) for n in ["", *adapters] for p in PROMPTS}
    assert len({out[n, PROMPTS[0]] for n in ["", *adapters]}) == len(adapters) + 1  # each changes the text
    return out


def _complete(client: Any, model: str, prompt: str) -> str:
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert comp.model == model
    return str(comp.choices[0].text)


def _mixed_concurrently(client: Any, models: list[str], rounds: int = 2) -> dict[tuple[str, str, int], str]:
    """Every (model, prompt) `rounds` times, all at once."""
    got: dict[tuple[str, str, int], str] = {}
    errors: list[BaseException] = []

    def one(m: str, p: str, r: int) -> None:
        try:
            got[m, p, r] = _complete(client, m, p)
        except BaseException as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(m, p, r)) for r in range(rounds) for m in models for p in PROMPTS]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return got


@pytest.fixture(scope="module")
def up_url(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("up-lora") / "up.log"
    first, second = list(adapters)[:2]
    with pdserve_up(log, "--colocated", "--num-blocks", "256", "--threads", "1", "--dtype", DTYPE, "--api-key", KEY,
                    "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16",
                    "--lora-dir", str(adapters[first].parent),
                    "--lora-modules", f"{first}={adapters[first]}", f"{second}={adapters[second]}") as up:
        yield up.url


def test_up_serves_adapters_colocated(up_url: str, reference: Reference, adapters: dict[str, Path],
                                      lora_reference: dict[tuple[str, str], str], tmp_path: Path,
                                      tiny_model_dir: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=up_url, api_key=KEY, max_retries=0)
    first, second, third = list(adapters)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {reference.model_name, first, second}
    assert cards[first].model_extra["parent"] == reference.model_name
    assert cards[first].model_extra["root"] == str(adapters[first].resolve())

    got = _mixed_concurrently(client, [reference.model_name, first, second])
    for (m, p, _), text in got.items():
        assert text == lora_reference["" if m == reference.model_name else m, p], (m, p)

    with pytest.raises(openai.NotFoundError) as nf:
        _complete(client, third, PROMPTS[0])
    assert nf.value.body["code"] == "model_not_found"  # type: ignore[index]

    base = up_url.removesuffix("/v1")
    auth = {"Authorization": f"Bearer {KEY}"}
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": third, "lora_path": str(adapters[third])})[0] == 401
    status, text = _post(base, "/v1/load_lora_adapter", {"lora_name": third, "lora_path": str(adapters[third])}, auth)
    assert status == 200, text
    assert _complete(client, third, PROMPTS[1]) == lora_reference[third, PROMPTS[1]]  # a third adapter: LRU at work
    assert _complete(client, first, PROMPTS[1]) == lora_reference[first, PROMPTS[1]]

    bad = _bad_requests(adapters, tmp_path, third)
    for body, path, want_status, words in bad:
        status, err = _post(base, path, body, auth)
        assert status == want_status, (body, err)
        assert words in str(err), (body, err)
    # An adapter of another base model (hidden 64): its header is self-consistent, so the
    # gateway serves it; the worker checks it against the model, refuses every request
    # under it with a 400 naming the shapes, and serves the others.
    other = make_peft_adapter(tiny_model_dir("llama"), adapters[first].parent / "other-base", ADAPTERS[0])
    assert _post(base, "/v1/load_lora_adapter", {"lora_name": "other", "lora_path": str(other)}, auth)[0] == 200
    with pytest.raises(openai.BadRequestError) as bad_req:
        _complete(client, "other", PROMPTS[0])
    assert "the model needs" in str(bad_req.value)
    assert _complete(client, first, PROMPTS[0]) == lora_reference[first, PROMPTS[0]]
    assert _post(base, "/v1/unload_lora_adapter", {"lora_name": "other"}, auth)[0] == 200
    status, _ = _post(base, "/v1/unload_lora_adapter", {"lora_name": third}, auth)
    assert status == 200
    with pytest.raises(openai.NotFoundError):
        _complete(client, third, PROMPTS[0])
    assert _complete(client, second, PROMPTS[0]) == lora_reference[second, PROMPTS[0]]  # still serving
    metrics = http("GET", f"{base}/metrics")[1]
    assert metric_value(metrics, "llm_lora_adapter_loads_total") == 2
    assert metric_value(metrics, "llm_lora_adapter_unloads_total") == 2


def _post(base: str, path: str, body: Any, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    import json
    import urllib.error
    import urllib.request

    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _bad_requests(adapters: dict[str, Path], tmp: Path, loaded: str) -> list[tuple[dict[str, str], str, int, str]]:
    """(body, route, status, words in the error) of requests the server must refuse."""
    inside = adapters[loaded].parent  # the --lora-dir
    no_weights = inside / "no-weights"
    shutil.copytree(adapters[loaded], no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    outside = tmp / "outside"
    shutil.copytree(adapters[loaded], outside)
    big = "story-late"  # rank 16: fine here; the limit is tested with --max-lora-rank 16 and a rank-32 copy
    rank32 = inside / "rank32"
    _rank32(adapters[big], rank32)
    load = "/v1/load_lora_adapter"
    return [
        ({"lora_name": loaded, "lora_path": str(adapters[loaded])}, load, 409, "already been loaded"),
        ({"lora_name": "x", "lora_path": str(no_weights)}, load, 400, "has no adapter_model.safetensors"),
        ({"lora_name": "x", "lora_path": str(inside / "missing")}, load, 400, "is not a directory"),
        ({"lora_name": "x", "lora_path": str(outside)}, load, 400, "outside the allowed directory"),
        ({"lora_name": "x", "lora_path": str(rank32)}, load, 400, "above --max-lora-rank 16"),
        ({"lora_name": "x"}, load, 400, "lora_path must be a non-empty string"),
        ({"lora_name": "nobody"}, "/v1/unload_lora_adapter", 404, "cannot be found"),
    ]


def _rank32(src: Path, dst: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "adapter_model.safetensors"))
    t = {k: torch.cat([v, v], dim=0 if "lora_A" in k else 1).contiguous() for k, v in t.items()}
    save_file(t, str(dst / "adapter_model.safetensors"))
    cfg = json.loads((dst / "adapter_config.json").read_text())
    cfg["r"] = 32
    (dst / "adapter_config.json").write_text(json.dumps(cfg))


def test_one_prefill_one_decode_serve_adapters_exactly(log_dir: Path, reference: Reference,
                                                       adapters: dict[str, Path],
                                                       lora_reference: dict[tuple[str, str], str]) -> None:
    """The adapter travels to prefill and decode in the request; the decode worker, which
    never saw it, loads it from the payload and checks its fingerprint."""
    import openai

    names = list(adapters)
    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    c = Cluster(log_dir)
    try:
        c.start_gateway(*lora, "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()), wait=False)
        c.add_worker("prefill", *lora)
        c.add_worker("decode", *lora)
        c.wait_gateway()
        c.wait_roles(prefill=1, decode=1)
        client = openai.OpenAI(base_url=f"{c.url}/v1", api_key="unused", max_retries=0)
        got = _mixed_concurrently(client, [reference.model_name, *names])
        for (m, p, _), text in got.items():
            assert text == lora_reference["" if m == reference.model_name else m, p], (m, p)
        fps = {lora_ref(n, p).fingerprint for n, p in adapters.items()}

        def both_hold_all() -> bool:  # the heartbeats carry what each worker holds (routing)
            return all(set(w["lora_fingerprints"]) == fps for w in c.worker_list())

        c._wait(both_hold_all, "both workers holding the three adapters")
        # The same prompt under A, then B, then the base, one after another: every
        # answer is its own adapter's, however warm the prefix caches are.
        for _ in range(2):
            for m in [*names, reference.model_name]:
                want = lora_reference["" if m == reference.model_name else m, PROMPTS[0]]
                assert _complete(client, m, PROMPTS[0]) == want, m
        c.wait_idle()
        for w in c.worker_list():  # each worker read each adapter once (all three stay resident)
            text = worker_metrics(w)
            assert metric_value(text, "llm_lora_adapter_reads") == 3, w["role"]
            assert metric_value(text, "llm_lora_adapter_evictions") == 0, w["role"]
            assert "llm_lora_requests_info{" in text
    finally:
        c.stop()


def test_kill_decode_mid_stream_under_adapters_recovers_exactly(
    log_dir: Path, reference: Reference, adapters: dict[str, Path], lora_engine: Any,
) -> None:
    """A decode worker killed with SIGKILL mid-stream: each stream re-prefills under its
    own adapter on the prefill worker and continues on the other decode worker, exactly."""
    from tests.e2e.test_exact_recovery import KEY as SEED_KEY
    from tests.e2e.test_exact_recovery import Stream

    lora = ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
    c = Cluster(log_dir)
    try:
        c.start_gateway("--heartbeat-timeout", "1.5", "--router", "least-loaded", *lora,
                        "--lora-modules", *(f"{n}={p}" for n, p in adapters.items()),
                        env={"PDSERVE_GATEWAY_SEED_KEY": SEED_KEY.hex()})
        c.add_worker("prefill", *lora)
        victim = c.add_worker("decode", "--num-blocks", "1024", "--enable-fault-injection", *lora,
                              env={"PDSERVE_FAULTS": "step_delay_s=0.1"})
        c.add_worker("decode", *lora)
        c.wait_roles(prefill=1, decode=2)
        models = [*adapters, reference.model_name]
        streams = [Stream(c.url, f"lora-kill-{i}", {"model": m, "prompt": f"Stream {i} goes on",
                                                    "max_tokens": 30, "temperature": 0, "ignore_eos": True})
                   for i, m in enumerate(models)]
        for s in streams:
            s.thread.start()
        for s in streams:
            s.wait_chunks(3)
        held = {w["pid"]: w["inflight_requests"] for w in c.worker_list() if w["role"] == "decode"}
        assert held[victim.popen.pid] == len(streams), held
        victim.signal(signal.SIGKILL)
        for i, (s, m) in enumerate(zip(streams, models, strict=True)):
            want = lora_engine("" if m == reference.model_name else m, f"Stream {i} goes on", 30)
            assert s.result() == ([want], ["length"]), m
        gateway_log = c.gateway.log_path.read_text() if c.gateway else ""
        assert all(f"recovering {s.rid} " in gateway_log for s in streams)
        c.wait_roles(prefill=1, decode=1)
        c.wait_idle(timeout=50)
    finally:
        c.stop()
