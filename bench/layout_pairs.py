"""KV handoff between every (prefill layout, decode layout) pair with TP, PP in {1, 2}
(16 pairs) through real processes: each pair's greedy text against the single-process
engine, token for token. Each layout is started once (tests/e2e/layout_grid.py: one
gateway per pair), so the sweep costs 8 workers (18 processes) and 16 gateways.

    python -m bench.layout_pairs [--prompts 3] [--max-tokens 24]

Prints one line per pair and exits 1 if any pair differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from bench import harness
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import default_model_dir
from pdserve.engine.core.config import CacheConfig, EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from tests.e2e.cluster import DTYPE
from tests.e2e.conftest import Reference
from tests.e2e.layout_grid import LAYOUTS, LayoutGrid

PROMPTS = ["The quick brown fox", "Once upon a time in a land", "1, 2, 3, 4,", "Hello, my name is"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    model_dir = Path(default_model_dir())
    cfg = EngineConfig(model_dir=str(model_dir), dtype=DTYPE, num_threads=1, cache=CacheConfig(num_blocks=256))
    ref = Reference(LLMEngine(cfg), Tokenizer.from_model_dir(model_dir), model_dir.name)
    prompts = PROMPTS[: args.prompts]
    want = {prompt: ref.text(ref.generate(ref.completion_ids(prompt), max_tokens=args.max_tokens,
                                          temperature=0.0, ignore_eos=True)[0]) for prompt in prompts}
    names = list(LAYOUTS)
    with tempfile.TemporaryDirectory() as d:
        grid = LayoutGrid(Path(d), names, names)
        watch = harness.Stopwatch()
        failed = 0
        try:
            grid.start()
            print(f"started {len(names)} x {len(names)} layouts in {watch.lap():.0f} s")
            for p, dl in grid.pairs():
                body = {"model": ref.model_name, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
                got = [grid.complete(p, dl, {**body, "prompt": prompt}) for prompt in prompts]
                same = [g == want[prompt] for g, prompt in zip(got, prompts, strict=True)]
                failed += not all(same)
                print(f"{p:>7} -> {dl:<7} {'identical' if all(same) else 'DIFFERS'} ({sum(same)}/{len(same)})")
            grid.wait_idle()
        finally:
            grid.stop()
    print(f"{16 - failed}/16 pairs identical to the single-process engine")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
