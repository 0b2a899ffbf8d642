"""Undisturbed twins of the soak's recovered streams.

A stream the gateway recovered (it logs `recovering <request id> (attempt N)`
each time an attempt fails over) and that still completed for the client is
run again, after the soak, by the single-process engine on the same model and
dtype with the same sampling parameters and seed: the client's seed, or the
one the gateway assigned, `assigned_seed(key, request id)`, which the soak can
rebuild because it runs the gateway with a known `PDSERVE_GATEWAY_SEED_KEY`.
The twin's text and finish reason must equal what the client received.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from bench.soak_traffic import Completed
from bench.soak_verdict import TwinCheck
from gateway.cluster import assigned_seed
from pdserve.common.sampling_params import SamplingParams

RECOVERING = re.compile(r"recovering ([A-Za-z0-9._:\-]+) \(attempt \d+\)")
PARAM_KEYS = ("max_tokens", "temperature", "ignore_eos", "seed", "frequency_penalty", "presence_penalty")
SHOWN_CHARS = 60
TWIN_BATCH = 16
TWIN_KV_BLOCKS = 2048  # room for a whole batch of the soak's longest requests: no preemption


class TwinEngine(Protocol):
    """What the twins need: the reference engine behind the gateway's tokenizer."""

    def run(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[tuple[str, str]]:
        """(text, finish reason) of each undisturbed generation of (prompt, params)."""
        ...


def recovered_ids(gateway_log: str) -> set[str]:
    """The request ids the gateway recovered at least once."""
    return set(RECOVERING.findall(gateway_log))


def twin_params(rid: str, body: Mapping[str, Any], seed_key: bytes) -> SamplingParams:
    """The sampling parameters the workers ran request `rid` with, its seed included."""
    knobs = {k: body[k] for k in PARAM_KEYS if k in body}
    if knobs.get("seed") is None:
        knobs["seed"] = assigned_seed(seed_key, rid)
    return SamplingParams(**knobs)


def check_twins(recovered: Iterable[str], completed: Mapping[str, Completed], engine: TwinEngine,
                seed_key: bytes) -> TwinCheck:
    """Compare every recovered, completed stream with its twin; count the sampled ones."""
    rids = sorted(set(recovered) & set(completed))
    params = [twin_params(rid, completed[rid].body, seed_key) for rid in rids]
    twins = engine.run([(str(completed[rid].body["prompt"]), sp) for rid, sp in zip(rids, params, strict=True)])
    mismatches = []
    for rid, sp, (text, finish) in zip(rids, params, twins, strict=True):
        got = completed[rid]
        if (text, finish) != (got.text, got.finish_reason):
            mismatches.append(f"{rid} (temperature {sp.temperature}): client {got.finish_reason} "
                              f"{got.text[:SHOWN_CHARS]!r} vs twin {finish} {text[:SHOWN_CHARS]!r}")
    return TwinCheck(len(rids), sum(not sp.greedy for sp in params), tuple(mismatches))


class ReferenceTwins:
    """`TwinEngine` over `pdserve.engine.llm_engine.LLMEngine` and the gateway's tokenizer
    (imports torch; built only after the soak). Twins run in batches of `TWIN_BATCH`:
    a sequence's tokens do not depend on what it is batched with (the engine's
    invariant the soak itself exercises), and batches make the check fast."""

    def __init__(self, model_dir: str, dtype: str, threads: int) -> None:
        from gateway.tokenizer import Tokenizer
        from pdserve.engine.core.config import CacheConfig, EngineConfig
        from pdserve.engine.llm_engine import LLMEngine

        cache = CacheConfig(num_blocks=TWIN_KV_BLOCKS)
        self.engine = LLMEngine(EngineConfig(model_dir=model_dir, dtype=dtype, num_threads=threads, cache=cache))
        self.tokenizer = Tokenizer.from_model_dir(model_dir)

    def run(self, requests: Sequence[tuple[str, SamplingParams]]) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        for i in range(0, len(requests), TWIN_BATCH):
            batch = requests[i:i + TWIN_BATCH]
            prompts = [list(self.tokenizer.encode(prompt, add_special_tokens=True)) for prompt, _ in batch]
            for result in self.engine.generate(prompts, [sp for _, sp in batch]):
                choice = result.choices[0]
                text = self.tokenizer.decode(list(choice.token_ids), skip_special_tokens=True)
                out.append((str(text), str(choice.finish_reason)))
        return out
