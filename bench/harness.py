"""What the bench scripts share: their common command-line flags, the model and
tokenizer they fall back to, the `pdserve up` arguments they pass, the engine they
measure against, how they time (interleaved medians after a warm-up, phase laps, device
timing), the load they keep running in background threads, the lines and tables they
report with, and the result JSON they write.

Every script runs as a module from the repository root (`python -m bench.NAME`),
so nothing edits `sys.path`. torch is imported only when an engine is built.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar, cast

from bench import models
from pdserve.loadgen.compare import Column, split_args
from pdserve.loadgen.config import OutputConfig
from pdserve.loadgen.launch import default_tokenizer

if TYPE_CHECKING:
    from pdserve.common.sampling_params import SamplingParams
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


def parse_speed_args(ap: argparse.ArgumentParser, argv: list[str] | None, *, quick: tuple[int, int],
                     full: tuple[int, int]) -> argparse.Namespace:
    """`ap`'s arguments and the engine-speed flags: `--quick` (one rep of the `quick`
    (prompt, decode) lengths, else `full`), `--prompt-len`, `--decode-tokens`, `--reps`
    (default 3) and `--threads` (torch threads, set here; default torch's)."""
    ap.add_argument("--quick", action="store_true", help="short prompts, few tokens, one rep")
    for flag in ("--prompt-len", "--decode-tokens", "--reps"):
        ap.add_argument(flag, type=int, default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args(argv)
    lengths = quick if args.quick else full
    args.prompt_len = args.prompt_len or lengths[0]
    args.decode_tokens = args.decode_tokens or lengths[1]
    args.reps = args.reps or (1 if args.quick else 3)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return args


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


class Wave(NamedTuple):
    """One wave of requests run together on the reference engine."""

    prefill_s: float  # until every request has its first token
    decode_s: float  # from there to the last token
    decode_steps: int
    decode_tokens: int  # the tokens of those steps


def engine_wave(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, *,
                warmup: list[int] | None = None, tag: str = "r") -> Wave:
    """`prompts` (requests `{tag}{i}`) run together, their prefill (`prefill_all`) and
    their decode timed apart; first a 4-token request of `warmup` when one is given."""
    if warmup is not None:
        engine.generate([warmup], dataclasses.replace(params, max_tokens=4))
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", p, params)
    watch = Stopwatch()
    prefill_all(engine, len(prompts))
    prefill_s, steps, tokens = watch.lap(), 0, 0
    while engine.has_unfinished():
        tokens += sum(len(c.token_ids) for o in engine.step() for c in o.outputs)
        steps += 1
    return Wave(prefill_s, watch.lap(), steps, tokens)


def random_wave(model: str | None, threads: int, batch: int, prompt_len: int, output_len: int, seed: int) -> Wave:
    """`engine_wave` on a fresh reference engine: `batch` greedy requests of `prompt_len`
    random tokens and `output_len` output tokens, after one more of them as the warm-up."""
    import numpy as np

    from pdserve.common.sampling_params import SamplingParams

    engine = reference_engine(model, threads)
    rng = np.random.default_rng(seed)
    prompts = [[int(x) for x in rng.integers(10, engine.vocab_size, prompt_len)] for _ in range(batch + 1)]
    greedy = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    return engine_wave(engine, prompts[1:], greedy, warmup=prompts[0])


def write_json(path: str | None, result: dict[str, Any]) -> None:
    """Write `result` to `path` (no-op without one)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


@contextlib.contextmanager
def background(targets: Sequence[Callable[[], object]], stop: threading.Event, join_s: float = 120.0) -> Iterator[None]:
    """Each target in a daemon thread of its own while the `with` block runs (load beside
    what the block measures); every target loops until `stop` is set, which leaving the
    block does, and then each thread is joined (at most `join_s` s)."""
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for t in threads:
        t.start()
    try:
        yield
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=join_s)


# --- timing: every bench module times through these --------------------------------------
# Interleaving is the rule: the things compared take turns within each repetition, so the
# drift of a shared machine's load falls on all of them alike, and only ratios measured
# in the same run are reported (bench/README.md). The clock is a parameter so that tests
# can drive the harness with fake timings.

K = TypeVar("K")
T = TypeVar("T")
R = TypeVar("R")
Clock = Callable[[], float]


def timed(fn: Callable[[], T], clock: Clock = time.perf_counter) -> tuple[float, T]:
    """Seconds of one call of `fn`, and what it returned."""
    t0 = clock()
    value = fn()
    return clock() - t0, value


def seconds(fn: Callable[[], object], clock: Clock = time.perf_counter) -> float:
    """Seconds of one call of `fn`."""
    return timed(fn, clock)[0]


def fastest(fn: Callable[[], object], reps: int, clock: Clock = time.perf_counter) -> float:
    """The least seconds of `reps` calls of `fn` (the first may fault pages in)."""
    return min(seconds(fn, clock) for _ in range(reps))


class Stopwatch:
    """Seconds between marks, for a run timed in phases (prefill, then decode)."""

    def __init__(self, clock: Clock = time.perf_counter) -> None:
        self.clock = clock
        self.last = clock()

    def lap(self) -> float:
        """Seconds since the previous lap (or the start); the next lap counts from now."""
        now = self.clock()
        lap, self.last = now - self.last, now
        return lap


def turns(keys: Sequence[K], reps: int, *, warmup: int = 0, alternate: bool = False) -> Iterator[tuple[int, K]]:
    """(round, key) in the order the keys take turns: `warmup` rounds numbered from
    -warmup (whatever they measure is dropped), then rounds 0 to reps - 1; each round in
    the keys' order, reversed in odd rounds when `alternate` (which also cancels any
    warm-up favouring the later ones)."""
    for r in range(-warmup, reps):
        for k in keys[::-1] if alternate and r % 2 else keys:
            yield r, k


def rounds(fns: Mapping[K, Callable[[], T]], reps: int, *, warmup: int = 0,
           alternate: bool = False) -> dict[K, list[T]]:
    """Each fn's results over `reps` rounds in which the fns take turns (`turns`)."""
    out: dict[K, list[T]] = {k: [] for k in fns}
    for r, k in turns(list(fns), reps, warmup=warmup, alternate=alternate):
        value = fns[k]()
        if r >= 0:
            out[k].append(value)
    return out


def medians(fns: Mapping[K, Callable[[], object]], reps: int, *, warmup: int = 1,
            setup: Callable[[], object] | None = None, clock: Clock = time.perf_counter) -> dict[K, float]:
    """The median seconds of each fn over `reps` rounds in which the fns take turns
    (`rounds`) after `warmup` rounds; `setup` runs, untimed, before every call (a barrier)."""
    def timed_call(fn: Callable[[], object]) -> Callable[[], float]:
        def call() -> float:
            if setup is not None:
                setup()
            return seconds(fn, clock)

        return call

    times = rounds({k: timed_call(fn) for k, fn in fns.items()}, reps, warmup=warmup)
    return {k: statistics.median(ts) for k, ts in times.items()}


def percentile(xs: Sequence[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1) of `xs`: the smallest value with at least
    q x n of them at or below it (rank ceil(q x n), counted from 1), a value that occurred."""
    s = sorted(xs)
    rank = math.ceil(round(q * len(s), 9))  # 0.035 x 200 is 7.000000000000001 in floats
    return s[min(len(s), max(rank, 1)) - 1]


def median_of(records: Sequence[R]) -> R:
    """A record (NamedTuple, dataclass or dict) whose every field is the median of that
    field over `records`."""
    first: Any = records[0]
    if isinstance(first, dict):
        return cast(R, type(first)({f: statistics.median(r[f] for r in records) for f in first}))  # type: ignore[index]
    fields = first._fields if hasattr(first, "_fields") else [f.name for f in dataclasses.fields(first)]
    return type(first)(**{f: statistics.median(getattr(r, f) for r in records) for f in fields})


def median_summary(runs: Sequence[dict[str, Any]], columns: Sequence[Column]) -> dict[str, Any]:
    """A summary-shaped dict holding each column's median over the run summaries `runs`
    (in the summary's unit: `Column.value` scales, this divides back)."""
    out: dict[str, Any] = {}
    for c in columns:
        values = [v for r in runs if (v := c.value(r)) is not None]
        if values:
            node = out
            for key in c.path[:-1]:
                node = node.setdefault(key, {})
            node[c.path[-1]] = statistics.median(values) / c.scale
    return out


def device_seconds(fn: Callable[[], object], iters: int, warmup: int, device: str,
                   clock: Clock = time.perf_counter) -> float:
    """Mean seconds of `fn` over `iters` calls back to back after `warmup` calls: CUDA
    events on a cuda device (the calls are asynchronous there), else `clock`."""
    for _ in range(warmup):
        fn()
    if not device.startswith("cuda"):
        return seconds(lambda: [fn() for _ in range(iters)], clock) / iters
    import torch

    with torch.cuda.device(torch.device(device)):  # the events mark `device`'s stream
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
    return float(start.elapsed_time(end)) / 1e3 / iters


def read_bandwidth(threads: int | None = None, mib: int = 256, reps: int = 5) -> float:
    """Bytes/s of a float32 `sum` over `mib` MiB on `threads` torch threads (default: as
    set), median of `reps` after a warm-up: the floor a weight or KV stream cannot beat."""
    import torch

    x = torch.ones(mib * 2**20 // 4)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads or prev)
    try:
        return x.numel() * 4 / medians({"sum": x.sum}, reps)["sum"]
    finally:
        torch.set_num_threads(prev)


# --- the report: the machine line, verdicts, the ratio tables ------------------------------
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_vbmi", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


def machine_line() -> str:
    """The commit, CPU model and the SIMD flags the kernels choose their paths by, the
    cores and the load average: what every figure a bench prints goes with."""
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7", "--exclude=*"], capture_output=True,
                                text=True, timeout=10, cwd=Path(__file__).parent).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    model, flags = platform.processor() or "unknown CPU", set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    simd = " ".join(f for f in SIMD_FLAGS if f in flags) or "none of " + ",".join(SIMD_FLAGS)
    return (f"commit {commit}; {model}; {os.cpu_count()} cores; {simd}; "
            f"load average {os.getloadavg()[0]:.1f}")


def verdict(name: str, values: Sequence[float | None], target: str, ok: Callable[[float], bool],
            fmt: str = "{:.2f}") -> str:
    """One target's line: the per-run values ("-": none that run), their median and PASS/MISS."""
    got = [v for v in values if v is not None]
    median = statistics.median(got) if got else None
    status = "PASS" if median is not None and ok(median) else "MISS"
    return (f"VERDICT {name}: per run {', '.join('-' if v is None else fmt.format(v) for v in values)}; median "
            f"{'-' if median is None else fmt.format(median)} (target {target}): {status}")


@dataclasses.dataclass(frozen=True)
class RatioTable:
    """The kernel benches' table: per row of key cells (threads x shape x rows), the base
    path's time and every path's ratio to it ("-": the path does not run there); with
    `gbps`, each time also as GB/s of the row's `nbytes` (weight bytes read)."""

    keys: tuple[tuple[str, int], ...]  # header and width of each key column
    paths: tuple[str, ...]
    base: str = "bf16"
    width: int = 8  # of a ratio column
    unit: str = "us"
    scale: float = 1e6  # seconds -> unit
    gbps: bool = False

    def header(self) -> str:
        return (" ".join(f"{h:>{w}}" for h, w in self.keys) + f" {self.base + ' ' + self.unit:>8}"
                + ("  GB/s" if self.gbps else "") + f"  ratio to {self.base}{' (GB/s)' if self.gbps else ''}: "
                + " ".join(f"{p:>{self.width}}" for p in self.paths))

    def row(self, key: Sequence[object], times: Mapping[str, float], base: str | None = None,
            fmt: str = "8.1f", nbytes: int = 0) -> str:
        """`times` in seconds; `base` names another path as the denominator (its key column)."""
        b = times[base or self.base]

        def cell(p: str) -> str:
            if p not in times:
                return f"{'-':>{self.width}}"
            got = f"{times[p] / b:.2f}" + (f" ({nbytes / times[p] / 1e9:.1f})" if self.gbps else "")
            return f"{got:>{self.width}}"

        keys = " ".join(f"{k!s:>{w}}" for k, (_, w) in zip(key, self.keys, strict=True))
        rate = f" {nbytes / b / 1e9:5.1f}" if self.gbps else ""
        return f"{keys} {b * self.scale:{fmt}}{rate}                {' '.join(cell(p) for p in self.paths)}"


def sweep(threads: Sequence[int], rows: Sequence[int],
          shapes: Sequence[tuple[int, int]]) -> Iterator[tuple[int, int, int, int]]:
    """(threads, rows, N, K) in the kernel tables' order, torch set to each thread count in turn."""
    import torch

    for t in threads:
        torch.set_num_threads(t)
        for m in rows:
            for n, k in shapes:
                yield t, m, n, k
