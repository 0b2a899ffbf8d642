"""Load a local Hugging Face checkpoint directory into an engine model.

Only `safetensors` files are read (never pickle). Every failure is a
`CheckpointError` whose message is one line naming the problem.
"""

from __future__ import annotations

import json
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pdserve.common import envs
from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError
from pdserve.engine.loading.weights_fingerprint import (
    FingerprintError,
    WeightsFingerprint,
    fingerprint_files,
)
from pdserve.engine.models import MODEL_REGISTRY, LlamaForCausalLM
from pdserve.engine.models.llama import WeightSpec
from pdserve.engine.parallel.plan import ParallelLayoutError, TPShard, check_tp_quant, local_config
from pdserve.engine.parallel.quant_shard import quantized_linear, slice_int4
from pdserve.engine.parallel.weights import shard_source, shard_span, stage_specs
from pdserve.engine.quant.checkpoint import load_linear
from pdserve.engine.quant.formats import (
    ON_THE_FLY,
    QuantizationError,
    served_lm_head,
    served_quantization,
)
from pdserve.engine.quant.linear import Int8Linear, set_weight
from pdserve.engine.quant.pack import Int4Parts, quantize_int8
from pdserve.engine.runner.kv_pool import TORCH_DTYPES

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def load_config(model_dir: str | Path) -> ModelConfig:
    """Parse and validate the model config; raise CheckpointError if unusable."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"model directory {d} does not exist")
    try:
        return ModelConfig.from_hf_dir(d)
    except ModelConfigError as e:
        raise CheckpointError(str(e)) from e


def weight_files(model_dir: Path) -> dict[str, Path]:
    """Checkpoint tensor name -> file holding it, from `model.safetensors.index.json`.

    A single `model.safetensors` (preferred when both exist) is returned as {"*": path}.
    """
    single = model_dir / SINGLE_FILE
    index = model_dir / INDEX_FILE
    if single.is_file():
        return {"*": single}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in sorted(set(files.values())):
            if not path.is_file():
                raise CheckpointError(f"weight shard {path} listed in {INDEX_FILE} is missing")
        return files
    raise CheckpointError(
        f"no weights in {model_dir}: neither {SINGLE_FILE} nor {INDEX_FILE} found"
    )


def weights_fingerprint(model_dir: str | Path) -> WeightsFingerprint:
    """The checkpoint's weights fingerprint: every weight file (and the shard index) hashed
    once, then cached beside the model or under `<PDSERVE_HOME>/weights-fingerprints`."""
    d = Path(model_dir)
    by_tensor = weight_files(d)
    files = set(by_tensor.values())
    if "*" not in by_tensor:
        files.add(d / INDEX_FILE)  # it says which shard a tensor is read from
    try:
        return fingerprint_files(d, sorted(files), envs.home() / "weights-fingerprints")
    except FingerprintError as e:
        raise CheckpointError(str(e)) from e


class _Tensors:
    """Lazy access to checkpoint tensors across one or many safetensors files."""

    def __init__(self, files: dict[str, Path], stack: ExitStack) -> None:
        self._files = files
        self._stack = stack
        self._open: dict[Path, Any] = {}
        self._keys: dict[Path, set[str]] = {}

    def _handle(self, path: Path) -> Any:
        if path not in self._open:
            try:
                handle = self._stack.enter_context(safe_open(str(path), framework="pt"))
                self._keys[path] = set(handle.keys())
                self._open[path] = handle
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"{path} is truncated or corrupt: {e}") from e
        return self._open[path]

    def _path_of(self, name: str) -> Path | None:
        if "*" in self._files:
            path = self._files["*"]
            self._handle(path)
            return path if name in self._keys[path] else None
        return self._files.get(name)

    def has(self, name: str) -> bool:
        path = self._path_of(name)
        if path is None:
            return False
        self._handle(path)
        return name in self._keys[path]

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        path = self._path_of(name)
        if path is None:
            raise CheckpointError(f"checkpoint is missing tensor {name!r}")
        handle = self._handle(path)
        if name not in self._keys[path]:
            raise CheckpointError(
                f"checkpoint is missing tensor {name!r} (expected in {path.name})"
            )
        try:
            got = tuple(handle.get_slice(name).get_shape())
        except Exception as e:
            raise CheckpointError(f"{path} is truncated or corrupt reading {name!r}: {e}") from e
        if got != shape:
            raise CheckpointError(
                f"shape mismatch for tensor {name!r}: expected {list(shape)}, got {list(got)}"
            )
        try:
            return handle.get_tensor(name)
        except Exception as e:
            raise CheckpointError(f"{path} is truncated or corrupt reading {name!r}: {e}") from e


def load_model(
    model_dir: str | Path, dtype: torch.dtype | str, device: torch.device | str
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """Build the model for `model_dir` and fill its weights; returns (config, model).

    `dtype` is a torch dtype or its name ("float32", "float16", "bfloat16").
    """
    return load_model_with(model_dir, dtype, device, max_positions=None)


def load_model_with(
    model_dir: str | Path,
    dtype: torch.dtype | str,
    device: torch.device | str,
    max_positions: int | None,
    quantization: str = "none",
    shard: TPShard | None = None,
    lm_head_quantization: str = "auto",
) -> tuple[ModelConfig, LlamaForCausalLM]:
    """`load_model` with RoPE tables sized for `max_positions` (default: the model's maximum)
    and the decoder linears quantized on the fly (`quantization` int8 | int4) or read as
    stored from an AWQ/GPTQ checkpoint (pdserve/engine/quant), and the LM head per
    `lm_head_quantization` (auto | none | int8: `served_lm_head`).

    With `shard`, the model holds one tensor-parallel rank's slice (`pdserve.engine.parallel`);
    the returned config is still the full model's."""
    if isinstance(dtype, str):
        if dtype not in TORCH_DTYPES:
            raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(TORCH_DTYPES)}")
        dtype = TORCH_DTYPES[dtype]
    d = Path(model_dir)
    cfg = load_config(d)
    try:
        scheme = served_quantization(quantization, cfg.prequant)
        head = served_lm_head(lm_head_quantization, scheme)
    except QuantizationError as e:
        raise CheckpointError(str(e)) from e
    if shard is not None:
        try:
            check_tp_quant(cfg, shard.size, scheme)
        except ParallelLayoutError as e:
            raise CheckpointError(str(e)) from e
    files = weight_files(d)
    dev = torch.device(device)
    model_cls = MODEL_REGISTRY[cfg.architecture]
    model_cfg = cfg if shard is None else local_config(cfg, shard)
    model = model_cls(model_cfg, dtype, dev, max_positions=max_positions)
    params = dict(model.named_parameters())
    specs = model.weight_specs() if shard is None else _full_specs(model_cls, cfg, dtype)
    if shard is not None and shard.layers is not None:
        specs = stage_specs(specs, shard.layers)
    unfilled = set(params) - {s.param for s in specs}
    if unfilled:  # a model bug, not a checkpoint problem
        raise RuntimeError(f"weight_specs() leaves parameters unfilled: {sorted(unfilled)}")
    linears = set(model.linear_weights())
    prequant = linears if cfg.prequant is not None else set()
    with ExitStack() as stack, torch.no_grad():
        tensors = _Tensors(files, stack)
        for spec in specs:
            if spec.param in prequant and cfg.prequant is not None:
                part_of = None if shard is None else partial(_int4_part, spec.param, shard, cfg.head_dim)
                try:
                    layer = load_linear(tensors.get, tensors.has, spec.sources, cfg.prequant, dtype, dev, part_of)
                except QuantizationError as e:
                    raise CheckpointError(str(e)) from e
                set_weight(model, spec.param, layer)
                continue
            parts = [tensors.get(name, shape) for name, shape in spec.sources]
            if scheme in ON_THE_FLY and spec.param in linears:  # quantized whole, then sliced
                set_weight(model, spec.param,
                           quantized_linear(spec.param, parts, scheme, dtype, dev, shard, cfg.head_dim))
                continue
            if shard is not None:
                parts = [shard_source(spec.param, i, t, shard, cfg.head_dim) for i, t in enumerate(parts)]
            value = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
            params[spec.param].copy_(value.to(dtype))
        if head == "int8":
            quantize_lm_head(model, dtype, dev)
    return cfg, model.eval()


def quantize_lm_head(model: LlamaForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Give `model` an int8 per-output-channel LM head computing in `dtype`: an untied
    head's float weight is dropped, a tied one keeps the embedding for the lookup."""
    weight = model.embed_tokens if model.lm_head is None else model.lm_head
    model.lm_head_q = Int8Linear(quantize_int8(weight.detach()), dtype, device)
    if model.lm_head is not None:
        model.lm_head = None


def _int4_part(param: str, shard: TPShard, head_dim: int, index: int, parts: Int4Parts) -> Int4Parts:
    """The rank's slice of source `index` of a pre-quantized linear."""
    return slice_int4(parts, shard_span(param, index, shard, head_dim), param)


def _full_specs(model_cls: type[LlamaForCausalLM], cfg: ModelConfig, dtype: torch.dtype) -> list[WeightSpec]:
    """The checkpoint's (full-size) tensors, from a model on the meta device (no memory)."""
    return model_cls(cfg, dtype, torch.device("meta"), max_positions=1).weight_specs()
