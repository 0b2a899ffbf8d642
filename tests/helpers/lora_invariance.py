"""The bf16 invariance checks of tests/engine/test_lora_bf16_invariance.py, run in a process of
their own (a `PDSERVE_CPU_FEATURES` mask is read when the native library loads):

    python -m tests.helpers.lora_invariance BASE '{"name": "dir", ...}' '[[rid, name, prompt, seed], ...]'

prints one JSON line: the bf16 kernel that ran, the stacked LoRA update of synthetic
adapters (elements that differ between each adapter alone and every mixed stack), and
each request's tokens and logprobs run alone and all at once.
"""

from __future__ import annotations

import itertools
import json
import sys
from typing import Any

import torch

from pdserve.common.logprobs import Logprob
from pdserve.common.lora import lora_ref
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.kernels import bf16_gemv
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.lora.batch import LoraBatch, LoraStack
from pdserve.engine.lora.checkpoint import FusedDelta, LoraWeights
from pdserve.engine.lora.config import LoraConfig

ROWS, IN, OUT = 8192, 96, 80


def _spread(g: torch.Generator, *shape: int) -> torch.Tensor:
    """bf16 values over 24 binades: their float32 sums round, so the order they are added
    in shows in the bits."""
    return (torch.randn(*shape, generator=g)
            * torch.exp2(torch.randint(-12, 13, shape, generator=g).float())).bfloat16()


def stacked_update_differences() -> tuple[int, int]:
    """(elements that differ, elements compared): each of three adapters of ranks 3, 5 and
    16, alone, against every order of the three stacked, its rows interleaved with the
    other adapters' and base rows."""
    g = torch.Generator().manual_seed(0)
    ws = [LoraWeights(fp, r, ("o_proj",), ({"o": FusedDelta(_spread(g, r, IN), _spread(g, OUT, r),
                                                             torch.full((r,), 0.5).bfloat16())},))
          for fp, r in (("a", 3), ("b", 5), ("c", 16))]
    x = _spread(g, ROWS, IN)
    differ = total = 0
    for k, w in enumerate(ws):
        alone = LoraBatch(LoraStack([w]), torch.zeros(ROWS, dtype=torch.long)).layer(0)
        want = alone.apply("o", x, torch.zeros(ROWS, OUT, dtype=torch.bfloat16))
        for order in itertools.permutations(range(len(ws))):
            slot = order.index(k)
            rows = torch.arange(ROWS) % (len(ws) + 1) - 1  # every slot and the base (-1) in turn
            rows[::2] = slot
            mixed = LoraBatch(LoraStack([ws[i] for i in order]), rows).layer(0)
            got = mixed.apply("o", x, torch.zeros(ROWS, OUT, dtype=torch.bfloat16))
            mine = rows == slot
            differ += int((got[mine] != want[mine]).sum())
            total += int(mine.sum()) * OUT
    return differ, total


def _lp(x: Logprob | None) -> Any:
    return None if x is None else [x.token_id, x.logprob, [[t.token_id, t.logprob] for t in x.top]]


def _run(engine: LLMEngine, requests: list[Any], refs: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Each request's tokens, sampled logprobs and prompt logprobs; the most adapters
    (base included) one step ran."""
    for rid, name, prompt, seed in requests:
        engine.add_request(rid, prompt, SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=seed,
                                                       logprobs=5, prompt_logprobs=5, ignore_eos=True),
                           lora=refs.get(name))
    got: dict[str, Any] = {}
    width = 0
    while engine.has_unfinished():
        batch = engine.schedule()
        width = max(width, len({c.lora_id for c in batch.chunks}))
        for out in engine.execute(batch):
            g = got.setdefault(out.request_id, {"tokens": [], "logprobs": [], "prompt": None})
            c = out.outputs[0]
            g["tokens"] += list(c.token_ids)
            g["logprobs"] += [_lp(x) for x in (c.logprobs or ())]
            if out.prompt_logprobs is not None:
                g["prompt"] = [_lp(x) for x in out.prompt_logprobs]
    return got, width


def main() -> None:
    base, adapters, requests = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    torch.set_num_threads(1)
    refs = {n: lora_ref(n, p) for n, p in adapters.items()}

    def engine() -> LLMEngine:
        return LLMEngine(EngineConfig(model_dir=base, dtype="bfloat16", num_threads=1,
                                      cache=CacheConfig(block_size=4, num_blocks=512),
                                      lora=LoraConfig(max_loras=3, max_lora_rank=16)))

    alone: dict[str, Any] = {}
    e = engine()
    for r in requests:
        alone.update(_run(e, [r], refs)[0])
    mixed, width = _run(engine(), requests, refs)
    differ, total = stacked_update_differences()
    print(json.dumps({"kernel": bf16_gemv.kernel(), "stack_differ": differ, "stack_total": total,
                      "alone": alone, "mixed": mixed, "width": width}))


if __name__ == "__main__":
    main()
