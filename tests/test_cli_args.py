"""Every `pdserve` subcommand refuses bad input in one line before starting anything:
a real `python -m pdserve ...` subprocess per case, which must exit with the
expected status within a bound, print exactly one stderr line naming the
argument and no traceback, and print nothing on stdout. And `pdserve up` whose
child fails to start exits at once with that child's one-line reason."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest

from pdserve.builtin.default_model import write_default_model
from pdserve.cli import build_parser
from pdserve.cli.up import _gateway_cmd, _worker_cmds

ROOT = Path(__file__).resolve().parents[1]
BOUND_S = 60.0  # a refusal is parse-time work; a hang (the old `--decode -1`) is not
GW = "tcp://127.0.0.1:5"  # never dialled: every case is refused before a worker connects


class Dirs(NamedTuple):
    good: Path  # the built-in model
    bad_config: Path  # config.json is not JSON
    no_tokenizer: Path  # valid config.json, no tokenizer.json
    bad_weights: Path  # config and tokenizer fine, weights corrupt (only a worker sees it)
    not_a_dir: Path  # a plain file


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> Dirs:
    root = tmp_path_factory.mktemp("models")
    good = write_default_model(root / "good")
    copies = {}
    for name in ("bad_config", "no_tokenizer", "bad_weights"):
        copies[name] = write_default_model(root / name)
    (copies["bad_config"] / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],\n')
    (copies["no_tokenizer"] / "tokenizer.json").unlink()
    (copies["bad_weights"] / "model.safetensors").write_bytes(b"not a safetensors file")
    not_a_dir = root / "plain-file"
    not_a_dir.write_text("x")
    return Dirs(good, copies["bad_config"], copies["no_tokenizer"], copies["bad_weights"], not_a_dir)


@pytest.fixture(scope="module")
def busy_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield int(s.getsockname()[1])


class Case(NamedTuple):
    argv: Callable[[Dirs, int], list[str]]
    names: str  # what the one stderr line must contain (the argument)
    rc: int = 2


CASES: dict[str, Case] = {
    # The ones a new user hit first.
    "up-model-missing": Case(lambda d, p: ["up", "--model", "/nonexistent"], "argument --model"),
    "up-config-not-json": Case(lambda d, p: ["up", "--model", str(d.bad_config)], "argument --model"),
    "up-kv-cache-memory-abc": Case(lambda d, p: ["up", "--kv-cache-memory", "abc"], "argument --kv-cache-memory"),
    "up-host-999": Case(lambda d, p: ["up", "--host", "999.1.1.1"], "argument --host"),
    "up-decode-negative": Case(lambda d, p: ["up", "--decode", "-1"], "argument --decode"),
    "up-port-99999": Case(lambda d, p: ["up", "--port", "99999"], "argument --port"),
    "up-prefill-threads-0": Case(lambda d, p: ["up", "--prefill-threads", "0"], "argument --prefill-threads"),
    # up: the rest of what a child would have failed on.
    "up-model-is-a-file": Case(lambda d, p: ["up", "--model", str(d.not_a_dir)], "argument --model"),
    "up-no-tokenizer": Case(lambda d, p: ["up", "--model", str(d.no_tokenizer)], "argument --model"),
    "up-max-model-len-over-limit": Case(
        lambda d, p: ["up", "--model", str(d.good), "--max-model-len", "100000"], "argument --max-model-len"),
    "up-block-size-0": Case(lambda d, p: ["up", "--block-size", "0"], "argument --block-size"),
    "up-port-in-use": Case(lambda d, p: ["up", "--model", str(d.good), "--port", str(p)], "argument --port"),
    "up-api-key-file-missing": Case(
        lambda d, p: ["up", "--model", str(d.good), "--api-key-file", "/nonexistent/keys"],
        "argument --api-key-file"),
    "up-api-key-with-a-comma": Case(  # PDSERVE_API_KEYS, how up passes it on, is comma-separated
        lambda d, p: ["up", "--model", str(d.good), "--api-key", "sk-a,b"], "argument --api-key"),
    "up-ready-timeout-nan": Case(lambda d, p: ["up", "--ready-timeout", "nan"], "argument --ready-timeout"),
    "up-kv-cache-memory-0": Case(lambda d, p: ["up", "--kv-cache-memory", "0"], "argument --kv-cache-memory"),
    # The other subcommands.
    "gateway-model-missing": Case(lambda d, p: ["gateway", "--model", "/nonexistent"], "argument --model"),
    "gateway-control-port-70000": Case(lambda d, p: ["gateway", "--control-port", "70000"], "argument --control-port"),
    "gateway-host-three-numbers": Case(lambda d, p: ["gateway", "--host", "1.2.3"], "argument --host"),
    "gateway-curve-half": Case(
        lambda d, p: ["gateway", "--model", str(d.good), "--curve-secret-key", "k"], "argument --curve-authorized-keys"),
    # An exposed control or KV plane without CURVE keys, and no --insecure (docs/security.md).
    "gateway-control-host-exposed": Case(
        lambda d, p: ["gateway", "--model", str(d.good), "--control-host", "0.0.0.0"], "argument --control-host"),
    "decode-kv-host-exposed": Case(
        lambda d, p: ["decode", "--gateway", GW, "--kv-host", "0.0.0.0"], "argument --kv-host"),
    "prefill-remote-gateway": Case(
        lambda d, p: ["prefill", "--gateway", "tcp://10.1.2.3:5"], "argument --gateway"),
    "worker-dns-gateway": Case(
        lambda d, p: ["worker", "--colocated", "--gateway", "dns+tcp://gateway.example:5"], "argument --gateway"),
    "keygen-not-empty": Case(lambda d, p: ["keygen", str(d.good)], "argument directory"),
    "prefill-model-missing": Case(lambda d, p: ["prefill", "--gateway", GW, "--model", "/nonexistent"], "argument --model"),
    "prefill-max-model-len-over-limit": Case(
        lambda d, p: ["prefill", "--gateway", GW, "--model", str(d.good), "--max-model-len", "4096"],
        "argument --max-model-len"),
    "decode-kv-port-70000": Case(lambda d, p: ["decode", "--gateway", GW, "--kv-port", "70000"], "argument --kv-port"),
    "decode-kv-cache-memory-abc": Case(
        lambda d, p: ["decode", "--gateway", GW, "--kv-cache-memory", "lots"], "argument --kv-cache-memory"),
    "worker-device-tpu": Case(lambda d, p: ["worker", "--colocated", "--gateway", GW, "--device", "tpu"], "argument --device"),
    "worker-max-num-seqs-0": Case(
        lambda d, p: ["worker", "--colocated", "--gateway", GW, "--max-num-seqs", "0"], "argument --max-num-seqs"),
    "generate-model-missing": Case(lambda d, p: ["generate", "--model", "/nonexistent", "hi"], "argument --model"),
    "generate-block-size-0": Case(lambda d, p: ["generate", "--block-size", "0", "hi"], "argument --block-size"),
    "plan-max-model-len-0": Case(
        lambda d, p: ["plan", "--device-memory", "8GiB", "--max-model-len", "0"], "argument --max-model-len"),
    "plan-overhead-1.5": Case(
        lambda d, p: ["plan", "--device-memory", "8GiB", "--max-model-len", "8", "--overhead", "1.5"],
        "argument --overhead"),
    "plan-model-missing": Case(
        lambda d, p: ["plan", "--model", "/nonexistent", "--device-memory", "8GiB", "--max-model-len", "8"],
        "argument --model"),
    "up-dtype-fp8": Case(lambda d, p: ["up", "--dtype", "fp8"], "argument --dtype"),
    "prefill-dtype-int4": Case(lambda d, p: ["prefill", "--gateway", GW, "--dtype", "int4"], "argument --dtype"),
    "up-kv-cache-dtype-fp4": Case(lambda d, p: ["up", "--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype"),
    "decode-kv-cache-dtype-e5m2": Case(
        lambda d, p: ["decode", "--gateway", GW, "--kv-cache-dtype", "fp8_e5m2"], "argument --kv-cache-dtype"),
    "plan-dtype-fp8": Case(
        lambda d, p: ["plan", "--device-memory", "8GiB", "--max-model-len", "8", "--dtype", "fp8"], "argument --dtype"),
    "decode-quantization-int3": Case(
        lambda d, p: ["decode", "--gateway", GW, "--quantization", "int3"], "argument --quantization"),
    "generate-quantization-awq": Case(lambda d, p: ["generate", "--quantization", "awq", "hi"],
                                      "argument --quantization"),
    "bench-base-url-ftp": Case(lambda d, p: ["bench", "--base-url", "ftp://host"], "argument --base-url"),
    "bench-request-rate-negative": Case(lambda d, p: ["bench", "--request-rate", "-1"], "argument --request-rate"),
    "bench-extra-body-not-an-object": Case(lambda d, p: ["bench", "--extra-body", "[1]"], "argument --extra-body"),
    "gateway-auto-tool-choice-without-parser": Case(
        lambda d, p: ["gateway", "--enable-auto-tool-choice"], "argument --enable-auto-tool-choice"),
    "up-tool-call-parser-unknown": Case(lambda d, p: ["up", "--tool-call-parser", "xml"], "argument --tool-call-parser"),
    "worker-grammar-compile-timeout-0": Case(
        lambda d, p: ["worker", "--colocated", "--gateway", GW, "--grammar-compile-timeout", "0"],
        "argument --grammar-compile-timeout"),
    "decode-cpu-cores-abc": Case(lambda d, p: ["decode", "--gateway", GW, "--cpu-cores", "a-b"], "argument --cpu-cores"),
    "prefill-cpu-cores-not-ours": Case(
        lambda d, p: ["prefill", "--gateway", GW, "--model", str(d.good), "--cpu-cores", "4095"],
        "argument --cpu-cores"),
    "decode-borrow-without-share": Case(
        lambda d, p: ["decode", "--gateway", GW, "--model", str(d.good), "--cpu-cores", "0", "--borrow-cores", "0"],
        "argument --borrow-cores"),
    "up-cpu-affinity-on-overfull": Case(
        lambda d, p: ["up", "--model", str(d.good), "--cpu-affinity", "on", "--threads", "4096"],
        "argument --cpu-affinity"),
    "up-speculative-config-not-json": Case(
        lambda d, p: ["up", "--speculative-config", "{ngram"], "argument --speculative-config"),
    "decode-speculative-missing-k": Case(
        lambda d, p: ["decode", "--gateway", GW, "--speculative-config", '{"method": "ngram"}'],
        "argument --speculative-config"),
    "worker-speculative-draft-missing": Case(
        lambda d, p: ["worker", "--colocated", "--gateway", GW, "--speculative-config",
                      '{"method": "draft_model", "model": "/nonexistent", "num_speculative_tokens": 2}'],
        "argument --speculative-config"),
    "generate-speculative-unknown-key": Case(
        lambda d, p: ["generate", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                      '"k": 1}', "hi"], "argument --speculative-config"),
    # Parallel layouts the model cannot split (the built-in model: 8 heads, 4 KV heads, 4 layers).
    "up-decode-tp-3": Case(lambda d, p: ["up", "--model", str(d.good), "--decode-tp", "3"], "argument --decode-tp"),
    "decode-tp-3": Case(lambda d, p: ["decode", "--gateway", GW, "--tensor-parallel-size", "3"],
                        "argument --tensor-parallel-size"),
    "worker-pp-9": Case(lambda d, p: ["worker", "--colocated", "--gateway", GW, "--pipeline-parallel-size", "9"],
                        "argument --pipeline-parallel-size"),
    "prefill-tp-with-pp-9": Case(lambda d, p: ["prefill", "--gateway", GW, "--tensor-parallel-size", "2",
                                               "--pipeline-parallel-size", "9"], "argument --pipeline-parallel-size"),
    "make-model-under-a-file": Case(lambda d, p: ["make-model", str(d.not_a_dir / "sub")], "cannot write", rc=1),
}


def _pdserve(argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run `pdserve ARGV` in its own process group; on timeout the whole group is
    killed (a wrongly accepted `up` has children) and TimeoutExpired raised."""
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_argument_is_refused_in_one_line(name: str, dirs: Dirs, busy_port: int) -> None:
    case = CASES[name]
    argv = case.argv(dirs, busy_port)
    try:
        out = _pdserve(argv, BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pdserve {' '.join(argv)} did not finish within {BOUND_S}s")
    lines = out.stderr.splitlines()
    assert out.returncode == case.rc, (argv, out.returncode, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    assert len(lines) == 1 and case.names in lines[0], out.stderr
    assert lines[0].startswith("pdserve"), lines[0]
    assert out.stdout == "", out.stdout  # nothing started, nothing announced


def test_up_forwards_max_model_len_and_block_size() -> None:
    args = build_parser().parse_args(["up", "--max-model-len", "1024", "--block-size", "8"])
    for cmd in _worker_cmds(args, "tcp://127.0.0.1:5555"):
        parsed = build_parser().parse_args(cmd[3:])
        assert parsed.max_model_len == 1024 and parsed.block_size == 8
    gateway = build_parser().parse_args(_gateway_cmd(args, 5555)[3:])
    assert gateway.max_model_len == 1024
    plain = build_parser().parse_args(["up"])
    assert all("--block-size" not in c and "--max-model-len" not in c for c in _worker_cmds(plain, "tcp://x:1"))


def test_up_forwards_the_kv_cache_dtype() -> None:
    args = build_parser().parse_args(["up", "--kv-cache-dtype", "fp8"])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert len(cmds) == 2 and all(build_parser().parse_args(c[3:]).kv_cache_dtype == "fp8_e4m3" for c in cmds)
    plain = build_parser().parse_args(["up"])
    assert all("--kv-cache-dtype" not in c for c in _worker_cmds(plain, "tcp://x:1"))


def test_up_forwards_quantization_to_every_worker() -> None:
    for layout in (["--prefill", "2"], ["--colocated", "--workers", "2"]):
        args = build_parser().parse_args(["up", "--quantization", "int4", *layout])
        cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
        assert len(cmds) >= 2
        assert all(build_parser().parse_args(cmd[3:]).quantization == "int4" for cmd in cmds)
    assert build_parser().parse_args(["prefill", "--gateway", GW]).quantization == "none"


def test_up_forwards_the_lm_head_quantization_to_every_worker() -> None:
    args = build_parser().parse_args(["up", "--quantization", "int8", "--lm-head-quantization", "none"])
    cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
    assert len(cmds) == 2 and all(build_parser().parse_args(c[3:]).lm_head_quantization == "none" for c in cmds)
    assert build_parser().parse_args(["decode", "--gateway", GW]).lm_head_quantization == "auto"
    assert build_parser().parse_args(["generate", "--lm-head-quantization", "int8", "hi"]).lm_head_quantization == "int8"


def test_up_forwards_the_speculative_config_to_decode_and_colocated_workers_only() -> None:
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "disable_by_batch_size": 4}'
    for flags, roles in ((["--prefill", "1", "--decode", "2"], ["prefill", "decode", "decode"]),
                         (["--colocated", "--workers", "2"], ["worker", "worker"])):
        args = build_parser().parse_args(["up", *flags, "--speculative-config", spec])
        cmds = _worker_cmds(args, "tcp://127.0.0.1:5555")
        assert [c[3] for c in cmds] == roles
        for cmd in cmds:
            parsed = build_parser().parse_args(cmd[3:])
            assert getattr(parsed, "speculative_config", None) == (None if cmd[3] == "prefill"
                                                                   else args.speculative_config)
    assert args.speculative_config.num_speculative_tokens == 3
    assert args.speculative_config.disable_by_batch_size == 4


def test_up_forwards_parallel_layouts_per_role() -> None:
    args = build_parser().parse_args(["up", "--prefill-tp", "2", "--decode-pp", "2", "--threads", "1"])
    layouts = {}
    for cmd in _worker_cmds(args, "tcp://127.0.0.1:5555"):
        parsed = build_parser().parse_args(cmd[3:])
        layouts[parsed.role] = (parsed.tensor_parallel_size, parsed.pipeline_parallel_size)
    assert layouts == {"prefill": (2, 1), "decode": (1, 2)}


def test_up_exits_at_once_with_the_failed_childs_reason(dirs: Dirs) -> None:
    """Weights only a worker reads are corrupt: `up` passes its checks, starts the
    cluster, and must stop as soon as that worker dies, saying why in one line,
    leaving no process behind (not wait out --ready-timeout)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = ["up", "--model", str(dirs.bad_weights), "--port", str(port), "--threads", "1",
            "--ready-timeout", "600"]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=300)  # well inside --ready-timeout
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("pdserve up waited on a dead worker")
    assert proc.returncode == 1, stderr
    assert "Traceback" not in stderr and "pdserve ready" not in stdout, stderr
    lines = stderr.splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("pdserve up: ") and "worker 1 exited with code 1" in lines[0], lines[0]
    assert "CheckpointError" in lines[0] and "model.safetensors" in lines[0], lines[0]
    assert _group_gone(proc.pid, within_s=30.0), "pdserve up left processes behind"


def _group_gone(pgid: int, within_s: float) -> bool:
    """Whether process group `pgid` empties within `within_s` (helpers such as
    multiprocessing's resource tracker exit shortly after their parent)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not subprocess.run(["pgrep", "-g", str(pgid)], capture_output=True, text=True).stdout.split():
            return True
        time.sleep(0.1)
    return False


def test_wait_ready_ends_at_the_first_exit_with_the_childs_last_line() -> None:
    from pdserve.cli.supervise import Child, Readiness, stop, wait_ready
    from pdserve.common.hosts import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: never ready
    alive = Child.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    dead = Child.start("bad child", [sys.executable, "-c",
                                     "import sys; sys.stderr.write('first\\n  last words \\n\\n'); sys.exit(3)"])
    try:
        started = wait_ready(url, [alive, dead], timeout_s=300)
        assert started == Readiness(False, "bad child exited with code 3: last words")
        assert alive.proc.poll() is None  # the wait ended on the exit, not on a timeout
    finally:
        stop([alive, dead])
    assert alive.proc.returncode == -signal.SIGTERM


def test_a_stop_asked_for_during_start_up_is_clean_not_a_failure() -> None:
    """SIGTERM/Ctrl-C before the cluster is ready: `up` stops cleanly and exits 0."""
    from pdserve.cli.supervise import Child, Readiness, stop, wait_ready
    from pdserve.common.hosts import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: never ready
    alive = Child.start("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        started = wait_ready(url, [alive], timeout_s=300, stopping=lambda: True)
        assert started == Readiness(False, "stopped before the cluster was ready", stopped=True)
    finally:
        stop([alive])


def test_a_worker_is_restarted_at_most_three_times_a_minute() -> None:
    from pdserve.cli.supervise import RestartBudget

    budget = RestartBudget(max_restarts=3, window_s=60.0)
    assert [budget.allow("decode worker 1", now=t) for t in (0.0, 1.0, 2.0, 3.0)] == [True, True, True, False]
    assert budget.allow("decode worker 2", now=3.0)  # counted per worker
    assert budget.allow("decode worker 1", now=60.5)  # the first restart is out of the window
    assert not budget.allow("decode worker 1", now=60.6)
