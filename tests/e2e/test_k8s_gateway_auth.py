"""The fake-worker attack against the gateway as the Kubernetes base runs it: the
rendered container command (`kubectl kustomize deploy/k8s/overlays/example`), with
its Secret volumes laid out as files the way the kubelet mounts them, run as a real
process on this host (control socket on 0.0.0.0, as in the pod). CPU workers join
with the worker part of the same Secret; fake workers, plain and with a key nobody
authorized, are refused and read no prompt, and the API answers only with a key
from the API-key Secret."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import cluster_keys
from tests.e2e import peers
from tests.e2e.cluster import ADMIN, Cluster, http, start
from tests.e2e.conftest import Reference

KUBECTL = shutil.which("kubectl")
API_KEY = "sk-k8s-test-0123456789"
PROMPTS = [f"Pod {i}: my secret password is" for i in range(3)]

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl not installed: cannot render the manifests")


def _mount_secrets(dep: dict[str, Any], container: dict[str, Any], keys: Path, api_keys: Path,
                   root: Path) -> dict[str, str]:
    """Lay each Secret volume of `container` out under `root` as the kubelet would
    (items at their paths, 0600 here); mount path -> local directory."""
    from tests.deploy.test_k8s_secrets import secret_mounts

    sources = {"pdserve-curve": lambda key: keys / key, "pdserve-api-keys": lambda key: api_keys}
    out = {}
    for i, (mount, (secret, items)) in enumerate(secret_mounts(dep, container).items()):
        local = root / f"mount{i}"
        for path, key in (items or {"api-keys": "api-keys"}).items():
            target = local / path
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            shutil.copyfile(sources[secret](key), target)
            os.chmod(target, 0o600)
        out[mount] = str(local)
    return out


def _localize(args: list[str], mounts: dict[str, str]) -> list[str]:
    out = []
    for a in args:
        for mount, local in mounts.items():
            if a.startswith(mount + "/"):
                a = local + a[len(mount):]
        out.append(a)
    return out


def _set(args: list[str], flag: str, value: str) -> list[str]:
    i = args.index(flag)
    return [*args[:i + 1], value, *args[i + 2:]]


def _curve_flags(args: list[str]) -> list[str]:
    return [x for i, a in enumerate(args) if a.startswith("--curve") for x in (a, args[i + 1])]


def test_rendered_k8s_gateway_refuses_fake_workers(log_dir: Path, model_dir: Path, reference: Reference) -> None:
    from tests.deploy.test_k8s import _containers, _deployments, _expanded_args, _render

    rendered = _render("overlays/example")
    deps = _deployments(rendered)
    keys = cluster_keys.create(str(log_dir / "keygen")).directory
    api_keys = log_dir / "api-keys.txt"
    api_keys.write_text(f"# the pdserve-api-keys Secret\n{API_KEY}\n")

    gw_dep = deps["gateway"]
    gw_container = _containers(gw_dep)[0]
    mounts = _mount_secrets(gw_dep, gw_container, Path(keys), api_keys, log_dir / "gateway-pod")
    args = _localize(_expanded_args(gw_container, rendered), mounts)
    assert peers.flag(args, "--control-host") == "0.0.0.0"  # exposed, as in the pod
    c = Cluster(log_dir, curve=False)
    args = _set(_set(_set(args, "--port", str(c.port)), "--control-port", str(c.control_port)),
                "--model", str(model_dir))
    fakes = None
    try:
        c.gateway = start("gateway", args, log_dir)
        c.wait_gateway()
        for role in ("prefill", "decode"):
            dep = deps[role]
            container = _containers(dep)[0]
            wmounts = _mount_secrets(dep, container, Path(keys), api_keys, log_dir / f"{role}-pod")
            curve = _curve_flags(_localize(_expanded_args(container, rendered), wmounts))
            assert len(curve) == 6, curve
            c.add_worker(role, "--kv-transport", "tcp", *curve)
        real = c.wait_roles(prefill=1, decode=1)
        decode = next(w for w in real if w["role"] == "decode")
        fakes = peers.FakeWorkers(c.control, str(decode["compat_hash"]), int(decode["block_size"]),
                                  str(Path(keys) / "gateway.key"))
        fakes.wait_refused()
        auth = {"Authorization": f"Bearer {API_KEY}"}
        for prompt in PROMPTS:
            body = {"model": reference.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0}
            assert http("POST", f"{c.url}/v1/completions", body)[0] == 401  # the API key Secret applies
            status, out = http("POST", f"{c.url}/v1/completions", body, headers=auth)
            want = reference.text(reference.generate(reference.completion_ids(prompt), max_tokens=6,
                                                     temperature=0.0)[0])
            assert status == 200 and out["choices"][0]["text"] == want, out
        status, listed = http("GET", f"{c.url}/v1/workers", headers=ADMIN)
        assert status == 200 and sorted(w["id"] for w in listed["data"]) == sorted(w["id"] for w in real)
        fakes.assert_got_nothing()
    finally:
        if fakes is not None:
            fakes.close()
        c.stop()
