"""cupy compiles kernels at first use (the CUDA IPC checksums) and caches them under
CUPY_CACHE_DIR, by default ~/.cupy: on a read-only root filesystem the first transfer would
fail. The GPU image and the GPU worker manifests point it at a writable path."""

from __future__ import annotations

import shlex
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml

from tests.deploy.test_docker import DOCKERFILES, SHIPPED_TARGETS, parse_dockerfile

K8S_BASE = Path(__file__).resolve().parents[2] / "deploy" / "k8s" / "base"
GPU_WORKERS = ("prefill.yaml", "decode.yaml")


def _under(path: str, mount: str) -> bool:
    return PurePosixPath(mount) in (PurePosixPath(path), *PurePosixPath(path).parents)


def test_gpu_image_sets_cupy_cache_under_tmp() -> None:
    df = parse_dockerfile(DOCKERFILES["gpu"])
    for name in SHIPPED_TARGETS:
        env: dict[str, str] = {}
        for stage in reversed(df.chain(df.stage(name))):  # base first, so later ENV wins
            for instr, rest in stage.instructions:
                if instr == "ENV":
                    env.update(w.split("=", 1) for w in shlex.split(rest) if "=" in w)
        assert _under(env.get("CUPY_CACHE_DIR", "~/.cupy"), "/tmp"), name


def _deployment(path: Path) -> dict[str, Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    return next(d for d in docs if d["kind"] == "Deployment")


@pytest.mark.parametrize("manifest", GPU_WORKERS)
def test_gpu_workers_cache_cupy_kernels_on_a_writable_volume(manifest: str) -> None:
    spec = _deployment(K8S_BASE / manifest)["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True  # why this matters
    env = {e["name"]: e.get("value") for e in container["env"]}
    cache = env.get("CUPY_CACHE_DIR")
    assert cache, f"{manifest}: CUPY_CACHE_DIR unset (cupy would write under a read-only home)"
    mounts = [m for m in container["volumeMounts"] if _under(cache, m["mountPath"])]
    assert mounts, f"{manifest}: {cache} is on the read-only root filesystem"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))  # the innermost mount holds it
    assert not mount.get("readOnly", False)
    assert "emptyDir" in volumes[mount["name"]]
