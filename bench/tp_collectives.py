"""Per-layer collective cost of tensor parallel: the two all-reduces a decoder layer
makes (attention block, MLP block) over [tokens, hidden] activations, and the step
broadcast rank 0 makes once per step, timed on the group `pdserve.engine.parallel` builds.

    python -m bench.tp_collectives --tp 2 --hidden 256 4096 8192 --tokens 1 16 512

With `--vocab V` it also times the LM head both ways: replicated (rank 0 alone, the
engine's choice) against vocabulary-parallel (each rank its V / tp rows, then an
all-gather of the logits).

Prints one JSON line per (hidden, tokens): the median microseconds of one all-reduce,
of one layer's two, and of one step broadcast (a decode batch of `tokens` sequences, 8
blocks each), every call after a barrier, the collectives taking turns. On CPU the group
is gloo over loopback.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from typing import Any

from bench import harness

REPEATS = 50
WARMUP = 5


def _group(rank: int, size: int, port: int, store: Any = None) -> Any:
    from pdserve.engine.parallel.comm import TPGroup, follower_store

    return TPGroup(store if store is not None else follower_store(port, size, 60.0), rank, size, 60.0)


def _run(rank: int, size: int, port: int, shapes: list[tuple[int, int]], dtype: str, vocab: int,
         store: Any = None) -> list[dict[str, Any]]:
    import torch

    from pdserve.engine.core.runner_types import SeqChunk
    from pdserve.engine.parallel.steps import encode_step

    torch.set_num_threads(1)
    group = _group(rank, size, port, store)
    rows = []
    for hidden, tokens in shapes:
        x = torch.randn(tokens, hidden, dtype=getattr(torch, dtype))
        step = encode_step([SeqChunk([1], 100, list(range(8)), True)] * tokens)  # `tokens` decodes
        t = harness.medians({"all_reduce": lambda: group.all_reduce(x),  # noqa: B023 (called at once)
                             "broadcast": lambda: group.broadcast_longs(step if rank == 0 else None)},  # noqa: B023
                            REPEATS, warmup=WARMUP, setup=group.barrier)
        one = t["all_reduce"] * 1e6
        row = {"tp": size, "hidden": hidden, "tokens": tokens, "dtype": dtype,
               "all_reduce_us": round(one, 1), "per_layer_us": round(2 * one, 1),
               "step_broadcast_us": round(t["broadcast"] * 1e6, 1)}
        if vocab:
            row.update(_lm_head(group, x, vocab, size))
        rows.append(row)
    return rows


def _lm_head(group: Any, x: Any, vocab: int, size: int) -> dict[str, float]:
    """Median microseconds of the full LM head on one rank, and of a 1/size slice plus the
    all-gather that vocabulary parallel needs (`group._pg`: the bench's own look inside)."""
    import torch
    import torch.nn.functional as F

    full_w = torch.randn(vocab, x.shape[1], dtype=x.dtype)
    part_w = full_w[: vocab // size].clone()

    def vocab_parallel() -> Any:
        local = F.linear(x, part_w)
        outs = [torch.empty_like(local) for _ in range(size)]
        group._pg.allgather([outs], [local]).wait()
        return torch.cat(outs, dim=-1)

    t = harness.medians({"full": lambda: F.linear(x, full_w), "part": vocab_parallel}, REPEATS, warmup=WARMUP,
                        setup=group.barrier)
    return {"vocab": vocab, "lm_head_replicated_us": round(t["full"] * 1e6, 1),
            "lm_head_vocab_parallel_us": round(t["part"] * 1e6, 1)}


def _follower(rank: int, size: int, port: int, shapes: list[tuple[int, int]], dtype: str, vocab: int) -> None:
    _run(rank, size, port, shapes, dtype, vocab)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 4096, 8192])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 512])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--vocab", type=int, default=0, help="also time the LM head over this vocabulary")
    args = ap.parse_args(argv)
    from pdserve.engine.parallel.comm import leader_store

    shapes = [(h, t) for h in args.hidden for t in args.tokens]
    print(harness.machine_line(), file=sys.stderr)  # stdout: JSON lines only
    store = leader_store(args.tp, 60.0)
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_follower, args=(r, args.tp, store.port, shapes, args.dtype, args.vocab))
             for r in range(1, args.tp)]
    for p in procs:
        p.start()
    for row in _run(0, args.tp, store.port, shapes, args.dtype, args.vocab, store=store):
        print(json.dumps(row))
    for p in procs:
        p.join(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
