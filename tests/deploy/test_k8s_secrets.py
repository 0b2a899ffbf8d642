"""The Kubernetes base's keys: CURVE keys from one Secret, the gateway's API keys from
another, only file paths on any container's command line, and the rendered command
lines pass the CLI's own refusal of an exposed plane without keys
(pdserve/cli/curve_options.py, docs/security.md). tests/e2e/test_k8s_gateway_auth.py
runs the rendered gateway against fake workers.

Skips only when `kubectl` is not installed.
"""

from __future__ import annotations

import pytest

from tests.deploy.cli_args import parse_with_real_cli
from tests.deploy.test_k8s import (
    KUBECTL,
    WORKER_ROLES,
    Doc,
    _containers,
    _deployments,
    _expanded_args,
    _flag,
    _render,
)

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl not installed: cannot render the kustomizations"
)


@pytest.fixture(scope="module")
def example() -> list[Doc]:
    return _render("overlays/example")


def secret_mounts(dep: Doc, container: Doc) -> dict[str, tuple[str, dict[str, str]]]:
    """mount path -> (Secret name, {file path in the mount: Secret key})."""
    vols = {v["name"]: v for v in dep["spec"]["template"]["spec"].get("volumes", [])}
    out = {}
    for m in container.get("volumeMounts", []):
        secret = vols[m["name"]].get("secret")
        if secret is not None:
            assert m.get("readOnly") is True, f"{m['name']}: a Secret is mounted read-only"
            assert secret["defaultMode"] & 0o007 == 0, f"{m['name']}: Secret files readable by others"
            items = {i["path"]: i["key"] for i in secret.get("items", [])}
            out[m["mountPath"]] = (secret["secretName"], items)
    return out


def _from_secret(path: str, mounts: dict[str, tuple[str, dict[str, str]]]) -> tuple[str, str]:
    """(Secret name, key or directory inside it) that file or directory `path` comes from."""
    for mount, (name, items) in mounts.items():
        if path.startswith(mount + "/"):
            rel = path[len(mount) + 1:]
            if items:
                assert rel in items or any(i.startswith(rel + "/") for i in items), f"{path}: not mounted"
            return name, items.get(rel, rel)
    raise AssertionError(f"{path} is not in a mounted Secret")


def test_keys_come_from_secrets_and_never_sit_on_a_command_line(example: list[Doc]) -> None:
    """The exposed control and KV planes carry CURVE keys from one Secret, the gateway's
    API keys come from another, every key flag names a file, and the manifests pass the
    CLI's own refusal of an exposed plane without keys (pdserve/cli/curve_options.py)."""
    from pdserve.cli.curve_options import check_gateway_exposure, check_worker_exposure

    deps = _deployments(example)
    gateway = _containers(deps["gateway"])[0]
    args = _expanded_args(gateway, example)
    mounts = secret_mounts(deps["gateway"], gateway)
    assert _from_secret(_flag(args, "--curve-secret-key"), mounts) == ("pdserve-curve", "gateway.key_secret")
    assert _from_secret(_flag(args, "--curve-authorized-keys"), mounts)[0] == "pdserve-curve"
    api_secret, _ = _from_secret(_flag(args, "--api-key-file"), mounts)
    assert api_secret not in ("pdserve-curve", "") and "--api-key" not in args
    check_gateway_exposure(parse_with_real_cli(args))
    for role in WORKER_ROLES:
        c = _containers(deps[role])[0]
        args = _expanded_args(c, example)
        mounts = secret_mounts(deps[role], c)
        assert _from_secret(_flag(args, "--curve-key"), mounts) == ("pdserve-curve", "worker.key_secret")
        assert _from_secret(_flag(args, "--curve-server-key"), mounts) == ("pdserve-curve", "gateway.key")
        assert _from_secret(_flag(args, "--curve-authorized-keys"), mounts)[0] == "pdserve-curve"
        # A worker never holds the gateway's secret: it could pose as the control plane.
        assert all("gateway.key_secret" not in items.values() for _, items in mounts.values()), role
        check_worker_exposure(parse_with_real_cli(args))
