"""`pdserve up`: a gateway plus N prefill + M decode workers (or colocated workers)
as separate processes on this machine. Checks every argument and the model
before starting anything; prints the URL once ready, or exits non-zero at once
with the one-line reason of a process that failed to start. Ctrl-C or SIGTERM
stops the workers (they drain and deregister), then the gateway.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pdserve.cli.args import (
    UsageError,
    add_dtype_arg,
    add_gpu_args,
    add_kv_cache_dtype_arg,
    add_lm_head_quantization_arg,
    add_model_arg,
    add_quantization_arg,
    add_speculative_arg,
    byte_size_text,
    check_listen,
    check_max_model_len,
    check_model,
    check_parallel,
    check_speculative,
    device,
    host,
    model_dir,
    non_negative_float,
    non_negative_int,
    port,
    positive_float,
    positive_int,
)
from pdserve.cli.gateway import ROUTERS
from pdserve.cli.gateway_options import (
    api_keys,
    check_served_names,
    check_tool_flags,
    sampling_defaults,
)
from pdserve.cli.workers import check_tracing
from pdserve.worker.cpu_cores import format_cpu_list, plan_cores


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("up", help="start a gateway and workers on this machine")
    add_model_arg(ap, " (resolved once here; the children get the directory)")
    ap.add_argument("--host", type=host, default="127.0.0.1")
    ap.add_argument("--port", type=port, default=8000)
    ap.add_argument("--prefill", type=positive_int, default=1, help="prefill workers")
    ap.add_argument("--decode", type=positive_int, default=1, help="decode workers")
    ap.add_argument("--colocated", action="store_true", help="colocated workers instead of P/D")
    ap.add_argument("--workers", type=positive_int, default=1, help="colocated workers (with --colocated)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch threads per worker (default: cores split among workers)")
    ap.add_argument("--prefill-threads", type=positive_int, default=None,
                    help="torch threads per prefill worker (default: --threads)")
    ap.add_argument("--decode-threads", type=positive_int, default=None,
                    help="torch threads per decode worker (default: --threads)")
    ap.add_argument("--cpu-affinity", default="auto", choices=("auto", "on", "off"),
                    help="pin each worker's threads to cores of its own (auto: when the workers' "
                    "threads fit this host's cores, on CPU)")
    ap.add_argument("--thread-policy", default="auto", choices=("auto", "adaptive", "fixed"),
                    help="workers' torch thread count per step: adaptive follows CPU contention (1 "
                    "thread or all), fixed keeps --threads; auto: each worker's default (adaptive "
                    "on CPU with more than one thread or borrowed cores)")
    ap.add_argument("--no-core-borrowing", action="store_true",
                    help="with one pinned prefill and one decode worker, do not let the decode "
                    "worker use the prefill worker's cores while prefill is idle")
    ap.add_argument("--prefill-tp", type=positive_int, default=1,
                    help="tensor-parallel ranks per prefill worker")
    ap.add_argument("--decode-tp", type=positive_int, default=1,
                    help="tensor-parallel ranks per decode (or colocated) worker")
    ap.add_argument("--prefill-pp", type=positive_int, default=1, help="pipeline stages per prefill worker")
    ap.add_argument("--decode-pp", type=positive_int, default=1,
                    help="pipeline stages per decode (or colocated) worker")
    ap.add_argument("--device", type=device, default="cpu", help="cpu | cuda | cuda:N")
    add_dtype_arg(ap, "workers' weight and KV dtype, each resolved on its own host; ")
    add_kv_cache_dtype_arg(ap)
    add_quantization_arg(ap)
    add_lm_head_quantization_arg(ap)
    ap.add_argument("--kv-transport", default="auto", choices=("auto", "tcp", "shm"))
    ap.add_argument("--kv-cache-memory", type=byte_size_text, default=None,
                    help="per-worker KV pool bytes, e.g. 256MiB")
    ap.add_argument("--num-blocks", type=positive_int, default=None)
    ap.add_argument("--prefill-num-blocks", type=positive_int, default=None,
                    help="KV blocks of each prefill worker (default: --num-blocks)")
    add_gpu_args(ap, "0.9 / the number of workers on the device")
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=None, help="per-worker token budget per step")
    ap.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=None,
                    help="per-worker cap on one sequence's prefill tokens per step")
    ap.add_argument("--max-num-seqs", type=positive_int, default=None, help="per-worker running sequences")
    ap.add_argument("--max-model-len", type=positive_int, default=None,
                    help="longest prompt + output, for the gateway and every worker (default: the model's)")
    ap.add_argument("--block-size", type=positive_int, default=None, help="per-worker KV block size in tokens")
    ap.add_argument("--no-prefix-caching", action="store_true", help="disable the workers' prefix cache")
    add_speculative_arg(ap)  # decode and colocated workers
    ap.add_argument("--max-recoveries", type=non_negative_int, default=3)
    ap.add_argument("--stall-timeout", type=non_negative_float, default=30.0,
                    help="gateway: seconds a worker may hold work without an engine step (0: off)")
    ap.add_argument("--api-key", action="append", default=[], help="gateway: require this API key (repeatable)")
    ap.add_argument("--api-key-file", action="append", default=[], metavar="FILE",
                    help="gateway: file of API keys, one per line, '#' comments")
    ap.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                    help="gateway: model name(s) requests may use; the first is reported")
    ap.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                    help="gateway: sampling defaults from the model's generation_config.json (auto), "
                         "none (vllm) or a directory's")
    ap.add_argument("--enable-auto-tool-choice", action="store_true",
                    help='gateway: tool_choice "auto" (needs --tool-call-parser)')
    ap.add_argument("--tool-call-parser", choices=("hermes", "llama3_json"), default=None,
                    help="gateway: the model's tool-call format")
    ap.add_argument("--grammar-compile-timeout", type=positive_float, default=None, metavar="SECONDS",
                    help="workers: refuse a structured-output constraint not compiled in time (default 10)")
    ap.add_argument("--router", choices=ROUTERS, default="kv-aware", help="gateway: how a prompt's worker is picked")
    ap.add_argument("--local-prefill-threshold", type=non_negative_int, default=0, metavar="TOKENS",
                    help="gateway: prefill on the decode worker when at most this many prompt tokens are uncached")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="gateway and workers: export OpenTelemetry spans to this OTLP collector "
                         "(the OTEL_* variables pass to every process)")
    ap.add_argument("--ready-timeout", type=positive_float, default=120.0)
    ap.set_defaults(func=run)


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve"]


def _roles(args: argparse.Namespace) -> list[str]:
    return ["worker"] * args.workers if args.colocated else ["prefill"] * args.prefill + ["decode"] * args.decode


def _thread_counts(args: argparse.Namespace) -> list[int]:
    roles = _roles(args)
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // max(len(roles), 1))
    per_role = {"prefill": args.prefill_threads, "decode": args.decode_threads}
    return [per_role.get(role) or threads for role in roles]


def _worker_cmds(args: argparse.Namespace, control: str,
                 share_file: str | None = None) -> list[list[str]]:
    roles, counts = _roles(args), _thread_counts(args)
    cores = core_flags(args, roles, counts, share_file)
    # Threads that fit the cores may spin between parallel regions (see workers.py).
    ranks = [_parallel(args, role)[0] * _parallel(args, role)[1] for role in roles]
    spin = sum(n * r for n, r in zip(counts, ranks, strict=True)) <= len(os.sched_getaffinity(0))
    cmds = []
    for role, n, pin in zip(roles, counts, cores, strict=True):
        cmd = [*_pdserve(), role, "--gateway", control, "--threads", str(n), "--device", args.device,
               "--dtype", args.dtype, "--quantization", args.quantization,
               "--lm-head-quantization", args.lm_head_quantization, *pin]
        cmd += ["--kv-cache-dtype", args.kv_cache_dtype] if args.kv_cache_dtype != "auto" else []
        cmd += ["--colocated"] if role == "worker" else ["--kv-transport", args.kv_transport]
        tp, pp = _parallel(args, role)
        cmd += ["--tensor-parallel-size", str(tp)] if tp > 1 else []
        cmd += ["--pipeline-parallel-size", str(pp)] if pp > 1 else []
        cmd += ["--spin-wait"] if spin else []
        cmd += ["--thread-policy", args.thread_policy] if args.thread_policy != "auto" else []
        if args.model:
            cmd += ["--model", args.model]
        if args.kv_cache_memory:
            cmd += ["--kv-cache-memory", args.kv_cache_memory]
        blocks = (args.prefill_num_blocks if role == "prefill" else None) or args.num_blocks
        if blocks:
            cmd += ["--num-blocks", str(blocks)]
        cmd += gpu_flags(args, len(roles))
        if args.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
        if args.long_prefill_token_threshold:
            cmd += ["--long-prefill-token-threshold", str(args.long_prefill_token_threshold)]
        if args.max_num_seqs:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if args.max_model_len:
            cmd += ["--max-model-len", str(args.max_model_len)]
        if args.block_size:
            cmd += ["--block-size", str(args.block_size)]
        if args.no_prefix_caching:
            cmd += ["--no-prefix-caching"]
        if args.grammar_compile_timeout:
            cmd += ["--grammar-compile-timeout", str(args.grammar_compile_timeout)]
        if args.otlp_traces_endpoint:
            cmd += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
        spec = args.speculative_config
        if spec is not None and (role != "prefill" or spec.ships_draft_kv):
            cmd += ["--speculative-config", spec.to_json()]
        cmds.append(cmd)
    return cmds


def gpu_flags(args: argparse.Namespace, num_workers: int) -> list[str]:
    """A CUDA worker's memory share (all of `up`'s workers sit on --device) and graphs flag."""
    backend = [] if args.attention_backend == "auto" else ["--attention-backend", args.attention_backend]
    if not args.device.startswith("cuda"):
        if args.cuda_graphs or args.gpu_memory_utilization is not None:
            flag = "--cuda-graphs" if args.cuda_graphs else "--gpu-memory-utilization"
            raise UsageError(flag, f"applies to a CUDA --device, not {args.device}")
        if args.attention_backend in ("triton", "flashinfer"):
            raise UsageError("--attention-backend", f"{args.attention_backend} needs a CUDA --device, "
                             f"not {args.device}")
        return backend
    from pdserve.engine.runner.memory_budget import default_gpu_memory_utilization

    share = args.gpu_memory_utilization or default_gpu_memory_utilization(num_workers)
    flags = ["--gpu-memory-utilization", f"{share:.6g}"]
    if args.cuda_graphs is not None:
        flags.append("--cuda-graphs" if args.cuda_graphs else "--no-cuda-graphs")
    return flags + backend


def core_plan(args: argparse.Namespace) -> list[tuple[int, ...]] | None:
    """Each worker's cores under --cpu-affinity, or None when workers run unpinned."""
    if args.cpu_affinity == "off" or args.device != "cpu":
        return None
    plan = plan_cores(sorted(os.sched_getaffinity(0)), _thread_counts(args))
    if plan is None and args.cpu_affinity == "on":
        raise UsageError("--cpu-affinity", f"the workers' {sum(_thread_counts(args))} threads do not "
                         f"fit this host's {len(os.sched_getaffinity(0))} cores")
    return plan


