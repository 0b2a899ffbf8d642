"""One step through pipeline stages, in micro-batches.

A group of `tp` x `pp` ranks is a grid (`plan.grid_place`): stage s holds a slice of
the layers, and its `tp` ranks split those layers' heads, summing their partials with
one all-reduce per block inside the stage. Hidden states go from rank (s, t) to rank
(s + 1, t); the last stage's rank t = 0 hands them back to rank 0, which applies the
final norm, computes the logits and samples.

A step's chunks are cut into up to `pp` micro-batches (`micro_batches`, the same cut
on every rank). Sends are not waited for until the step's end, so stage 0 starts
micro-batch i + 1 while stage 1 still works on micro-batch i. Each stage runs the
micro-batches in order, so a sequence's KV written by an earlier micro-batch is in
the pool before a later one reads it. Every stage writes its layers' K/V into the
group's shared (full-layout) pool, so a step's KV is complete once rank 0 has every
micro-batch back, and `layer_hook` for the later stages' layers runs then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.parallel.comm import TPGroup
from pdserve.engine.parallel.plan import HeadRange, grid_place
from pdserve.engine.runner.model_runner import ModelRunner

# Rank 0's progress through a step, for tests and tracing: (event, micro-batch), the
# events "start" (its stage begins the micro-batch), "sent" (handed to stage 1) and
# "back" (the last stage's hidden states arrived).
PipeEvent = Callable[[str, int], None]


@dataclass(frozen=True)
class StageLinks:
    """Where one rank's hidden states come from and go to (group ranks)."""

    layers: HeadRange  # the stage's decoder layers
    stages: int
    prev: int | None  # None: stage 0, which embeds the tokens
    next: int | None  # None: a last-stage rank other than t = 0 (it keeps its copy)
    last: int  # the last stage's rank that returns the hidden states to rank 0


def stage_links(rank: int, tp: int, pp: int, layers: HeadRange) -> StageLinks:
    stage, t = grid_place(rank, tp)
    last = (pp - 1) * tp
    prev = None if stage == 0 else rank - tp
    if stage < pp - 1:
        nxt: int | None = rank + tp
    else:
        nxt = 0 if t == 0 else None
    return StageLinks(layers, pp, prev, nxt, last)


def micro_batches(chunks: Sequence[SeqChunk], count: int) -> list[Sequence[SeqChunk]]:
    """`chunks` cut, in order, into min(count, len(chunks)) near-equal runs."""
    n = max(1, min(count, len(chunks)))
    per, extra = divmod(len(chunks), n)
    out: list[Sequence[SeqChunk]] = []
    at = 0
    for i in range(n):
        size = per + (1 if i < extra else 0)
        out.append(chunks[at: at + size])
        at += size
    return out


def leader_step(runner: ModelRunner, group: TPGroup, chunks: Sequence[SeqChunk], links: StageLinks,
                layer_hook: Callable[[int], None] | None, on_event: PipeEvent | None = None) -> torch.Tensor:
    """Rank 0's part of a broadcast step; float32 logits as `ModelRunner.execute` returns."""
    emit = on_event or _ignore
    steps = [runner.step_inputs(mb) for mb in micro_batches(chunks, links.stages)]
    sends: list[tuple[Any, torch.Tensor]] = []
    for i, step in enumerate(steps):
        emit("start", i)
        h = F.embedding(step.input_ids, runner.model.embed_tokens)
        # Layer i's KV is complete once the last micro-batch has written it.
        hook = layer_hook if i == len(steps) - 1 else None
        h = runner.model.run_layers(h, step.positions, step.meta, runner.kv_layers, runner.backend, hook)
        assert links.next is not None
        sends.append((group.isend(h, links.next, i), h))
        emit("sent", i)
    logits = []
    for i, step in enumerate(steps):
        h = _hidden(runner, len(step.input_ids))
        group.recv(h, links.last, i)
        emit("back", i)
        logits.append(runner.logits(runner.model.norm(h), step.logit_rows, step.logit_index))
    _wait(sends)
    if layer_hook is not None:
        for layer in range(links.layers.stop, runner.model_config.num_layers):
            layer_hook(layer)
    return torch.cat(logits)


def stage_step(runner: ModelRunner, group: TPGroup, chunks: Sequence[SeqChunk], links: StageLinks) -> None:
    """Any other rank's part: each micro-batch's hidden states in from the previous stage
    (stage 0 embeds), through this stage's layers, out to the next."""
    sends: list[tuple[Any, torch.Tensor]] = []
    for i, mb in enumerate(micro_batches(chunks, links.stages)):
        step = runner.step_inputs(mb)
        if links.prev is None:
            h = F.embedding(step.input_ids, runner.model.embed_tokens)
        else:
            h = group.recv(_hidden(runner, len(step.input_ids)), links.prev, i)
        h = runner.model.run_layers(h, step.positions, step.meta, runner.kv_layers, runner.backend,
                                    first_layer=links.layers.start)
        if links.next is not None:
            sends.append((group.isend(h, links.next, i), h))
    _wait(sends)


def _hidden(runner: ModelRunner, tokens: int) -> torch.Tensor:
    return torch.empty(tokens, runner.model_config.hidden_size, dtype=runner.dtype, device=runner.device)


def _wait(sends: list[tuple[Any, torch.Tensor]]) -> None:
    """Every send of the step has been taken before its buffer goes."""
    for work, _ in sends:
        work.wait()


def _ignore(event: str, micro_batch: int) -> None:
    del event, micro_batch
