"""What this CPU may run: the one capability source for the native kernels, their routes
(pdserve/engine/kernels/table.py) and `--dtype auto` (pdserve/engine/loading/dtype.py).

`PDSERVE_CPU_FEATURES` narrows it, so one machine exercises the code paths of a smaller
one (docs/determinism.md): a level names a kind of CPU and keeps only its features, a
`-feature` drops one (and whatever needs it), e.g.

- `-amx`: an AMD EPYC Zen 4/5 (AVX-512 with BF16, VNNI and VBMI, no AMX);
- `avx512_bf16`: the same, spelled as a level;
- `avx512`: AVX-512 without BF16 (Skylake/Ice Lake servers);
- `avx2`: AVX2 + FMA only; `portable`: baseline x86-64.

A mask never adds what the hardware lacks. The effective set is handed to the C library
once, at load (pdserve/engine/kernels/native.py, `pd_cpu_set_mask`), whose `pd_cpu_has` every
kernel asks (pdserve/engine/kernels/_pd_cpu.h); the bits below mirror that header. Torch-free: `pdserve
plan` resolves `auto` exactly as a worker does. torch's own kernels (oneDNN) are not
masked; the routes of pdserve/engine/kernels/table.py decide which bf16 calls reach them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from pdserve.common import envs

CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class Feature:
    """One capability bit of pdserve/engine/kernels/_pd_cpu.h: the /proc/cpuinfo flags it needs, the
    features it needs first."""

    name: str
    bit: int
    flags: tuple[str, ...]
    requires: tuple[str, ...] = ()


FEATURES: tuple[Feature, ...] = (
    Feature("avx2", 1 << 0, ("avx2", "fma")),
    Feature("avx512", 1 << 1, ("avx512f", "avx512bw", "avx512dq", "avx512vl"), ("avx2",)),
    Feature("avx512_bf16", 1 << 2, ("avx512_bf16",), ("avx512",)),
    Feature("avx512_vnni", 1 << 3, ("avx512_vnni",), ("avx512",)),
    Feature("avx512_vbmi", 1 << 4, ("avx512vbmi",), ("avx512",)),
    Feature("amx_bf16", 1 << 5, ("amx_tile", "amx_bf16"), ("avx512_bf16",)),
    Feature("amx_int8", 1 << 6, ("amx_tile", "amx_int8"), ("avx512_bf16",)),
)
"""In the order of the C bits (PD_CPU_AVX2 ... PD_CPU_AMX_INT8)."""

BY_NAME = {f.name: f for f in FEATURES}
ALL = frozenset(BY_NAME)
GROUPS = {"amx": frozenset({"amx_bf16", "amx_int8"})}
"""Names a `-name` drops together."""

LEVELS: dict[str, frozenset[str]] = {
    "portable": frozenset(),
    "avx2": frozenset({"avx2"}),
    "avx512": frozenset({"avx2", "avx512", "avx512_vnni", "avx512_vbmi"}),
    "avx512_bf16": frozenset({"avx2", "avx512", "avx512_vnni", "avx512_vbmi", "avx512_bf16"}),
    "amx": ALL,
}
"""The kinds of CPU a level names, smallest first: what each keeps."""


def parse(spec: str) -> frozenset[str]:
    """The features a `PDSERVE_CPU_FEATURES` value allows (before the hardware's own
    limit): the union of the levels it names (all when none), less each `-feature` and
    what needs it. ValueError for an unknown name."""
    allowed: set[str] = set()
    dropped: set[str] = set()
    levels = 0
    for token in spec.replace(" ", ",").split(","):
        token = token.strip().lower()
        if not token or token == "native":
            continue
        if token.startswith("-"):
            name = token[1:]
            if name not in BY_NAME and name not in GROUPS:
                raise ValueError(f"PDSERVE_CPU_FEATURES: unknown feature {name!r} "
                                 f"(choose from {', '.join([*BY_NAME, *GROUPS])})")
            dropped |= GROUPS.get(name, {name})
        elif token in LEVELS:
            allowed |= LEVELS[token]
            levels += 1
        else:
            raise ValueError(f"PDSERVE_CPU_FEATURES: unknown level {token!r} (choose from "
                             f"{', '.join(LEVELS)}, or drop a feature with -name)")
    return closed((allowed if levels else set(ALL)) - dropped)


def closed(features: Iterable[str]) -> frozenset[str]:
    """`features` less every one whose requirements are not all in it (transitively)."""
    have = set(features)
    changed = True
    while changed:
        changed = False
        for f in FEATURES:
            if f.name in have and not all(r in have for r in f.requires):
                have.discard(f.name)
                changed = True
    return frozenset(have)


def read_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The CPU flags of this host from `/proc/cpuinfo` (x86 `flags` line), unmasked; empty
    when unreadable (not Linux) or not x86."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def features_of(flags: Iterable[str]) -> frozenset[str]:
    """The features a CPU with these flags has."""
    have = frozenset(flags)
    return closed(f.name for f in FEATURES if all(x in have for x in f.flags))


def masked_flags(flags: Iterable[str], spec: str | None = None) -> frozenset[str]:
    """`flags` less those of every feature the mask (`spec`; None: `PDSERVE_CPU_FEATURES`)
    takes away: what a CPU of the masked kind would list."""
    allowed = parse(envs.cpu_features() if spec is None else spec)
    gone = {x for f in FEATURES if f.name not in allowed for x in f.flags}
    return frozenset(flags) - gone


@cache
def _host() -> frozenset[str]:
    return features_of(read_flags())


def host() -> frozenset[str]:
    """This host's features, unmasked (read once)."""
    return _host()


def effective(spec: str | None = None) -> frozenset[str]:
    """The features this process may use: the host's, narrowed by `spec` (None:
    `PDSERVE_CPU_FEATURES`, read at each call)."""
    return host() & parse(envs.cpu_features() if spec is None else spec)


def has(*names: str, spec: str | None = None) -> bool:
    """Whether the effective set holds every feature named."""
    eff = effective(spec)
    return all(n in eff for n in names)


def bits(features: Iterable[str]) -> int:
    """The pdserve/engine/kernels/_pd_cpu.h mask of these features."""
    return sum(BY_NAME[n].bit for n in set(features))


def emulable_levels() -> tuple[str, ...]:
    """The levels this host can run as (every level whose features it has), smallest first."""
    h = host()
    return tuple(name for name, feats in LEVELS.items() if feats <= h)


def level_of(features: Iterable[str]) -> str:
    """The largest level whose features are all in `features` (docs and bench labels)."""
    have = frozenset(features)
    return [name for name, feats in LEVELS.items() if feats <= have][-1]
