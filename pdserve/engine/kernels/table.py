"""The one table of CPU linear kernels, and the one place a layer's route is decided.

Each entry names a kernel for one op (`bf16`: a bf16 weight; `int4`, `int8`: the
quantized layers of pdserve/engine/quant/linear.py), the rows it takes, the CPU features it needs
(pdserve/engine/kernels/cpu_features.py) and a `check` that says why it cannot take a layer (None: it
can). Entries are in order of preference. A layer asks `plan` once, at load: for every
row bucket (the ranges the entries' bounds cut 1..inf into) the first entry whose rows
cover the bucket, whose features this process has (`PDSERVE_CPU_FEATURES`), that
`PDSERVE_DISABLED_KERNELS` does not name and whose check passes. So no kernel is ever
handed a shape or a CPU it refuses, and a route never depends on anything but the row
count's bucket (as vLLM's `choose_mp_linear_kernel`). The bf16 kernels are all
row-invariant (pdserve/engine/kernels/_bf16_gemv.c): a row's bits do not depend on the rows beside it,
so bf16 takes one kernel for every row count; `invariant` says which entries promise it
(docs/determinism.md). int4's GEMV and `int4_gemm_vnni` (its arithmetic over more rows) give
one row the same bits in either (pdserve/engine/kernels/numerics.py names them alike).
`python -m bench.kernel_table` prints the routes of this host.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.common import envs
from pdserve.engine.kernels import cpu_features
from pdserve.engine.kernels import native as native_kernels

INF = 1 << 62


@dataclass(frozen=True)
class LinearSpec:
    """What a layer knows at load: its op, activation dtype, device and shape."""

    op: str  # bf16 | int4 | int8
    act_dtype: str  # bfloat16 | float32 | float16
    device: str = "cpu"
    in_features: int = 0  # K (int4: padded to the group)
    out_features: int = 0  # N (int4: padded to 64)
    group: int = 0  # int4 group size


@dataclass(frozen=True)
class Kernel:
    """One table entry. `path` is the C library's code for it (pdserve/engine/kernels/_pd_cpu.h,
    pdserve/engine/kernels/_int8_gemm.c), 0 for a torch kernel."""

    name: str
    op: str
    min_rows: int
    max_rows: int
    features: frozenset[str]
    invariant: bool
    check: Callable[[LinearSpec], str | None]
    path: int = 0

    def can_implement(self, spec: LinearSpec, features: frozenset[str] | None = None,
                      disabled: frozenset[str] | None = None) -> str | None:
        """Why this kernel cannot run `spec` here; None when it can."""
        if spec.op != self.op:
            return f"{self.name} is a {self.op} kernel"
        if self.name in (envs.disabled_kernels() if disabled is None else disabled):
            return f"{self.name} is in PDSERVE_DISABLED_KERNELS"
        missing = self.features - (available_features() if features is None else features)
        if missing:
            return f"{self.name} needs CPU features {', '.join(sorted(missing))}"
        return self.check(spec)


def available_features() -> frozenset[str]:
    """The features routes are chosen for: the library's own (the host's, masked by
    `PDSERVE_CPU_FEATURES`, AMX only where Linux granted it), else the mask's view of
    /proc/cpuinfo (no library: only torch entries can run anyway)."""
    return native_kernels.features() if native_kernels.LIB is not None else cpu_features.effective()


def _lib(symbol: str) -> str | None:
    lib = native_kernels.LIB
    return None if lib is not None and hasattr(lib, symbol) else f"the native library lacks {symbol}"


def _all(*reasons: Callable[[LinearSpec], str | None]) -> Callable[[LinearSpec], str | None]:
    def check(spec: LinearSpec) -> str | None:
        return next((r for fn in reasons if (r := fn(spec)) is not None), None)
    return check


def _cpu_bf16(spec: LinearSpec) -> str | None:
    if spec.device != "cpu":
        return f"runs on CPU, not {spec.device}"
    return None if spec.act_dtype == "bfloat16" else f"takes bfloat16 activations, not {spec.act_dtype}"


def _native(symbol: str) -> Callable[[LinearSpec], str | None]:
    return lambda spec: _lib(symbol)


def _int4_q16_shape(spec: LinearSpec) -> str | None:
    k, n, g = spec.in_features, spec.out_features, spec.group
    if k % 32 or k % g or not (g == 32 or g % 64 == 0) or n % 64:
        return f"needs K % 32 == K % group == 0, group 32 or k*64, N % 64 == 0 (K {k}, N {n}, group {g})"
    return None


def _int4_gemm_shape(spec: LinearSpec) -> str | None:
    k, n, g = spec.in_features, spec.out_features, spec.group
    if k % 32 or g % 2 or k % g or n % 64:
        return f"needs K % 32 == K % group == 0, an even group, N % 64 == 0 (K {k}, N {n}, group {g})"
    return None


def _dequant_dtype(spec: LinearSpec) -> str | None:
    if spec.device != "cpu":
        return f"runs on CPU, not {spec.device}"
    return None if spec.act_dtype in ("float32", "bfloat16") else f"unpacks to float32 or bfloat16, not {spec.act_dtype}"


def _any(spec: LinearSpec) -> None:
    return None


F = frozenset
BF16 = F({"avx512", "avx512_bf16"})
AMX = BF16 | F({"amx_bf16", "amx_int8", "avx512_vbmi"})
INT8 = BF16 | F({"avx512_vnni"})
INT4_Q16 = INT8 | F({"avx512_vbmi"})  # the int4 integer dot products (pdserve/engine/kernels/_int4_q16.h)
INT4_VNNI_ROWS = 384
"""Up to here `int4_gemm_vnni` (the GEMV's bits) beats unpacking the weight for aten's
bf16 matmul on an AMD EPYC (Zen 4), 1 thread (`python -m bench.int4_gemm`, bench/README.md)."""

TABLE: tuple[Kernel, ...] = (
    Kernel("bf16_amx", "bf16", 1, INF, BF16 | F({"amx_bf16"}), True, _all(_cpu_bf16, _native("pd_bf16_gemv")), 2),
    Kernel("bf16_avx512", "bf16", 1, INF, BF16, True, _all(_cpu_bf16, _native("pd_bf16_gemv")), 1),
    Kernel("bf16_emulated", "bf16", 1, INF, F(), True, _all(_cpu_bf16, _native("pd_bf16_gemv")), 3),
    Kernel("bf16_aten", "bf16", 1, INF, F(), False, _any),
    Kernel("int4_gemv", "int4", 1, 4, INT4_Q16, True, _all(_cpu_bf16, _native("pd_int4_gemv_bf16"), _int4_q16_shape)),
    Kernel("int4_gemm_amx", "int4", 5, INF, AMX, False, _all(_cpu_bf16, _native("pd_int4_gemm_bf16"), _int4_gemm_shape)),
    Kernel("int4_gemm_vnni", "int4", 5, INT4_VNNI_ROWS, INT4_Q16, True,
           _all(_cpu_bf16, _native("pd_int4_tiles_bf16"), _int4_q16_shape)),
    Kernel("int4_dequant", "int4", 33, INF, F(), False, _all(_dequant_dtype, _native("pd_int4_dequant"))),
    Kernel("int4_aten", "int4", 1, INF, F(), False, _any),
    Kernel("int8_vnni", "int8", 1, 4, INT8, False, _all(_cpu_bf16, _native("pd_int8_gemm_bf16")), 5),
    Kernel("int8_amx_q8", "int8", 5, 16, AMX | INT8, False, _all(_cpu_bf16, _native("pd_int8_gemm_bf16")), 6),
    Kernel("int8_amx", "int8", 17, INF, AMX | INT8, False, _all(_cpu_bf16, _native("pd_int8_gemm_bf16")), 3),
    Kernel("int8_dpbf16", "int8", 5, INF, INT8, False, _all(_cpu_bf16, _native("pd_int8_gemm_bf16")), 2),
    Kernel("int8_aten", "int8", 1, 8, F(), False, _any),
    Kernel("int8_dequant", "int8", 1, INF, F(), False, _any),
)
"""Every CPU linear kernel, most preferred first within each op."""

BY_NAME = {k.name: k for k in TABLE}


@dataclass(frozen=True)
class Route:
    """Rows [lo, hi] of a layer run `kernel`."""

    lo: int
    hi: int
    kernel: Kernel


@dataclass(frozen=True)
class Plan:
    """A layer's routes, one per row bucket, covering 1..INF in order."""

    routes: tuple[Route, ...]

    def kernel_for(self, rows: int) -> Kernel:
        for r in self.routes:
            if rows <= r.hi:
                return r.kernel
        return self.routes[-1].kernel

    def names(self) -> tuple[tuple[int, int, str], ...]:
        return tuple((r.lo, r.hi, r.kernel.name) for r in self.routes)

    @property
    def invariant(self) -> bool:
        """One row-invariant kernel for every row count: a row's bits never depend on M."""
        return len({r.kernel.name for r in self.routes}) == 1 and self.routes[0].kernel.invariant


def buckets(op: str) -> tuple[tuple[int, int], ...]:
    """The row ranges the bounds of `op`'s entries cut 1..INF into."""
    cuts = sorted({1} | {k.min_rows for k in TABLE if k.op == op}
                  | {k.max_rows + 1 for k in TABLE if k.op == op and k.max_rows < INF})
    return tuple((lo, (cuts[i + 1] - 1) if i + 1 < len(cuts) else INF) for i, lo in enumerate(cuts))


def plan(spec: LinearSpec, features: Iterable[str] | None = None, disabled: Iterable[str] | None = None) -> Plan:
    """The routes of a layer described by `spec` on this host (module docstring).
    ValueError when some bucket has no kernel (the table's last entry per op takes all)."""
    feats = available_features() if features is None else frozenset(features)
    off = envs.disabled_kernels() if disabled is None else frozenset(disabled)
    routes: list[Route] = []
    for lo, hi in buckets(spec.op):
        kernel = next((k for k in TABLE if k.min_rows <= lo and hi <= k.max_rows
                       and k.can_implement(spec, feats, off) is None), None)
        if kernel is None:
            raise ValueError(f"no {spec.op} kernel takes rows {lo}-{hi} of {spec}: "
                             + "; ".join(r for k in TABLE if k.op == spec.op
                                         if (r := k.can_implement(spec, feats, off)) is not None))
        if routes and routes[-1].kernel is kernel:
            routes[-1] = Route(routes[-1].lo, hi, kernel)
        else:
            routes.append(Route(lo, hi, kernel))
    return Plan(tuple(routes))


def reasons(spec: LinearSpec, features: Iterable[str] | None = None) -> dict[str, str | None]:
    """Every entry of `spec.op` with why it cannot run `spec` (None: it can)."""
    feats = available_features() if features is None else frozenset(features)
    return {k.name: k.can_implement(spec, feats) for k in TABLE if k.op == spec.op}
