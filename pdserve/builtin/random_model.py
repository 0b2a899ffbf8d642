"""The built-in random-weight Llama checkpoint (benchmarks and plumbing tests).

`write_random_model(dir)` writes a complete Hugging Face directory —
`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json` (with a Llama-3-style chat template) — so every code
path that loads real checkpoints loads this one too. The tokenizer is a real
byte-level BPE trained on `pdserve.builtin.corpus`; the weights are N(0, 0.02) from a
fixed seed. Two builds give byte-identical files. A `DefaultModelSpec` gives any
Llama shape (the benchmarks' 125M and 8B shapes), a `WeightFormat` its storage.

`pdserve.builtin.default_model` serves this checkpoint as `pdserve-tiny-llama` when
`PDSERVE_BUILTIN_WEIGHTS=random` (the plumbing tests do), and the trained one otherwise.

This module deliberately needs only numpy, safetensors and tokenizers — not
torch — so torch-free processes (the gateway) can resolve the default model.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from pdserve.builtin.corpus import corpus_text
from pdserve.builtin.tokenizer import (
    BOS_TOKEN,
    CHAT_TEMPLATE,
    END_OF_TEXT_TOKEN,
    EOT_TOKEN,
    special_ids,
    tokenizer_config,
    train_tokenizer,
)

DEFAULT_MODEL_NAME = "pdserve-tiny-llama"
# Bump when the writing code changes the files; corpus, shape, seed and template
# changes are caught by the fingerprint. A cached model that differs is rebuilt.
DEFAULT_MODEL_VERSION = 2
VERSION_FILE = "pdserve-model.json"
FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    VERSION_FILE,
)

@dataclass(frozen=True)
class DefaultModelSpec:
    """Shape and seed of the generated checkpoint (the defaults are the default model)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 688
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    init_std: float = 0.02
    # lm_head is drawn wider than the rest so logits are decisive: with 0.02 the
    # top-2 logit gap is often ~1e-3, and greedy output would flip under mere
    # float-ordering differences (batched vs alone, bf16 on GPU).
    lm_head_std: float = 0.2
    target_vocab_size: int = 2048
    seed: int = 1234

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class WeightFormat:
    """How the weights are stored (the defaults are the default model's).

    `dtype`: "float32" or "bfloat16" (the float32 draw rounded to nearest even).
    `vocab_size`: rows of the embedding and the LM head; None: the tokenizer's size.
    Rows past the tokenizer's are zero: no prompt holds their ids, and a zero LM-head
    row gives logit 0, far below the largest real logit (rows are N(0, lm_head_std)
    against a final hidden state of norm sqrt(hidden)), so greedy decoding never
    emits an id the tokenizer cannot decode. They cost the bytes a real vocabulary
    costs, which is what speed benchmarks of a shape need.
    `tiled`: fill each tensor by cycling through one seeded pool of normal draws from
    a random start instead of drawing every element, at memcpy speed: drawing 8e9
    values takes minutes. Values are still N(0, std) but repeat, with a period no
    power-of-two row length divides; for speed benchmarks, not statistics.
    """

    dtype: str = "float32"
    vocab_size: int | None = None
    tiled: bool = False


# safetensors dtype codes of the storable dtypes.
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16"}
_POOL_SIZE = (1 << 22) + 1021  # tiled fill: odd, so rows shift phase at each wrap
# The tensors with one row per token id, padded to `WeightFormat.vocab_size`.
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def hf_config(
    spec: DefaultModelSpec, vocab_size: int, ids: Mapping[str, int], dtype: str = "float32"
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "initializer_range": spec.init_std,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": ids[BOS_TOKEN],
        "eos_token_id": [ids[END_OF_TEXT_TOKEN], ids[EOT_TOKEN]],
        "torch_dtype": dtype,
    }


def _random_shapes(spec: DefaultModelSpec, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """The normal-initialised tensors, in draw order (embedding and LM head unpadded)."""
    h, q, kv = spec.hidden_size, spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "self_attn.q_proj.weight"] = (q, h)
        shapes[p + "self_attn.k_proj.weight"] = (kv, h)
        shapes[p + "self_attn.v_proj.weight"] = (kv, h)
        shapes[p + "self_attn.o_proj.weight"] = (h, q)
        shapes[p + "mlp.gate_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.up_proj.weight"] = (spec.intermediate_size, h)
        shapes[p + "mlp.down_proj.weight"] = (h, spec.intermediate_size)
    shapes["lm_head.weight"] = (vocab_size, h)
    return shapes


def _norm_names(spec: DefaultModelSpec) -> list[str]:
    names = []
    for i in range(spec.num_layers):
        names.append(f"model.layers.{i}.input_layernorm.weight")
        names.append(f"model.layers.{i}.post_attention_layernorm.weight")
    return [*names, "model.norm.weight"]


def _weight_shapes(
    spec: DefaultModelSpec, vocab_size: int, rows: int
) -> dict[str, tuple[int, ...]]:
    """Every stored tensor in the order `_weights` yields them (vocabulary padded to `rows`)."""
    shapes = _random_shapes(spec, vocab_size)
    for name in _VOCAB_TENSORS:
        shapes[name] = (rows, spec.hidden_size)
    return {**shapes, **{n: (spec.hidden_size,) for n in _norm_names(spec)}}


def _to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even; finite inputs."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return (
        (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    ).astype(np.uint16)


def _cast(x: np.ndarray, dtype: str) -> np.ndarray:
    return _to_bf16_bits(x) if dtype == "bfloat16" else x


