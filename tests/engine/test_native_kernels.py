"""pdserve/engine/kernels/native.py: one signature table declares the library's entry points; an
old library without an optional one still loads, one without a required one does not."""

from __future__ import annotations

import ctypes

import pytest

from pdserve.engine.kernels import native as native_kernels
from pdserve.engine.kernels.native import SYMBOLS, declare


class _Fn:
    """Stands in for a ctypes function pointer: takes argtypes and restype."""

    argtypes: list[type] | None = None
    restype: type | None = None


class _OldLib:
    """A library that has only the symbols it is given."""

    def __init__(self, names: set[str]) -> None:
        for name in names:
            setattr(self, name, _Fn())


def test_every_symbol_present_is_declared_and_missing_optional_ones_are_tolerated() -> None:
    names = {s.name for s in SYMBOLS} - {"pd_int4_gemm_bf16", "pd_int4_gemm_supported"}
    lib = _OldLib(names)
    assert declare(lib)  # type: ignore[arg-type]
    for sym in SYMBOLS:
        fn = getattr(lib, sym.name, None)
        if sym.name in names:
            assert fn is not None and fn.argtypes == list(sym.argtypes) and fn.restype is sym.restype
        else:
            assert fn is None


@pytest.mark.parametrize("missing", [s.name for s in SYMBOLS if s.required])
def test_a_library_missing_a_required_symbol_is_refused(missing: str) -> None:
    assert not declare(_OldLib({s.name for s in SYMBOLS} - {missing}))  # type: ignore[arg-type]


def test_table_has_each_symbol_once() -> None:
    names = [s.name for s in SYMBOLS]
    assert len(names) == len(set(names))


@pytest.mark.skipif(native_kernels.LIB is None, reason="the native kernel library is not built")
def test_the_built_library_has_every_signature_the_table_gives() -> None:
    lib = native_kernels.LIB
    assert lib is not None
    for sym in SYMBOLS:
        fn = getattr(lib, sym.name)  # the library built from this tree has them all
        assert fn.argtypes == list(sym.argtypes) and fn.restype is sym.restype
        assert ctypes.cast(fn, ctypes.c_void_p).value
