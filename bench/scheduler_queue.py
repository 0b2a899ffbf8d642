"""Scheduler step time against the length of the waiting queue.

Each step admits the sequences at the head of a long WAITING queue; they end and as
many new ones queue at its tail, so every step does the same work and only the queue
length differs. Prints the
mean step time per queue length and its ratio to the shortest queue (one run, so
the ratios share the machine's load).

    python -m bench.scheduler_queue [--steps 200] [--lengths 10 1000 10000] [--cap 0]
"""

from __future__ import annotations

import argparse

from bench import harness
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.scheduler import Scheduler
from pdserve.engine.core.sequence import Sequence, SequenceStatus


def _seq(i: int) -> Sequence:
    return Sequence(i, f"r{i}", 0, [i % 50, 1, 2, 3], SamplingParams(max_tokens=4), sampling_seed=0)


def step_seconds(num_waiting: int, steps: int, cap: int) -> float:
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8,
                          long_prefill_token_threshold=cap)
    s = Scheduler(cfg, BlockManager(64, 4), max_model_len=64)
    for i in range(num_waiting):
        s.add(_seq(i))
    total, next_id = 0.0, num_waiting
    for _ in range(steps):
        sec, out = harness.timed(s.schedule)
        total += sec
        for seq in out.seqs:  # end the admitted ones, queue as many new: the length holds
            s.finish(seq, SequenceStatus.FINISHED_STOPPED)
            s.add(_seq(next_id))
            next_id += 1
    return total / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--lengths", type=int, nargs="+", default=[10, 1000, 10000])
    ap.add_argument("--cap", type=int, default=0, help="long_prefill_token_threshold")
    args = ap.parse_args()
    print(harness.machine_line())
    base = 0.0
    for n in args.lengths:
        sec = step_seconds(n, args.steps, args.cap)
        base = base or sec
        print(f"waiting={n:>6}  step={sec * 1e6:9.1f} us  ratio={sec / base:7.2f}")


if __name__ == "__main__":
    main()
