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


def test_checkpoint_one_weight_apart_is_refused_at_registration(
    log_dir: Path, model_dir: Path, tmp_path: Path
) -> None:
    same = Path(shutil.copytree(model_dir, tmp_path / "same"))
    tuned = copy_with_one_weight_changed(model_dir, tmp_path / "tuned")
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        c.add_worker("prefill", "--model", str(model_dir), "--worker-id", "base")
        c.wait_roles(prefill=1)
        tuned_proc = c.add_worker("decode", "--model", str(tuned), "--worker-id", "tuned")
        c.add_worker("decode", "--model", str(same), "--worker-id", "same")
        c._wait(lambda: _refused(c, "tuned"), "the gateway refusing the tuned checkpoint")
        workers = c.wait_roles(prefill=1, decode=1)
        assert sorted(w["id"] for w in workers) == ["base", "same"]  # the identical copy joins
        assert len({w["compat_hash"] for w in workers}) == 1
        assert tuned_proc.alive()
        assert not _refused(c, "same")
    finally:
        c.stop()


def test_dtype_quantization_and_block_size_mismatches_are_refused_at_registration(
    log_dir: Path, model_dir: Path
) -> None:
    other = "float32" if AUTO_DTYPE == "bfloat16" else "bfloat16"  # not what `auto` gives here
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        c.add_worker("prefill", "--model", str(model_dir), "--worker-id", "base", "--dtype", "auto")
        c.wait_roles(prefill=1)
        procs = [c.add_worker("decode", "--model", str(model_dir), "--worker-id", "other", "--dtype", other),
                 c.add_worker("decode", "--model", str(model_dir), "--worker-id", "block32",
                              "--block-size", "32"),
                 c.add_worker("decode", "--model", str(model_dir), "--worker-id", "int8", "--quantization", "int8")]
        c._wait(lambda: all(_refused(c, w) for w in ("other", "block32", "int8")), "every mismatched worker refused")
        assert [w["id"] for w in c.worker_list()] == ["base"]
        assert all(p.alive() for p in procs)
    finally:
        c.stop()
