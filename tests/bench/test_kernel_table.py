"""bench/kernel_table.py prints the kernel table's routes for this host, as masked."""

from __future__ import annotations

from bench import kernel_table
from pdserve.engine.kernels import cpu_features, table
from pdserve.engine.kernels import native as native_kernels


def _spec(op: str) -> table.LinearSpec:
    return table.LinearSpec(op, "bfloat16", "cpu", 768, 2048, 128 if op == "int4" else 0)


def test_each_op_prints_its_plan_and_every_entry_with_its_reason() -> None:
    for op in ("bf16", "int8", "int4"):
        lines = kernel_table.describe(_spec(op))
        names = [name for _, _, name in table.plan(_spec(op)).names()]
        assert lines[0].startswith(f"{op}: rows 1-") and all(n in lines[0] for n in names)
        assert [line.split(":")[0].strip() for line in lines[1:]] == [k.name for k in table.TABLE if k.op == op]


def test_a_masked_cpu_prints_the_routes_of_that_cpu() -> None:
    previous = native_kernels.set_features(cpu_features.effective("portable") & native_kernels.features())
    try:
        lines = kernel_table.describe(_spec("bf16"))
    finally:
        native_kernels.set_features(previous)
    assert lines[0] == "bf16: rows 1-inf bf16_emulated (row-invariant)"
    assert any("bf16_avx512: bf16_avx512 needs CPU features" in line for line in lines)