def _tiled_drawer(
    rng: np.random.Generator, dtype: str
) -> Callable[[tuple[int, ...], np.float32], np.ndarray]:
    """`draw(shape, std)` copying from one pool of normal draws, scaled and cast once per std."""
    pool = rng.standard_normal(_POOL_SIZE, dtype=np.float32)
    scaled: dict[float, np.ndarray] = {}

    def draw(shape: tuple[int, ...], std: np.float32) -> np.ndarray:
        src = scaled.setdefault(float(std), _cast(pool * std, dtype))
        n = int(np.prod(shape))
        out = np.empty(n, dtype=src.dtype)
        pos, start = 0, int(rng.integers(len(src)))
        while pos < n:
            k = min(n - pos, len(src) - start)
            out[pos : pos + k] = src[start : start + k]
            pos, start = pos + k, 0
        return out.reshape(shape)

    return draw


def _weights(
    spec: DefaultModelSpec, vocab_size: int, fmt: WeightFormat | None = None
) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) in `_weight_shapes` order; bfloat16 as uint16 bit patterns."""
    fmt = fmt or WeightFormat()
    rows = fmt.vocab_size or vocab_size
    rng = np.random.default_rng(spec.seed)
    tiled = _tiled_drawer(rng, fmt.dtype) if fmt.tiled else None
    # Drawn in one fixed order so the bytes never depend on dict or file ordering.
    for name, shape in _random_shapes(spec, vocab_size).items():
        std = np.float32(spec.lm_head_std if name == "lm_head.weight" else spec.init_std)
        if tiled is not None:
            value = tiled(shape, std)
        else:
            value = _cast(rng.standard_normal(shape, dtype=np.float32) * std, fmt.dtype)
        if name in _VOCAB_TENSORS and rows > vocab_size:
            value = np.concatenate([value, np.zeros((rows - vocab_size, shape[1]), value.dtype)])
        yield name, value
    for name in _norm_names(spec):
        yield name, _cast(np.ones(spec.hidden_size, dtype=np.float32), fmt.dtype)


def _save_streamed(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    tensors: Iterator[tuple[str, np.ndarray]],
    dtype: str,
) -> None:
    """Write a safetensors file one tensor at a time (peak memory: the largest tensor).

    The format: 8-byte little-endian header length, a JSON header of dtype, shape and
    byte offsets per tensor (space-padded to 8 bytes), then the tensors' bytes in order.
    """
    item = 2 if dtype == "bfloat16" else 4
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        end = offset + int(np.prod(shape)) * item
        header[name] = {
            "dtype": _ST_DTYPES[dtype],
            "shape": list(shape),
            "data_offsets": [offset, end],
        }
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for (name, arr), (want, shape) in zip(tensors, shapes.items(), strict=True):
            if name != want or arr.shape != shape or arr.itemsize != item:
                raise AssertionError(
                    f"tensor {name} {arr.shape} out of the layout ({want} {shape})"
                )
            f.write(np.ascontiguousarray(arr).data)


def write_model_metadata(
    out_dir: Path, tok: Tokenizer, spec: DefaultModelSpec, vocab_size: int, dtype: str = "float32"
) -> None:
    """`tokenizer_config.json`, `config.json` and `generation_config.json` of a built-in model."""
    ids = special_ids(tok)
    write_json(out_dir / "tokenizer_config.json", tokenizer_config(tok, spec.max_position_embeddings))
    write_json(out_dir / "config.json", hf_config(spec, vocab_size, ids, dtype))
    write_json(
        out_dir / "generation_config.json",
        {"bos_token_id": ids[BOS_TOKEN], "eos_token_id": [ids[END_OF_TEXT_TOKEN], ids[EOT_TOKEN]]},
    )


def write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_random_model(
    out_dir: Path, spec: DefaultModelSpec | None = None, fmt: WeightFormat | None = None
) -> Path:
    """Write the checkpoint into `out_dir` (created if missing) and return it.

    Existing files of the same names are overwritten; other files are left alone.
    `fmt` (default: float32, the tokenizer's vocabulary, every value drawn) changes
    only how the weights are stored, not the fingerprint.
    """
    spec = spec or DefaultModelSpec()
    fmt = fmt or WeightFormat()
    if fmt.dtype not in _ST_DTYPES:
        raise ValueError(f"unsupported dtype {fmt.dtype!r}; choose one of {sorted(_ST_DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.target_vocab_size)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    rows = fmt.vocab_size or vocab_size
    if rows < vocab_size:
        raise ValueError(f"vocab_size {rows} is below the tokenizer's {vocab_size}")
    tok.save(str(out_dir / "tokenizer.json"), pretty=False)
    write_model_metadata(out_dir, tok, spec, rows, fmt.dtype)
    weights = _weights(spec, vocab_size, fmt)
    if fmt.dtype == "float32":
        save_file(dict(weights), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        shapes = _weight_shapes(spec, vocab_size, rows)
        _save_streamed(out_dir / "model.safetensors", shapes, weights, fmt.dtype)
    write_json(
        out_dir / VERSION_FILE,
        {
            "name": DEFAULT_MODEL_NAME,
            "version": DEFAULT_MODEL_VERSION,
            "fingerprint": fingerprint(spec),
        },
    )
    for f in FILES:
        (out_dir / f).chmod(0o644)  # safetensors writes 0600; the model is shared data
    return out_dir


def fingerprint(spec: DefaultModelSpec) -> str:
    """Hash of every input of the build, so an edit to any of them is noticed."""
    key = f"{DEFAULT_MODEL_VERSION}|{spec!r}|{CHAT_TEMPLATE}|{corpus_text()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]
