"""`--insecure` and `pdserve keygen`: off loopback without CURVE keys a gateway or a
worker starts only when told `--insecure`, and then warns; with keys, or on loopback,
nothing is refused. The refusals themselves (exit 2, one line) are cases in
tests/test_cli_args.py."""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq.auth

from pdserve.cli import build_parser
from pdserve.cli.args import UsageError
from pdserve.cli.curve_options import check_gateway_exposure, check_worker_exposure, is_loopback

ROOT = Path(__file__).resolve().parents[1]


def test_loopback_means_loopback() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("gateway.svc")


@pytest.mark.parametrize("argv,flag", [
    (["gateway", "--control-host", "0.0.0.0"], "--control-host"),
    (["decode", "--gateway", "tcp://127.0.0.1:5", "--kv-host", "10.0.0.5"], "--kv-host"),
    (["prefill", "--gateway", "tcp://10.0.0.1:5"], "--gateway"),
])
def test_exposed_plane_needs_keys_or_insecure(argv: list[str], flag: str, caplog: pytest.LogCaptureFixture) -> None:
    check = check_gateway_exposure if argv[0] == "gateway" else check_worker_exposure
    with pytest.raises(UsageError, match=flag):
        check(build_parser().parse_args(argv))
    with caplog.at_level(logging.WARNING, logger="pdserve.security"):
        check(build_parser().parse_args([*argv, "--insecure"]))  # started, and warned
    assert any("--insecure" in r.getMessage() and "without CURVE" in r.getMessage() for r in caplog.records)


def test_keys_or_loopback_start_without_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    keys = ["--curve-key", "k", "--curve-server-key", "s"]
    with caplog.at_level(logging.WARNING, logger="pdserve.security"):
        check_gateway_exposure(build_parser().parse_args(
            ["gateway", "--control-host", "0.0.0.0", "--curve-secret-key", "k", "--curve-authorized-keys", "d"]))
        check_worker_exposure(build_parser().parse_args(
            ["decode", "--gateway", "tcp://10.0.0.1:5", "--kv-host", "0.0.0.0", *keys]))
        check_gateway_exposure(build_parser().parse_args(["gateway"]))
        check_worker_exposure(build_parser().parse_args(["decode", "--gateway", "tcp://127.0.0.1:5"]))
    assert not caplog.records


def test_keygen_writes_private_usable_keys(tmp_path: Path) -> None:
    target = tmp_path / "cluster-keys"
    out = subprocess.run([sys.executable, "-m", "pdserve", "keygen", str(target)], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert stat.S_IMODE(target.stat().st_mode) == 0o700
    for f in target.rglob("*"):
        if f.is_file():
            assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    public, secret = zmq.auth.load_certificate(str(target / "worker.key_secret"))
    assert secret is not None and secret.decode() not in out.stdout  # paths are printed, keys never
    assert zmq.auth.load_certificates(str(target / "authorized")) == {public: True}
    gw_public, gw_secret = zmq.auth.load_certificate(str(target / "gateway.key"))
    assert gw_secret is None and gw_public != public
    assert str(target / "gateway.key_secret") in out.stdout
    again = subprocess.run([sys.executable, "-m", "pdserve", "keygen", str(target)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "not empty" in again.stderr  # never mixes old keys with new
    assert os.listdir(target / "authorized") == ["worker.key"]
