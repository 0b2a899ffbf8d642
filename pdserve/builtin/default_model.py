"""The built-in models, and the directories they are served from.

- `pdserve-tiny-llama`: a small Llama (hidden 256, 4 layers, 8 heads, 4 KV heads)
  trained on `pdserve.builtin.story_corpus`; greedy output is readable English in the style of
  short children's stories, and the chat template answers questions such as "Tell me
  about the sea.".
- `pdserve-tiny-llama-draft`: a smaller one (hidden 128, 2 layers) with the same
  tokenizer, trained the same way, for speculative decoding.

Their weights, tokenizer and training record are committed under
`pdserve/builtin/weights/` (written by `pdserve train-model`, `pdserve.builtin.train`).
`write_builtin_model(dir)` assembles a complete Hugging Face directory from them
(`config.json`, `generation_config.json`, `model.safetensors`, `tokenizer.json`,
`tokenizer_config.json`) without training; two assemblies give byte-identical files.

`default_model_dir()` returns `<PDSERVE_HOME>/models/pdserve-tiny-llama`, assembled
on first use; with `PDSERVE_BUILTIN_WEIGHTS=random` it returns the random-weight
checkpoint of the same name and shape (`pdserve.builtin.random_model`, kept for benchmarks and
plumbing tests that need tokens to flow without an early end of sequence) from
`<PDSERVE_HOME>/models/random/pdserve-tiny-llama`. `draft_model_dir()` is the draft's.

This module needs only the standard library, safetensors' numpy side and tokenizers,
never torch: torch-free processes (the gateway) resolve the default model too.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from pdserve.builtin.random_model import (
    DEFAULT_MODEL_NAME,
    FILES,
    VERSION_FILE,
    DefaultModelSpec,
    WeightFormat,
    fingerprint,
    write_json,
    write_model_metadata,
    write_random_model,
)
from pdserve.builtin.tokenizer import BOS_TOKEN, CHAT_TEMPLATE, EOT_TOKEN
from pdserve.common import envs

__all__ = [
    "BOS_TOKEN", "DEFAULT_MODEL_NAME", "DRAFT", "DRAFT_MODEL_NAME", "EOT_TOKEN", "TRAINED",
    "BuiltinModel", "DefaultModelSpec", "WeightFormat", "default_model_dir", "draft_model_dir",
    "write_builtin_model", "write_default_model", "write_random_model",
]

DRAFT_MODEL_NAME = "pdserve-tiny-llama-draft"
BUILTIN_WEIGHTS_DIR = Path(__file__).resolve().with_name("weights")
WEIGHT_FILES = {
    "tokenizer": "tokenizer.json",
    "tiny-llama": "tiny-llama.safetensors",
    "tiny-llama-draft": "tiny-llama-draft.safetensors",
    "record": "training.json",
}
TINY_SPEC = DefaultModelSpec()
DRAFT_SPEC = DefaultModelSpec(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=344
)
# Bump when the assembling code changes the files it writes from the same inputs.
ASSEMBLY_VERSION = 1

# The random-weight writer under its earlier name, for callers that need a given shape.
write_default_model = write_random_model


@dataclass(frozen=True)
class BuiltinModel:
    """A trained built-in model: its served name and its committed weights file."""

    name: str
    weights: str  # key of WEIGHT_FILES
    spec: DefaultModelSpec


TRAINED = BuiltinModel(DEFAULT_MODEL_NAME, "tiny-llama", TINY_SPEC)
DRAFT = BuiltinModel(DRAFT_MODEL_NAME, "tiny-llama-draft", DRAFT_SPEC)


class BuiltinWeightsError(RuntimeError):
    """The committed files are missing or are not the ones `training.json` records."""


@functools.lru_cache(maxsize=1)
def _record_text() -> str:
    path = BUILTIN_WEIGHTS_DIR / WEIGHT_FILES["record"]
    try:
        return path.read_text()
    except OSError as e:
        raise BuiltinWeightsError(
            f"{path}: {e.strerror or e}; run `pdserve train-model` to write the built-in weights"
        ) from None


def training_record() -> dict[str, object]:
    """`training.json`: step counts, losses, seconds and digests of the last training."""
    record: dict[str, object] = json.loads(_record_text())
    return record


def _verified(key: str, want: object) -> Path:
    path = BUILTIN_WEIGHTS_DIR / WEIGHT_FILES[key]
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != want:
        raise BuiltinWeightsError(
            f"{path} is not the file training.json records (sha256 {digest}, want {want}); "
            "rerun `pdserve train-model`"
        )
    return path


def write_builtin_model(out_dir: Path, model: BuiltinModel = TRAINED) -> Path:
    """Assemble `model`'s Hugging Face directory in `out_dir` (created if missing).

    The weights and tokenizer are copied byte for byte after their digests are checked
    against `training.json`; existing files of the same names are overwritten.
    """
    record = training_record()
    entry = record[model.weights]
    assert isinstance(entry, dict), entry
    tok_path = _verified("tokenizer", record["tokenizer_sha256"])
    weights = _verified(model.weights, entry["sha256"])
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tok_path, out_dir / "tokenizer.json")
    shutil.copyfile(weights, out_dir / "model.safetensors")
    tok = Tokenizer.from_file(str(tok_path))
    write_model_metadata(out_dir, tok, model.spec, tok.get_vocab_size(with_added_tokens=True))
    write_json(
        out_dir / VERSION_FILE,
        {"name": model.name, "version": ASSEMBLY_VERSION, "fingerprint": _fingerprint(model)},
    )
    for f in FILES:
        (out_dir / f).chmod(0o644)
    return out_dir


def _fingerprint(model: BuiltinModel) -> str:
    """Hash of every input of an assembly (the record holds the files' digests)."""
    key = f"{ASSEMBLY_VERSION}|{model!r}|{CHAT_TEMPLATE}|{_record_text()}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def _is_current(path: Path, want: str) -> bool:
    try:
        meta = json.loads((path / VERSION_FILE).read_text())
    except (OSError, ValueError):
        return False
    return bool(meta.get("fingerprint") == want)


def _built(path: Path, write: Callable[[Path], object], want: str) -> Path:
    """`path`, (re)built by `write` unless its fingerprint is `want`.

    Safe under concurrency: each builder writes a private temporary directory and
    renames it into place; a loser of the race discards its copy and uses the winner's.
    """
    if _is_current(path, want):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        write(tmp)
        tmp.chmod(0o755)  # mkdtemp creates 0700
        if path.exists() and not _is_current(path, want):
            # A stale (older version or half-copied by hand) model: move it aside first.
            stale = Path(tempfile.mkdtemp(prefix=f".{path.name}.stale-", dir=path.parent))
            with contextlib.suppress(OSError):  # another process may have moved it first
                os.replace(path, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, path)
        except OSError:
            if not _is_current(path, want):  # not a lost race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def default_model_dir() -> Path:
    """`<PDSERVE_HOME>/models/pdserve-tiny-llama` (trained), built on first use; the
    random-weight model's directory instead under `PDSERVE_BUILTIN_WEIGHTS=random`."""
    models = envs.home() / "models"
    if envs.builtin_weights() == "random":
        spec = DefaultModelSpec()
        return _built(models / "random" / DEFAULT_MODEL_NAME, write_random_model, fingerprint(spec))
    return _built(models / DEFAULT_MODEL_NAME, write_builtin_model, _fingerprint(TRAINED))


def draft_model_dir() -> Path:
    """`<PDSERVE_HOME>/models/pdserve-tiny-llama-draft`, built on first use."""
    path = envs.home() / "models" / DRAFT_MODEL_NAME
    return _built(path, lambda d: write_builtin_model(d, DRAFT), _fingerprint(DRAFT))
