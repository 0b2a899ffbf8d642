"""Rotary position embedding: precomputed cos/sin tables, computed exactly as HF does.

The inverse frequencies follow `transformers.modeling_rope_utils` (default and
`llama3` scaling) in float32; cos/sin are taken in float32 and cast to the model
dtype, so the tables equal HF's `LlamaRotaryEmbedding` output bit for bit.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.loading.model_config import RopeScaling


def inv_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """float32 inverse frequencies, shape [head_dim // 2]."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (theta**exps)
    if scaling is None or scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type != "llama3":
        raise ValueError(f"unsupported rope scaling type {scaling.rope_type!r}")
    return _llama3_scale(inv_freq, scaling)


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are divided by `factor`, short ones kept, the band in
    # between interpolated smoothly (Llama 3.1 paper; same arithmetic as HF).
    old_len = s.original_max_position_embeddings
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RopeTables:
    """cos/sin for positions [0, max_positions), each [max_positions, head_dim]."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: RopeScaling | None,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        inv_freq = inv_frequencies(head_dim, theta, scaling)
        pos = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = emb.cos().to(device=device, dtype=dtype)
        # rotate_half(x) * sin == swap_halves(x) * (sin with its first half negated);
        # folding the sign into the table saves a negation per layer.
        sin = emb.sin()
        half = head_dim // 2
        self.signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1).to(
            device=device, dtype=dtype
        )
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for `positions` [T], each [T, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` [T, heads, head_dim] by the half-split convention HF Llama uses.

    Equals HF's `x * cos + rotate_half(x) * sin`; `signed_sin` comes from `lookup`.
    """
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * signed_sin
