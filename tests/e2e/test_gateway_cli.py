"""`pdserve gateway` flags: API keys from a file (and the environment), protected
/metrics, a warning when serving off loopback without a key, admission, connection and
size limits mapped onto `GatewayConfig`, `pdserve up` forwarding the key, admission and
timeout flags, and unknown options rejected."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from pdserve.cli import build_parser
from pdserve.cli.gateway_options import gateway_settings
from pdserve.cli.up import _gateway_cmd, gateway_env
from tests.e2e.cluster import Cluster, http, start

KEY = "sk-test-right-key"
OTHER = "sk-from-the-environment"


def _call(method: str, url: str, key: str | None, body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            raw, status = r.read(), r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def _key_file(tmp: Path) -> Path:
    path = tmp / "keys.txt"
    path.write_text(f"# gateway keys\n\n  {KEY}  # the one the test uses\nsk-another\n")
    return path


def test_api_key_file_protects_every_api_route(log_dir: Path) -> None:
    c = Cluster(log_dir)
    try:
        c.start_gateway("--api-key-file", str(_key_file(log_dir)))
        c.add_worker("worker")
        model = _ready_model(c, KEY)
        routes: list[tuple[str, str, Any]] = [
            ("GET", "/v1/models", None),
            ("POST", "/v1/completions", {"model": model, "prompt": "Hello", "max_tokens": 3}),
            ("POST", "/v1/chat/completions",
             {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
        ]
        for method, path, body in routes:
            for key in (None, "sk-wrong", "#"):
                status, out = _call(method, c.url + path, key, body)
                assert status == 401, (path, key, out)
                err = out["error"]
                assert err["code"] == "invalid_api_key" and err["type"] and err["message"], out
            status, out = _call(method, c.url + path, KEY, body)
            assert status == 200, (path, out)
        for path in ("/health", "/ready", "/metrics"):
            assert _call("GET", c.url + path, None)[0] == 200, path
        # The worker list takes the admin token, never an API key.
        assert _call("GET", c.url + "/v1/workers", KEY)[0] == 401
        assert _call("GET", c.url + "/v1/workers", c.admin_token)[0] == 200
    finally:
        c.stop()


def test_metrics_protected_and_keys_from_the_environment(log_dir: Path) -> None:
    c = Cluster(log_dir)
    try:
        args = ["gateway", "--port", str(c.port), "--control-port", str(c.control_port),
                "--api-key", KEY, "--metrics-protected"]
        c.gateway = start("gateway", args, log_dir, env={"PDSERVE_API_KEYS": f" {OTHER} ,"})
        c._wait(lambda: http("GET", f"{c.url}/health", timeout=2)[0] == 200, "gateway /health")
        assert _call("GET", c.url + "/metrics", None)[0] == 401
        assert _call("GET", c.url + "/metrics", "sk-wrong")[0] == 401
        assert _call("GET", c.url + "/metrics", KEY)[0] == 200
        assert _call("GET", c.url + "/v1/models", OTHER)[0] == 200
        assert _call("GET", c.url + "/health", None)[0] == 200
        assert _call("GET", c.url + "/ready", None)[0] == 503  # open, just no workers
    finally:
        c.stop()


def _ready_model(c: Cluster, key: str) -> str:
    c._wait(lambda: _call("GET", c.url + "/ready", None)[0] == 200, "gateway /ready", 90)
    status, out = _call("GET", c.url + "/v1/models", key)
    assert status == 200, out
    return str(out["data"][0]["id"])


# --- flag mapping (no processes) ----------------------------------------------


def _settings(*argv: str) -> dict[str, Any]:
    return gateway_settings(build_parser().parse_args(["gateway", *argv]))


def test_admission_and_limit_flags_map_to_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway.config import AdmissionConfig, GatewayConfig, RequestLimits

    monkeypatch.delenv("PDSERVE_API_KEYS", raising=False)
    s = _settings()
    assert s["admission"] == AdmissionConfig() and s["limits"] == RequestLimits()
    assert s["api_keys"] == () and s["metrics_protected"] is False

    s = _settings("--max-in-flight", "7", "--max-queue-depth", "2", "--max-queue-wait", "1.5",
                  "--max-queue-depth-batch", "9", "--max-queue-wait-interactive", "0.25",
                  "--batch-aging", "0", "--retry-after", "4", "--max-body-bytes", "2048",
                  "--max-prompt-tokens", "100", "--max-n", "2", "--max-tokens-limit", "50",
                  "--max-stop", "3", "--max-logprobs", "5", "--max-messages", "6",
                  "--default-max-tokens", "11")
    adm, lim = s["admission"], s["limits"]
    assert adm.max_in_flight == 7 and adm.retry_after_s == 4 and adm.batch_aging_s is None
    assert (adm.interactive.max_depth, adm.interactive.max_wait_s) == (2, 0.25)
    assert (adm.batch.max_depth, adm.batch.max_wait_s) == (9, 1.5)
    assert (lim.max_body_bytes, lim.max_prompt_tokens, lim.max_n, lim.max_tokens) == (
        2048,
        100,
        2,
        50,
    )
    assert (lim.max_stop, lim.max_logprobs, lim.max_messages) == (3, 5, 6)
    assert GatewayConfig(**s).default_max_tokens == 11

    keys = _key_file(tmp_path)
    monkeypatch.setenv("PDSERVE_API_KEYS", f"{OTHER},{KEY}")
    s = _settings("--api-key", "sk-flag", "--api-key-file", str(keys), "--metrics-protected")
    assert s["api_keys"] == ("sk-flag", KEY, "sk-another", OTHER) and s["metrics_protected"] is True


@pytest.mark.parametrize(
    "argv",
    [["--bogus"], ["--max-n", "two"], ["--api-key-file"], ["--max-queue-depth-urgent", "1"]],
)
def test_bad_gateway_flags_are_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gateway", *argv])


def test_bad_key_file_and_limits_stop_the_gateway(tmp_path: Path) -> None:
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing here\n\n")
    for argv in (["--api-key-file", str(empty)], ["--api-key-file", str(tmp_path / "missing")]):
        with pytest.raises(SystemExit, match="--api-key-file"):
            _settings(*argv)
    with pytest.raises(ValueError, match="max_n"):
        _settings("--max-n", "0")


def test_up_forwards_api_key_and_stall_timeout_flags(tmp_path: Path) -> None:
    keys = _key_file(tmp_path)
    args = build_parser().parse_args(
        ["up", "--api-key", "sk-a", "--api-key", "sk-b", "--api-key-file", str(keys), "--stall-timeout", "7"]
    )
    cmd = _gateway_cmd(args, 5555)
    assert cmd[cmd.index("--stall-timeout") + 1] == "7.0"
    assert cmd[cmd.index("--api-key-file") + 1] == str(keys.resolve())
    # The keys themselves travel by the gateway's environment, never its argv (issue 36).
    assert "--api-key" not in cmd and not any("sk-a" in a or "sk-b" in a for a in cmd)
    assert gateway_env(args)["PDSERVE_API_KEYS"].split(",")[-2:] == ["sk-a", "sk-b"]


@pytest.mark.parametrize(("argv", "env", "message"), [
    (["--stall-timeout", "-1"], {}, "argument --stall-timeout: expected a number >= 0"),
    ([], {"PDSERVE_GATEWAY_SEED_KEY": "not hex"}, "PDSERVE_GATEWAY_SEED_KEY must be hex"),
])
def test_bad_stall_timeout_and_seed_key_stop_the_gateway(
    tmp_path: Path, argv: list[str], env: dict[str, str], message: str,
) -> None:
    proc = start("gateway", ["gateway", "--port", "0", *argv], tmp_path, env)
    try:
        assert proc.popen.wait(60) != 0
    finally:
        proc.stop()
    assert message in proc.log()


def test_connection_and_prompt_flags_map_to_the_config() -> None:
    from gateway.config import ConnectionLimits, GatewayConfig

    s = _settings()
    assert s["connections"] == ConnectionLimits() and s["special_tokens_in_content"] is False
    s = _settings("--max-connections", "9", "--header-timeout", "2", "--body-timeout", "3",
                  "--idle-write-timeout", "4", "--tokenizer-threads", "3", "--allow-special-tokens-in-content",
                  "--max-stop-token-ids", "5", "--max-user-len", "7", "--max-prompt-chars", "1000")
    assert s["connections"] == ConnectionLimits(max_connections=9, header_timeout_s=2.0, body_timeout_s=3.0,
                                                idle_write_timeout_s=4.0)
    config = GatewayConfig(**s)
    assert config.tokenizer_threads == 3 and config.special_tokens_in_content is True
    lim = config.limits
    assert (lim.max_stop_token_ids, lim.max_user_len, lim.max_prompt_chars) == (5, 7, 1000)


def test_up_forwards_admission_and_timeout_flags() -> None:
    flags = ["--max-in-flight", "3", "--request-timeout", "20.0", "--max-queue-depth", "4",
             "--max-queue-wait", "1.5", "--max-connections", "100", "--header-timeout", "2.0",
             "--body-timeout", "3.0", "--idle-write-timeout", "4.0"]
    cmd = _gateway_cmd(build_parser().parse_args(["up", *flags]), 5555)
    gw = cmd[cmd.index("gateway"):]
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        assert gw[gw.index(flag) + 1] == value, flag
    assert "--max-connections" not in _gateway_cmd(build_parser().parse_args(["up"]), 5555)
    # what up forwards, the gateway accepts
    s = _settings(*flags[:2], *flags[4:])
    assert s["admission"].max_in_flight == 3 and s["connections"].idle_write_timeout_s == 4.0


def test_off_loopback_without_an_api_key_warns(tmp_path: Path) -> None:
    """A gateway listening beyond loopback with no API key logs a warning; with a key
    (from the environment, not the command line) it does not."""
    for env, warned in (({}, True), ({"PDSERVE_API_KEYS": KEY}, False)):
        c = Cluster(tmp_path / ("open" if warned else "keyed"))
        c.log_dir.mkdir()
        try:
            c.gateway = start("gateway", ["gateway", "--host", "0.0.0.0", "--port", str(c.port),
                                          "--control-port", str(c.control_port)], c.log_dir, env)
            c.wait_gateway()
            log = c.gateway.log()
            assert ('"no_api_key"' in log) is warned, log
            assert '"api_key_on_command_line"' not in log
            status = _call("GET", c.url + "/v1/models", None)[0]
            assert status == (200 if warned else 401)
        finally:
            c.stop()
