"""One step through pipeline stages: rank 0 embeds and runs its layers, each stage runs
its own and hands the hidden states to the next, the last hands them back to rank 0,
which applies the final norm, computes the logits and samples.

Stages run one step at a time: the pipeline splits a model's memory across processes
but does not overlap micro-batches yet. Every stage writes its layers' K/V into the
group's shared (full-layout) pool, so a step's KV is complete once rank 0 has the
hidden states back, and `layer_hook` for the later stages' layers runs then.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from engine.model_runner import ModelRunner
from engine.parallel.comm import TPGroup
from engine.parallel.plan import HeadRange
from engine.runner_types import SeqChunk


def leader_step(runner: ModelRunner, group: TPGroup, chunks: Sequence[SeqChunk], layers: HeadRange,
                layer_hook: Callable[[int], None] | None) -> torch.Tensor:
    """Rank 0's part of a broadcast step; float32 logits as `ModelRunner.execute` returns."""
    step = runner.step_inputs(chunks)
    h = F.embedding(step.input_ids, runner.model.embed_tokens)
    h = runner.model.run_layers(h, step.positions, step.meta, runner.kv_layers, runner.backend, layer_hook)
    group.send(h, 1)
    group.recv(h, group.size - 1)
    if layer_hook is not None:
        for i in range(layers.stop, runner.model_config.num_layers):
            layer_hook(i)
    return runner.logits(runner.model.norm(h), step.logit_rows)


def stage_step(runner: ModelRunner, group: TPGroup, chunks: Sequence[SeqChunk], layers: HeadRange) -> None:
    """A later stage's part: hidden states in from the previous stage, out to the next
    (the last stage's go back to rank 0)."""
    step = runner.step_inputs(chunks)
    h = torch.empty(len(step.input_ids), runner.model_config.hidden_size, dtype=runner.dtype,
                    device=runner.device)
    group.recv(h, group.rank - 1)
    h = runner.model.run_layers(h, step.positions, step.meta, runner.kv_layers, runner.backend,
                                first_layer=layers.start)
    group.send(h, (group.rank + 1) % group.size)
