"""The gateway refuses a worker whose KV compatibility hash differs from the
registered workers': a checkpoint one weight value apart (same config.json), another
dtype, another weight quantization, another block size. Real gateway and worker processes; a refused worker stays
up (it keeps asking) and never joins a pool."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.e2e.cluster import AUTO_DTYPE, Cluster
from tests.helpers.tiny_models import copy_with_one_weight_changed


def _refused(c: Cluster, worker_id: str) -> bool:
    assert c.gateway is not None
    return f"refused worker {worker_id}: compat_hash" in c.gateway.log_path.read_text(errors="replace")


def test_checkpoint_dtype_quantization_and_block_size_mismatches_are_refused_at_registration(
    log_dir: Path, model_dir: Path, tmp_path: Path
) -> None:
    """One gateway, one registered worker (`--dtype auto`); every other worker names its
    dtype, so each differs from it in one thing only (or, "same", in nothing)."""
    same = Path(shutil.copytree(model_dir, tmp_path / "same"))
    tuned = copy_with_one_weight_changed(model_dir, tmp_path / "tuned")
    other = "float32" if AUTO_DTYPE == "bfloat16" else "bfloat16"  # not what `auto` gives here
    auto = ("--dtype", AUTO_DTYPE)
    c = Cluster(log_dir)
    try:
        c.start_gateway(wait=False)
        c.add_worker("prefill", "--model", str(model_dir), "--worker-id", "base", "--dtype", "auto")
        c.wait_roles(prefill=1)
        refused = {"tuned": ("--model", str(tuned), *auto),
                   "other": ("--model", str(model_dir), "--dtype", other),
                   "block32": ("--model", str(model_dir), *auto, "--block-size", "32"),
                   "int8": ("--model", str(model_dir), *auto, "--quantization", "int8")}
        procs = [c.add_worker("decode", *args, "--worker-id", wid) for wid, args in refused.items()]
        c.add_worker("decode", "--model", str(same), "--worker-id", "same", *auto)
        c._wait(lambda: all(_refused(c, w) for w in refused), "every mismatched worker refused")
        workers = c.wait_roles(prefill=1, decode=1)
        assert sorted(w["id"] for w in workers) == ["base", "same"]  # the identical copy joins
        assert len({w["compat_hash"] for w in workers}) == 1
        assert all(p.alive() for p in procs)
        assert not _refused(c, "same")
    finally:
        c.stop()


def test_a_worker_whose_kernels_give_other_bits_is_refused(log_dir: Path, model_dir: Path) -> None:
    """int8 at bf16, one worker per CPU kind this host can run as (`PDSERVE_CPU_FEATURES`):
    a kind whose kernels differ from the registered worker's (pdserve/engine/kernels/numerics.py;
    VNNI int8 vs aten under `avx2`, AMX vs AVX-512 BF16 under `-amx` on an AMX host) is
    refused, one whose kernels give the same bits joins."""
    from pdserve.engine.kernels import cpu_features, table
    from pdserve.engine.kernels.numerics import numerics

    args = ("--model", str(model_dir), "--dtype", "bfloat16", "--quantization", "int8")
    native = numerics("cpu", "bfloat16", "int8", features=table.available_features())
    kinds = {"as-avx2": "avx2", "as-no-amx": "-amx", "as-native": ""}
    differs = {wid: numerics("cpu", "bfloat16", "int8",
                             features=table.available_features() & cpu_features.parse(mask)) != native
               for wid, mask in kinds.items()}
    assert not differs["as-native"]  # (and on a host with AVX-512 VNNI, as-avx2 differs)
    c = Cluster(log_dir)
    try:
        c.start_gateway(wait=False)
        c.add_worker("prefill", *args, "--worker-id", "base")
        c.wait_roles(prefill=1)
        for wid, mask in kinds.items():
            c.add_worker("decode", *args, "--worker-id", wid, env={"PDSERVE_CPU_FEATURES": mask})
        c._wait(lambda: all(_refused(c, w) for w, d in differs.items() if d), "every other kind refused")
        joined = {w["id"] for w in c.wait_roles(prefill=1, decode=sum(not d for d in differs.values()))}
        assert joined == {"base"} | {w for w, d in differs.items() if not d}
    finally:
        c.stop()
