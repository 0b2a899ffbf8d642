"""`pdserve profile` measures the engine in-process and writes a profile that `pdserve
plan --simulate` reads; bad input is refused in one line with status 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.cli import main
from pdserve.planner.profile import SCHEMA, Profile


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "p.json"
    argv = ["profile", "--threads", "1", "--dtype", "float32", "-o", str(path), "--prefill-lengths", "16,64,256",
            "--batch-sizes", "1,4", "--context-lengths", "16,128", "--decode-steps", "2", "--reps", "1"]
    assert main(argv) == 0
    return path


def test_profile_writes_measured_points_and_a_fit(profile_path: Path) -> None:
    data = json.loads(profile_path.read_text())
    assert data["schema"] == SCHEMA and data["dtype"] == "float32" and data["threads"] == 1
    assert [n for n, _ in data["prefill"]["points"]] == [16, 64, 256]
    assert [(b, c) for b, c, _ in data["decode"]["points"]] == [(1, 16), (1, 128), (4, 16), (4, 128)]
    assert all(s > 0 for _, s in data["prefill"]["points"]) and data["kv_capacity_tokens"] > 0
    assert data["kv_copy_s_per_token"] > 0 and len(data["load_average"]) == 2
    p = Profile.load(profile_path)
    assert p.prefill.prompt_s(256) > p.prefill.prompt_s(16) > 0 and p.decode.step_s(4, 512) > 0


def test_plan_simulate_prints_every_split_and_recommends_one(profile_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--simulate", str(profile_path), "--workload", "rate=2,n=20,prompt=64-256,output=8",
            "--slo", "ttft=2,itl=0.5", "--workers", "3"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(s["prefill"], s["decode"]) for s in out["splits"]] == [(1, 2), (2, 1)]
    assert out["recommended"] in ("1:2", "2:1") and all(s["requests"] == 20 for s in out["splits"])
    assert main(argv) == 0
    assert "<- recommended" in capsys.readouterr().out
    # arrivals 0.5 s apart never queue at a gateway busy 0.2 s per request: each TTFT grows by it
    uniform = ["plan", "--simulate", str(profile_path), "--workload",
               "rate=2,n=10,prompt=64-256,output=8,arrivals=uniform", "--slo", "ttft=2,itl=0.5", "--json"]
    assert main(uniform) == 0
    base = json.loads(capsys.readouterr().out)
    assert main([*uniform, "--gateway-ms", "200", "--local-prefill-threshold", "0"]) == 0
    later = json.loads(capsys.readouterr().out)
    assert [s["ttft_s"]["p50"] - t["ttft_s"]["p50"] for s, t in zip(later["splits"], base["splits"], strict=True)] \
        == pytest.approx([0.2])
    # three workers on one core: every split is slower than with a core each
    assert main([*argv, "--json", "--cores", "1"]) == 0
    shared = json.loads(capsys.readouterr().out)
    assert all(s["ttft_s"]["p90"] > t["ttft_s"]["p90"] for s, t in zip(shared["splits"], out["splits"], strict=True))


@pytest.mark.parametrize("extra, message", [
    (["--workload", "rate=2,n=5,prompt=64"], "workload needs output"),
    (["--workload", "rate=2,n=5,prompt=64,output=8", "--slo", "ttft=1"], "SLO: expected both ttft= and itl="),
    (["--workload", "rate=2,n=5,prompt=64,output=8", "--kv-tokens", "32"], "needs 5 KV blocks"),
])
def test_plan_simulate_refuses_bad_input(profile_path: Path, capsys: pytest.CaptureFixture[str],
                                         extra: list[str], message: str) -> None:
    assert main(["plan", "--simulate", str(profile_path), *extra]) == 2
    assert message in capsys.readouterr().err


def test_plan_without_simulate_still_needs_its_sizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--max-model-len", "128"]) == 2
    assert "--device-memory: is required (unless --simulate)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["plan", "--simulate", str(bad), "--workload", "rate=1,n=1,prompt=8,output=1"]) == 2
    assert "not a pdserve-profile/1 profile" in capsys.readouterr().err
