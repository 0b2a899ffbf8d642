"""The hardware profile `pdserve profile` writes and `pdserve plan --simulate` reads.

JSON schema (`"schema": "pdserve-profile/1"`), all times in seconds:

    {
      "schema": "pdserve-profile/1",
      "model": str, "dtype": str, "device": str, "threads": int | null,
      "block_size": int,            # KV block size in tokens
      "chunk_tokens": int,          # the engine's token budget per step (chunked prefill)
      "max_num_seqs": int,          # most sequences one decode step runs
      "kv_capacity_tokens": int,    # KV pool of one worker with the default cache size
      "kv_copy_s_per_token": s,     # copying one token's KV (all layers) between pools
      "load_average": [before, after] | null,  # the machine's 1-minute load while profiling
      "prefill": {"c0": s, "c1": s/token, "c2": s/token^2,
                  "points": [[prompt_tokens, seconds], ...]},
      "decode": {"c0": s, "per_seq": s/sequence, "per_ctx_token": s/token,
                 "points": [[batch, context_tokens_each, seconds_per_step], ...]}
    }

Prefill of one L-token prompt in one step takes c0 + c1 L + c2 L^2; a chunk of m
tokens that follows k already computed costs c1 m + c2 ((k+m)^2 - k^2) on top of the
step's c0 (attention over the prompt is where the square comes from, so the chunks
of one prompt add up to the whole). A decode step of B sequences holding C context
tokens in all takes c0 + per_seq B + per_ctx_token C. The coefficients are least
squares fits of the measured points, constrained to be >= 0 (a term the noise would
make negative is dropped and the rest refitted).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SCHEMA = "pdserve-profile/1"


class ProfileError(ValueError):
    """A profile file that cannot be used; the message says what is wrong."""


@dataclass(frozen=True)
class PrefillFit:
    c0: float
    c1: float
    c2: float
    points: tuple[tuple[int, float], ...] = ()

    def step_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """One prefill step over (already computed, chunk) token pairs."""
        return self.c0 + sum(self.c1 * m + self.c2 * ((k + m) ** 2 - k**2) for k, m in chunks)

    def prompt_s(self, tokens: int) -> float:
        return self.step_s([(0, tokens)])


@dataclass(frozen=True)
class DecodeFit:
    c0: float
    per_seq: float
    per_ctx_token: float
    points: tuple[tuple[int, int, float], ...] = ()

    def step_s(self, batch: int, context_tokens: int) -> float:
        return self.c0 + self.per_seq * batch + self.per_ctx_token * context_tokens


@dataclass(frozen=True)
class Profile:
    prefill: PrefillFit
    decode: DecodeFit
    block_size: int = 16
    chunk_tokens: int = 2048
    max_num_seqs: int = 64
    kv_capacity_tokens: int = 1 << 16
    model: str = ""
    dtype: str = ""
    device: str = "cpu"
    threads: int | None = None
    kv_copy_s_per_token: float = 0.0
    load_average: tuple[float, float] | None = None  # 1-minute load average before, after

    def to_dict(self) -> dict[str, Any]:
        return {"schema": SCHEMA, **asdict(self)}

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("schema") != SCHEMA:
            raise ProfileError(f"not a {SCHEMA} profile (schema: {d.get('schema')!r})")
        try:
            pf, df = d["prefill"], d["decode"]
            prefill = PrefillFit(float(pf["c0"]), float(pf["c1"]), float(pf["c2"]),
                                 tuple((int(a), float(b)) for a, b in pf.get("points", ())))
            decode = DecodeFit(float(df["c0"]), float(df["per_seq"]), float(df["per_ctx_token"]),
                               tuple((int(a), int(b), float(c)) for a, b, c in df.get("points", ())))
            profile = cls(prefill, decode, int(d["block_size"]), int(d["chunk_tokens"]), int(d["max_num_seqs"]),
                          int(d["kv_capacity_tokens"]), str(d.get("model", "")), str(d.get("dtype", "")),
                          str(d.get("device", "cpu")), None if d.get("threads") is None else int(d["threads"]),
                          float(d.get("kv_copy_s_per_token", 0.0)), _load(d.get("load_average")))
        except (KeyError, TypeError, ValueError) as e:
            raise ProfileError(f"profile field missing or malformed: {e}") from None
        coefs = (prefill.c0, prefill.c1, prefill.c2, decode.c0, decode.per_seq, decode.per_ctx_token,
                 profile.kv_copy_s_per_token)
        if min(coefs) < 0 or prefill.prompt_s(1) <= 0 or decode.step_s(1, 1) <= 0:
            raise ProfileError("profile coefficients must be >= 0 and give positive step times")
        if min(profile.block_size, profile.chunk_tokens, profile.max_num_seqs, profile.kv_capacity_tokens) < 1:
            raise ProfileError("block_size, chunk_tokens, max_num_seqs and kv_capacity_tokens must be >= 1")
        return profile

    @classmethod
    def load(cls, path: Path) -> Profile:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProfileError(f"cannot read profile {path}: {e}") from None
        if not isinstance(data, dict):
            raise ProfileError(f"{path}: a profile is a JSON object")
        return cls.from_dict(data)


def _load(value: Any) -> tuple[float, float] | None:
    if value is None:
        return None
    before, after = value  # a malformed pair raises TypeError / ValueError: refused by the caller
    return float(before), float(after)


def fit_nonnegative(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Least squares coefficients x >= 0 of rows @ x ~ ys: a plain fit, then the most
    negative term dropped and the rest refitted until none is negative."""
    active = list(range(len(rows[0])))
    while True:
        sub = [[r[j] for j in active] for r in rows]
        x = _least_squares(sub, ys)
        worst = min(range(len(active)), key=lambda i: x[i])
        if x[worst] >= 0 or len(active) == 1:
            out = [0.0] * len(rows[0])
            for j, v in zip(active, x, strict=True):
                out[j] = max(v, 0.0)
            return out
        active.pop(worst)


def fit_prefill(points: Sequence[tuple[int, float]]) -> PrefillFit:
    c0, c1, c2 = fit_nonnegative([[1.0, n, n * n] for n, _ in points], [s for _, s in points])
    return PrefillFit(c0, c1, c2, tuple(points))


def fit_decode(points: Sequence[tuple[int, int, float]]) -> DecodeFit:
    c0, b, c = fit_nonnegative([[1.0, bs, bs * ctx] for bs, ctx, _ in points], [s for _, _, s in points])
    return DecodeFit(c0, b, c, tuple(points))


def _least_squares(rows: Sequence[Sequence[float]], ys: Sequence[float]) -> list[float]:
    """Normal equations with each column scaled to unit size (token counts squared span
    ten orders of magnitude), solved by Gaussian elimination with partial pivoting."""
    n = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(n)]
    a = [[sum(r[i] / scale[i] * r[j] / scale[j] for r in rows) for j in range(n)]
         + [sum(r[i] / scale[i] * y for r, y in zip(rows, ys, strict=True))] for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(a[i][col]))
        a[col], a[piv] = a[piv], a[col]
        if abs(a[col][col]) < 1e-12:
            a[col][col] = 1e-12  # a column the points cannot tell apart from the others: ~0
        for i in range(n):
            if i != col:
                f = a[i][col] / a[col][col]
                a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
    return [a[i][n] / a[i][i] / scale[i] for i in range(n)]