def borrows_cores(args: argparse.Namespace) -> bool:
    """One pinned prefill and one decode worker: the decode worker may borrow."""
    return (not args.colocated and args.prefill == 1 and args.decode == 1
            and not args.no_core_borrowing and core_plan(args) is not None)


def core_flags(args: argparse.Namespace, roles: list[str], counts: list[int],
               share_file: str | None) -> list[list[str]]:
    """Each worker's --cpu-cores (and core-sharing) flags."""
    plan = core_plan(args)
    if plan is None:
        return [[] for _ in roles]
    flags = [["--cpu-cores", format_cpu_list(c)] for c in plan]
    if share_file is not None:
        flags[0] += ["--core-share", share_file]
        flags[1] += ["--core-share", share_file, "--borrow-cores", format_cpu_list(plan[0])]
    return flags


def _parallel(args: argparse.Namespace, role: str) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of one worker of `role`."""
    return (args.prefill_tp, args.prefill_pp) if role == "prefill" else (args.decode_tp, args.decode_pp)


def _gateway_cmd(args: argparse.Namespace, control_port: int) -> list[str]:
    cmd = [*_pdserve(), "gateway", "--host", args.host, "--port", str(args.port),
           "--control-port", str(control_port), "--max-recoveries", str(args.max_recoveries),
           "--stall-timeout", str(args.stall_timeout), "--router", args.router,
           "--local-prefill-threshold", str(args.local_prefill_threshold)]
    if args.model:
        cmd += ["--model", str(Path(args.model))]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    names = args.served_model_name or ([args.repo_id] if getattr(args, "repo_id", None) else [])
    if names:  # a repo id is served by its name, not by its snapshot directory's
        cmd += ["--served-model-name", *names]
    mode = args.generation_config
    cmd += ["--generation-config", mode if mode in ("auto", "vllm") else str(Path(mode).resolve())]
    if args.enable_auto_tool_choice:
        cmd += ["--enable-auto-tool-choice"]
    if args.tool_call_parser:
        cmd += ["--tool-call-parser", args.tool_call_parser]
    if args.otlp_traces_endpoint:
        cmd += ["--otlp-traces-endpoint", args.otlp_traces_endpoint]
    for key in args.api_key:
        cmd += ["--api-key", key]
    for path in args.api_key_file:
        cmd += ["--api-key-file", str(Path(path).resolve())]
    return cmd


def _role_names(args: argparse.Namespace) -> list[str]:
    if args.colocated:
        return [f"colocated worker {i + 1}" for i in range(args.workers)]
    return [f"prefill worker {i + 1}" for i in range(args.prefill)] + [
        f"decode worker {i + 1}" for i in range(args.decode)]


def check_args(args: argparse.Namespace) -> None:
    """Everything a child would otherwise fail on, refused before any child starts."""
    check_tracing(args.otlp_traces_endpoint)  # the OTEL_* variables every child reads
    check_tool_flags(args)
    config = check_model(args.model)
    check_max_model_len(args.max_model_len, config)
    check_parallel("--prefill-tp", args.prefill_tp, args.prefill_pp, args.device, config)
    check_parallel("--decode-tp", args.decode_tp, args.decode_pp, args.device, config)
    check_served_names(args.served_model_name)
    check_speculative(args.speculative_config)
    sampling_defaults(args.generation_config, model_dir(args.model))
    api_keys(args)  # every --api-key-file readable and not empty
    check_listen("--port", args.host, args.port)
    core_plan(args)  # --cpu-affinity on: the threads must fit
    gpu_flags(args, 1)  # the GPU flags need a CUDA --device


def run(args: argparse.Namespace) -> int:
    from pdserve.cli import supervise
    from pdserve.common.transport import free_port

    check_args(args)
    control_port = free_port()
    control = f"tcp://127.0.0.1:{control_port}"
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    share_file = new_share_file() if borrows_cores(args) else None
    gateway = supervise.Child.start("gateway", _gateway_cmd(args, control_port), stdout=subprocess.DEVNULL)
    workers = [supervise.Child.start(name, cmd) for name, cmd in
               zip(_role_names(args), _worker_cmds(args, control, share_file), strict=True)]
    children = [gateway, *workers]
    url = f"http://{args.host}:{args.port}"
    try:
        started = supervise.wait_ready(url, children, args.ready_timeout, lambda: stop["now"])
        if not started.ready:
            if not any(c.exited() for c in children):
                for c in children:  # a slow start, or a stop: show what the children said
                    c.forward()
            print(f"pdserve up: {started.reason}", file=sys.stderr)
            return 0 if started.stopped else 1  # SIGTERM/Ctrl-C during start-up is a clean stop
        for c in children:
            c.forward()
        print(f"pdserve ready at {url}/v1", flush=True)
        while not stop["now"]:
            failed = next((c for c in children if c.exited()), None)
            if failed is not None:
                print(f"pdserve up: {failed.exit_reason()}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.2)
        return 0
    finally:
        supervise.stop(workers)
        supervise.stop([gateway])
        if share_file is not None:
            os.unlink(share_file)


def new_share_file() -> str:
    """The core-sharing file of this `up` (its pid and a random suffix in the name)."""
    import tempfile

    from pdserve.worker.core_sharing import create_share_file

    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix=f"pdserve-cores-{os.getpid()}-", dir=shm)
    os.close(fd)
    create_share_file(path)
    return path
