"""Which slice of the model one tensor-parallel rank holds (torch-free).

Attention heads and the MLP's intermediate dimension are split evenly across the
`size` ranks. KV heads are split too while there are at least as many as ranks;
with fewer KV heads than ranks each KV head is replicated on `size // num_kv_heads`
consecutive ranks, so rank r holds KV head `r // replicas` -- the one its query heads
attend to (query head q reads KV head `q // (num_heads // num_kv_heads)`).

The embedding, the final norm and the LM head are replicated: every rank ends a step
with the full hidden state, and rank 0 alone computes logits and samples.

Tensor and pipeline parallel combine as a grid of `tp` x `pp` ranks: rank
`stage * tp + t` is tensor-parallel rank t of pipeline stage `stage` (`grid_place`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from pdserve.engine.loading.model_config import ModelConfig
from pdserve.engine.quant.formats import INT4_GROUP, QuantizationError


class ParallelLayoutError(ValueError):
    """A model that cannot be split across the requested ranks; the message names why."""


@dataclass(frozen=True)
class HeadRange:
    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class TPShard:
    """Rank `rank` of `size`: its query heads, KV heads and intermediate columns."""

    rank: int
    size: int
    q_heads: HeadRange
    kv_heads: HeadRange
    inter: HeadRange  # columns of gate/up (rows of down)
    layers: HeadRange | None = None  # a pipeline stage's decoder layers; None: all of them
    stage: int = 0  # the pipeline stage this rank belongs to


def check_tp(cfg: ModelConfig, size: int) -> None:
    """Raise ParallelLayoutError unless `cfg` splits across `size` ranks."""
    if size < 1:
        raise ParallelLayoutError(f"tensor_parallel_size must be >= 1, got {size}")
    if cfg.num_heads % size:
        raise ParallelLayoutError(
            f"tensor_parallel_size {size} does not divide the {cfg.num_heads} attention heads")
    kvh = cfg.num_kv_heads
    if kvh % size and size % kvh:
        raise ParallelLayoutError(
            f"tensor_parallel_size {size} and the {kvh} KV heads do not divide one another")
    if cfg.intermediate_size % size:
        raise ParallelLayoutError(
            f"tensor_parallel_size {size} does not divide intermediate_size {cfg.intermediate_size}")


def check_tp_quant(cfg: ModelConfig, size: int, scheme: str) -> None:
    """Raise ParallelLayoutError unless weights quantized under `scheme` split across
    `size` ranks. int8 always does (a per-output-channel scale follows its channel, or
    is the whole row's on every rank); an int4 group (128 channels, or an AWQ/GPTQ
    checkpoint's group) must never straddle two ranks of a row-parallel layer, so each
    rank's share of o_proj's and down_proj's input channels must be whole groups."""
    if size == 1 or scheme not in ("int4", "awq", "gptq"):
        return
    for name, k in (("o_proj", cfg.q_size), ("down_proj", cfg.intermediate_size)):
        try:
            group = INT4_GROUP if cfg.prequant is None else cfg.prequant.kernel_group(k)
        except QuantizationError as e:
            raise ParallelLayoutError(str(e)) from e
        if (k // size) % group:
            raise ParallelLayoutError(
                f"{scheme} weights under tensor_parallel_size {size}: {name}'s {k} input channels give "
                f"{k // size} per rank, not a multiple of the {group}-channel quantization group "
                "(a group may not straddle two ranks)")


def tp_shard(cfg: ModelConfig, size: int, rank: int) -> TPShard:
    """The slice rank `rank` of a `size`-way tensor-parallel group holds."""
    check_tp(cfg, size)
    if not 0 <= rank < size:
        raise ParallelLayoutError(f"rank {rank} is outside a group of {size}")
    q = cfg.num_heads // size
    kvh = cfg.num_kv_heads
    if kvh >= size:
        per = kvh // size
        kv = HeadRange(rank * per, (rank + 1) * per)
    else:
        head = rank // (size // kvh)
        kv = HeadRange(head, head + 1)
    inter = cfg.intermediate_size // size
    return TPShard(rank, size, HeadRange(rank * q, (rank + 1) * q), kv,
                   HeadRange(rank * inter, (rank + 1) * inter))


def check_pp(cfg: ModelConfig, stages: int) -> None:
    """Raise ParallelLayoutError unless `cfg` splits into `stages` pipeline stages."""
    if stages < 1:
        raise ParallelLayoutError(f"pipeline_parallel_size must be >= 1, got {stages}")
    if stages > cfg.num_layers:
        raise ParallelLayoutError(f"pipeline_parallel_size {stages} exceeds the {cfg.num_layers} layers")


def stage_layers(num_layers: int, stages: int, stage: int) -> HeadRange:
    """Stage `stage`'s layers: an even split, the first stages taking one more."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return HeadRange(start, start + per + (1 if stage < extra else 0))


def local_config(cfg: ModelConfig, shard: TPShard) -> ModelConfig:
    """The config of the rank's slice: its head counts and intermediate size; the rest
    (hidden size, head_dim, vocabulary) is the full model's."""
    layers = cfg.num_layers if shard.layers is None else shard.layers.count
    return dataclasses.replace(cfg, num_heads=shard.q_heads.count,
                               num_kv_heads=shard.kv_heads.count,
                               intermediate_size=shard.inter.count, num_layers=layers)


class GridPlace(NamedTuple):
    stage: int
    tp_rank: int


def grid_place(rank: int, tp: int) -> GridPlace:
    """Where group rank `rank` sits in a grid of `tp`-wide stages."""
    stage, t = divmod(rank, tp)
    return GridPlace(stage, t)


def rank_shard(cfg: ModelConfig, tp: int, pp: int, rank: int) -> TPShard:
    """Rank `rank` of a group of `tp` x `pp` ranks: its stage's layers (all of them
    without pipeline parallel) and its tensor-parallel slice of their heads."""
    check_pp(cfg, pp)
    check_tp(cfg, tp)
    if not 0 <= rank < tp * pp:
        raise ParallelLayoutError(f"rank {rank} is outside a group of {tp} x {pp}")
    place = grid_place(rank, tp)
    shard = tp_shard(cfg, tp, place.tp_rank)
    if pp == 1:
        return shard
    return dataclasses.replace(shard, layers=stage_layers(cfg.num_layers, pp, place.stage), stage=place.stage)
