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
