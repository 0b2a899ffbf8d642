"""What the bench scripts share: their common command-line flags, the model and
tokenizer they fall back to, the `pdserve up` arguments they pass, the engine they
measure against, and the result JSON they write.

Every script runs as a module from the repository root (`python -m bench.NAME`),
so nothing edits `sys.path`. torch is imported only when an engine is built.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Any

from bench import models
from pdserve.loadgen.compare import split_args
from pdserve.loadgen.config import OutputConfig
from pdserve.loadgen.launch import default_tokenizer

if TYPE_CHECKING:
    from pdserve.engine.llm_engine import LLMEngine

MODEL_HELP = ("model dir, or shape:NAME for a random-weight Llama of a bench/models.py shape (default: "
              "built-in); also passed to `pdserve up`")


def parser(doc: str | None, *, model_help: str | None = MODEL_HELP, tokenizer: bool = False,
           engine_threads: bool = False) -> argparse.ArgumentParser:
    """A script's parser, described by its docstring's first line, with the flags most
    scripts share: `--model` (unless `model_help` is None), `--tokenizer` (when asked),
    `--threads` for the reference engine (when asked; all cores) and `--output-json`."""
    ap = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0] if doc else None)
    if model_help is not None:
        ap.add_argument("--model", default=None, help=model_help)
    if tokenizer:
        ap.add_argument("--tokenizer", default=None, help="default: the model's (--model) or the built-in one's")
    if engine_threads:
        ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="engine threads")
    ap.add_argument("--output-json", default=None, help="also write the results here as JSON")
    return ap


def model_dir(model: str | None) -> str:
    """`model` (a `shape:NAME` resolved by bench/models.py), or the built-in model's
    directory (written on first use)."""
    if model is not None:
        return str(models.resolve(model))
    from pdserve.builtin.default_model import default_model_dir

    return str(default_model_dir())


def tokenizer_dir(args: argparse.Namespace) -> str | None:
    """`--tokenizer`, else the model's own, else the built-in model's (None: approximate sizes)."""
    return getattr(args, "tokenizer", None) or models.resolve(args.model) or default_tokenizer()


def up_args(flags: str, model: str | None) -> list[str]:
    """`pdserve up` arguments: the script's flag string, plus `--model` when one was given
    (a `shape:NAME` resolved to its directory)."""
    return split_args(flags) + (["--model", str(models.resolve(model))] if model else [])


def output_config() -> OutputConfig:
    """The load generator's output: a progress bar only on a terminal."""
    return OutputConfig(progress=sys.stderr.isatty())


def reference_engine(model: str | None, threads: int) -> LLMEngine:
    """The single-process engine a script compares the served stack with (imports torch)."""
    from pdserve.engine.core.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=model_dir(model), num_threads=threads))


def prefill_all(engine: LLMEngine, num_requests: int) -> None:
    """Step until each of the `num_requests` queued requests has its first token."""
    started: set[str] = set()
    while len(started) < num_requests:
        started.update(o.request_id for o in engine.step() if any(c.token_ids for c in o.outputs))


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (no-op without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
