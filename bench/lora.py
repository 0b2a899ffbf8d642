"""LoRA serving cost: engine output tok/s of 16 streams spread over 4 adapters against
the same 16 streams on the base model, in one run.

    .venv/bin/python -m bench.lora [--model DIR|shape:NAME] [--streams 16] [--adapters 4]
        [--rank 16] [--output-len 64] [--rounds 3] [--threads N]

Two engines over the same weights: one without LoRA (the baseline), one with
`--enable-lora --max-loras ADAPTERS` serving ADAPTERS random PEFT adapters of rank RANK
on all seven projections (written here in PEFT's layout), streams assigned to them in
turn, so every decode step mixes every adapter. Each round runs the same prompts on
each engine (fresh prompts every round: no prefix-cache hit), base first in even rounds
and LoRA first in odd ones, and counts output tokens over the whole run (prefill
included, as a client sees it). Prints each round's rates and the median ratio LoRA /
base (the issue's target: at least 0.75), by wall clock and by this process's CPU time
(the engine runs on this process's threads; the CPU-time ratio is the one other
processes' load does not move).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import harness
from pdserve.common.sampling_params import SamplingParams

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: str, out: Path, rank: int, seed: int) -> Path:
    """A random PEFT LoRA adapter (non-zero B) for the model at `model`."""
    import torch
    from safetensors.torch import save_file

    from pdserve.engine.loading.loader import load_config
    from pdserve.engine.lora.checkpoint import projection_dims

    dims = projection_dims(load_config(model))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(dims.num_layers):
        for name in PROJECTIONS:
            _, n_out, n_in = dims.module(name)
            block = "self_attn" if name in PROJECTIONS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * 0.02
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJECTIONS),
              "bias": "none", "base_model_name_or_path": model}
    (out / "adapter_config.json").write_text(json.dumps(config))
    return out


def build(model: str, threads: int, max_loras: int, rank: int) -> Any:
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.lora.config import LoraConfig

    lora = LoraConfig(max_loras=max_loras, max_lora_rank=rank) if max_loras else None
    return LLMEngine(EngineConfig(model_dir=model, num_threads=threads, lora=lora))


def run(engine: Any, prompts: list[list[int]], loras: list[Any], output_len: int) -> tuple[float, float]:
    """(output tok/s by wall clock, by CPU time) of all prompts at once."""
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    tag = random.getrandbits(32)
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params, lora=loras[i % len(loras)] if loras else None)
    tokens, t0, c0 = 0, time.perf_counter(), time.process_time()
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for o in engine.step() for c in o.outputs)
    return tokens / (time.perf_counter() - t0), tokens / (time.process_time() - c0)


def main() -> None:
    ap = harness.parser(__doc__, engine_threads=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    from pdserve.common.lora import lora_ref

    model = harness.model_dir(args.model)
    with tempfile.TemporaryDirectory(prefix="bench-lora-") as tmp:
        loras = [lora_ref(f"a{i}", write_adapter(model, Path(tmp) / f"a{i}", args.rank, i))
                 for i in range(args.adapters)]
        base, lora = build(model, args.threads, 0, args.rank), build(model, args.threads, args.adapters, args.rank)
        vocab = base.vocab_size
        rounds = []
        for r in range(args.rounds):
            rng = random.Random(r)
            prompts = [[rng.randrange(5, vocab) for _ in range(args.prompt_len)] for _ in range(args.streams)]
            order = [("base", base, []), ("lora", lora, loras)]
            rates = {name: run(e, prompts, ls, args.output_len) for name, e, ls in (order if r % 2 == 0 else order[::-1])}
            ratio = (rates["lora"][0] / rates["base"][0], rates["lora"][1] / rates["base"][1])
            rounds.append({"base": rates["base"], "lora": rates["lora"], "ratio": ratio})
            print(f"round {r}: base {rates['base'][0]:.1f} tok/s, lora {rates['lora'][0]:.1f} tok/s, "
                  f"ratio {ratio[0]:.3f} (cpu-time {ratio[1]:.3f})", flush=True)
    wall = statistics.median(x["ratio"][0] for x in rounds)
    cpu = statistics.median(x["ratio"][1] for x in rounds)
    print(f"median LoRA/base output tok/s: {wall:.3f} (cpu-time {cpu:.3f}); {args.streams} streams over "
          f"{args.adapters} adapters of rank {args.rank} on all 7 projections; target >= 0.75")
    harness.write_json(args.output_json, {"rounds": rounds, "median_ratio": wall, "median_cpu_ratio": cpu,
                                          "streams": args.streams, "adapters": args.adapters, "rank": args.rank})


if __name__ == "__main__":
    main()
