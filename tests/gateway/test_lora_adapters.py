"""The gateway's LoRA adapters (gateway/lora_adapters.py): checked when added, by name,
never the base model's name, never unloaded while a request runs under one, confined to
`--lora-dir` when set; a request's model may name one; and the KV router keys a
request's blocks by its adapter, so a prefix cached under one adapter (or the base)
draws no request of another to that worker."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.kv_router import prompt_keys
from gateway.lora_adapters import GatewayLoraConfig, LoraAdapters
from gateway.validation import check_model
from pdserve.common.block_hash import prefix_block_keys, prefix_root
from pdserve.common.lora import LoraError, lora_ref
from pdserve.common.protocol import RequestPayload
from pdserve.common.sampling_params import SamplingParams


def _adapters(lora_model: tuple[Path, dict[str, Path]], **kw: object) -> LoraAdapters:
    _, paths = lora_model
    cfg = GatewayLoraConfig(modules=(("a", str(paths["attn-r4"])),), **kw)  # type: ignore[arg-type]
    return LoraAdapters(cfg, ("base", "alias"))


def test_adapters_are_checked_named_and_pinned_while_in_use(lora_model) -> None:
    _, paths = lora_model
    loras = _adapters(lora_model)
    assert "a" in loras and loras.get("a") == lora_ref("a", paths["attn-r4"])
    with pytest.raises(LoraError, match="already loaded"):
        loras.load("a", str(paths["all-r16"]))
    with pytest.raises(LoraError, match="the base model's name"):
        loras.load("alias", str(paths["all-r16"]))
    small = _adapters(lora_model, max_lora_rank=8)
    with pytest.raises(LoraError, match="rank 16 of model.layers.0.self_attn.q_proj is above"):
        small.load("big", str(paths["all-r16"]))
    assert "big" not in small
    loras.acquire("a")
    with pytest.raises(LoraError, match="in use by 1 request"):
        loras.unload("a")
    assert loras.running() == {"a": 1}
    loras.release("a")
    loras.unload("a")
    assert "a" not in loras and loras.running() == {}
    with pytest.raises(KeyError):
        loras.unload("a")


def test_runtime_loads_stay_under_the_lora_dir(lora_model, tmp_path: Path) -> None:
    _, paths = lora_model
    loras = _adapters(lora_model, allowed_dir=str(tmp_path))
    with pytest.raises(LoraError, match="outside the allowed directory"):
        loras.load("b", str(paths["all-r16"]))
    link = tmp_path / "sneaky"
    link.symlink_to(paths["all-r16"])  # resolved: a link out of the directory is outside too
    with pytest.raises(LoraError, match="outside the allowed directory"):
        loras.load("b", str(link))
    assert "a" in loras  # the startup modules are not confined


def test_a_request_may_name_an_adapter() -> None:
    config = GatewayConfig(model_name="base")
    check_model("base", config)
    check_model("a", config, {"a"})
    with pytest.raises(APIError) as e:
        check_model("b", config, {"a"})
    assert e.value.status == 404 and e.value.code == "model_not_found"


def test_router_keys_are_per_adapter(lora_model) -> None:
    _, paths = lora_model
    a, b = lora_ref("a", paths["attn-r4"]), lora_ref("b", paths["all-r16"])
    prompt = list(range(1, 42))
    params = SamplingParams(max_tokens=4)
    base_keys = prompt_keys(RequestPayload(prompt, params), 4)
    a_keys = prompt_keys(RequestPayload(prompt, params, None, a), 4)
    b_keys = prompt_keys(RequestPayload(prompt, params, None, b), 4)
    assert base_keys == prefix_block_keys(prompt, 4)
    assert a_keys == prefix_block_keys(prompt, 4, prefix_root(a.fingerprint))
    assert len(set(base_keys) | set(a_keys) | set(b_keys)) == 3 * len(base_keys)


def test_requests_go_to_the_worker_holding_their_adapter_until_its_load_outweighs_it(lora_model) -> None:
    from gateway.kv_index import KvIndex
    from gateway.kv_router import LORA_LOAD_TOKENS, KvRouter, RouterConfig
    from gateway.registry import WorkerInfo
    from pdserve.common.protocol import Heartbeat, RegisterWorker

    _, paths = lora_model
    ref = lora_ref("a", paths["attn-r4"])

    def worker(wid: str, queued: int, loras: list[str] | None) -> WorkerInfo:
        w = WorkerInfo(RegisterWorker(wid, "prefill", "h", "", "", "c", 256, 4, 0, 1), 0.0, 0.0)
        w.load = Heartbeat(wid, queued, 256, 256, 0, 0, loras=loras)
        return w

    router = KvRouter(RouterConfig("kv-aware", 0), KvIndex())
    payload = RequestPayload(list(range(1, 30)), SamplingParams(max_tokens=4), None, ref)
    has, lacks = worker("has", 10, [ref.fingerprint]), worker("lacks", 0, None)
    pick = router.pick([lacks, has], payload)
    assert pick is not None and pick.worker is has  # 10 queued tokens < reading the adapter
    busy = worker("has", LORA_LOAD_TOKENS + 1, [ref.fingerprint])
    pick = router.pick([lacks, busy], payload)
    assert pick is not None and pick.worker is lacks  # a hot adapter spreads
    base = router.pick([lacks, has], RequestPayload(list(range(1, 30)), SamplingParams(max_tokens=4)))
    assert base is not None and base.worker is lacks  # the base model needs no adapter
