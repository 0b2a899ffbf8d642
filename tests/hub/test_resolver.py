"""`--model org/name` resolves through a Hugging Face cache laid out as huggingface_hub lays it out,
offline (HF_HUB_OFFLINE=1, no network), and every command sees only the snapshot directory."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.builtin.default_model import VERSION_FILE, default_model_dir
from pdserve.cli import build_parser
from pdserve.cli.args import UsageError, resolve_model_arg
from pdserve.cli.hub import ALLOW_PATTERNS, HubError, HubSource, is_repo_id, resolve_model
from tests.e2e.cluster import ROOT, _env
from tests.helpers.hf_cache import add_to_cache


@pytest.fixture
def offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "hf" / "hub"


def test_repo_id_resolves_to_its_snapshot_offline(offline_cache: Path, tmp_path: Path) -> None:
    main = add_to_cache(offline_cache, "acme/tiny", default_model_dir())
    other = tmp_path / "v2"
    other.mkdir()
    (other / "config.json").write_text("{}")
    v2 = add_to_cache(offline_cache, "acme/tiny", other, revision="v2")
    assert resolve_model("acme/tiny", HubSource()) == str(main)
    assert resolve_model("acme/tiny", HubSource(revision="v2")) == str(v2)
    assert (Path(resolve_model("acme/tiny", HubSource())) / "model.safetensors").is_file()


def test_download_dir_is_the_cache_used(offline_cache: Path, tmp_path: Path) -> None:
    elsewhere = tmp_path / "dl"
    snap = add_to_cache(elsewhere, "acme/tiny", default_model_dir())
    assert resolve_model("acme/tiny", HubSource(download_dir=elsewhere)) == str(snap)
    with pytest.raises(HubError, match="not in the Hugging Face cache"):
        resolve_model("acme/tiny", HubSource())  # the default cache does not hold it


def test_missing_id_offline_is_a_one_line_error(offline_cache: Path) -> None:
    with pytest.raises(HubError) as e:
        resolve_model("acme/absent", HubSource())
    assert "acme/absent" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
    assert "\n" not in str(e.value)


def test_directories_and_non_ids_are_left_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    assert not is_repo_id("org/name")  # an existing relative directory wins over the Hub
    assert resolve_model("org/name", HubSource()) == "org/name"
    for text in ("/abs/dir", "./x/y", "a/b/c", "../up/x", "name", "org/.."):
        assert not is_repo_id(text), text
    assert is_repo_id("Qwen/Qwen3-8B") and is_repo_id("meta-llama/Llama-3.1-8B-Instruct")


def test_the_built_in_model_needs_only_allowed_files() -> None:
    """Every file the engine and gateway read from a checkpoint matches ALLOW_PATTERNS."""
    # VERSION_FILE only tells the built-in model's builder whether to rebuild it; dotfiles
    # are pdserve's own caches written beside a model (the weights fingerprint).
    names = [p.name for p in default_model_dir().iterdir()
             if p.is_file() and p.name != VERSION_FILE and not p.name.startswith(".")]
    assert names and all(any(fnmatch.fnmatch(n, pat) for pat in ALLOW_PATTERNS) for n in names), names


def test_cli_replaces_the_id_by_the_directory_before_a_command_runs(offline_cache: Path) -> None:
    snap = add_to_cache(offline_cache, "acme/tiny", default_model_dir())
    for argv in (["up"], ["gateway"], ["prefill", "--gateway", "tcp://127.0.0.1:1"], ["plan", "--device-memory",
                 "1GiB", "--max-model-len", "64"], ["generate", "hi"]):
        args = build_parser().parse_args([*argv, "--model", "acme/tiny"])
        resolve_model_arg(args)
        assert (args.model, args.repo_id) == (str(snap), "acme/tiny"), argv
    args = build_parser().parse_args(["up", "--model", "acme/absent"])
    with pytest.raises(UsageError, match="acme/absent"):
        resolve_model_arg(args)


def test_missing_id_offline_exits_2_with_one_line(tmp_path: Path) -> None:
    env = _env({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    env.pop("HF_HUB_CACHE", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", "acme/absent"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pdserve up: error: argument --model:"), proc.stderr
    assert "acme/absent" in lines[0]


def test_lora_modules_given_as_repo_ids_resolve_like_the_model(offline_cache: Path, tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 4}')
    (adapter / "adapter_model.safetensors").write_bytes(b"x")
    snap = add_to_cache(offline_cache, "acme/pirate-lora", adapter)
    args = build_parser().parse_args(["up", "--enable-lora", "--lora-modules", "p=acme/pirate-lora",
                                      f"q={adapter}"])
    resolve_model_arg(args)
    assert args.lora_modules == [("p", str(snap)), ("q", str(adapter))]
    assert (snap / "adapter_config.json").is_file()
    assert any(fnmatch.fnmatch("adapter_config.json", p) for p in ALLOW_PATTERNS)
    missing = build_parser().parse_args(["up", "--enable-lora", "--lora-modules", "p=acme/none"])
    with pytest.raises(UsageError) as e:
        resolve_model_arg(missing)
    assert e.value.flag == "--lora-modules"
