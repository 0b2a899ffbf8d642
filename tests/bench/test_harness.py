"""bench/harness.py and the scripts built on it: every script runs as a module
(`python -m bench.NAME`) with the shared flags, and none edits `sys.path`."""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from bench import harness
from pdserve.common.sampling_params import SamplingParams
from tests.engine.test_engine import assert_idle, make_engine, prompts

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = ("overhead", "throughput", "prefix", "disagg_vs_colocated", "serve", "gpu_serve", "grammar_overhead",
           "structured_scale")


def _edits_sys_path(path: Path) -> bool:
    return any(isinstance(node, ast.Attribute) and node.attr == "path"
               and isinstance(node.value, ast.Name) and node.value.id == "sys"
               for node in ast.walk(ast.parse(path.read_text())))


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_runs_as_a_module_with_the_shared_flags(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert not _edits_sys_path(REPO / "bench" / f"{name}.py")
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as exit_:
        module.main(["--help"])
    assert exit_.value.code == 0
    usage = capsys.readouterr().out
    assert "--output-json" in usage
    assert ("--model-dir" if name == "gpu_serve" else "--model ") in usage


def test_the_checker_sees_a_sys_path_edit(tmp_path: Path) -> None:
    f = tmp_path / "script.py"
    f.write_text("import os, sys\nsys.path.insert(0, os.getcwd())\n")
    assert _edits_sys_path(f)


def test_up_args_tokenizer_and_model_fallbacks() -> None:
    assert harness.up_args("--prefill 1 --decode 1", "/m") == ["--prefill", "1", "--decode", "1", "--model", "/m"]
    assert harness.up_args("--colocated", None) == ["--colocated"]
    assert harness.model_dir("/m") == "/m"
    ap = harness.parser("Title line.\n\nMore.", tokenizer=True, engine_threads=True)
    assert ap.description == "Title line."
    args = ap.parse_args(["--model", "/m"])
    assert harness.tokenizer_dir(args) == "/m" and args.threads >= 1 and args.output_json is None
    assert harness.tokenizer_dir(ap.parse_args(["--model", "/m", "--tokenizer", "/t"])) == "/t"
    with pytest.raises(SystemExit):
        harness.parser(None, model_help=None).parse_args(["--model", "/m"])  # unknown flag


def test_write_json_only_with_a_path(tmp_path: Path) -> None:
    harness.write_json(None, {"a": 1})
    assert list(tmp_path.iterdir()) == []
    out = tmp_path / "r.json"
    harness.write_json(str(out), {"args": vars(argparse.Namespace(x=1)), "rows": [1.5]})
    assert json.loads(out.read_text()) == {"args": {"x": 1}, "rows": [1.5]}


def test_percentile_is_the_nearest_rank_value() -> None:
    xs = [float(x) for x in range(100, 0, -1)]  # unsorted on purpose
    assert harness.percentile(xs, 0.5) == 50.0 and harness.percentile(xs, 0.99) == 99.0
    assert harness.percentile(xs, 1.0) == 100.0 and harness.percentile(xs, 0.0) == 1.0
    assert harness.percentile(xs, 0.035 * 2) == 7.0  # 0.07 x 100 in floats is 7.000000000000001
    assert harness.percentile([3.0], 0.99) == 3.0
    assert harness.percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.0 and harness.percentile([1.0, 2.0, 3.0, 4.0], 0.51) == 3.0


def test_prefill_all_stops_once_every_request_has_its_first_token(
        tiny_model_dir: Callable[..., Path], one_torch_thread: None) -> None:
    engine = make_engine(tiny_model_dir("llama"), budget=32)  # 3 x 40 tokens: several steps
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts(40, 40, 40, seed=7)):
        engine.add_request(f"r{i}", prompt, params)
    harness.prefill_all(engine, 3)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_prompt_tokens_computed) == (3, 0, 120)
    assert 3 <= stats.num_generated_tokens < 3 * 50
    for i in range(3):
        engine.abort(f"r{i}")
    assert_idle(engine)


def test_engine_wave_times_the_prefill_and_the_decode_apart(
        tiny_model_dir: Callable[..., Path], one_torch_thread: None) -> None:
    engine = make_engine(tiny_model_dir("llama"), budget=2048)  # 3 x 40 tokens: one prefill step
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    warmup, *wave = prompts(8, 40, 40, 40, seed=3)
    w = harness.engine_wave(engine, wave, params, warmup=warmup, tag="w")
    assert w.prefill_s > 0 and w.decode_s > 0
    assert (w.decode_steps, w.decode_tokens) == (4, 3 * 4)  # every token but each request's first
    assert engine.stats().num_prompt_tokens_computed == 8 + 3 * 40  # the warm-up ran too
    assert_idle(engine)
    again = harness.engine_wave(engine, wave[:1], params, tag="again")  # no warm-up; new ids
    assert (again.decode_steps, again.decode_tokens) == (4, 4)


def test_background_runs_its_targets_for_the_block_and_stops_them_when_it_is_left() -> None:
    stop, started = threading.Event(), threading.Semaphore(0)
    runs: list[int] = []

    def target(i: int) -> None:
        started.release()
        while not stop.wait(0.01):
            pass
        runs.append(i)

    with pytest.raises(RuntimeError, match="the block failed"), harness.background(
            [lambda i=i: target(i) for i in range(3)], stop):
        for _ in range(3):
            assert started.acquire(timeout=30), "a target never started"
        assert not stop.is_set() and runs == []
        raise RuntimeError("the block failed")  # leaving by an exception stops them too
    assert stop.is_set() and sorted(runs) == [0, 1, 2]  # every thread ended before the block was left
