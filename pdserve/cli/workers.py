"""`pdserve prefill`, `pdserve decode` and `pdserve worker --colocated`: worker processes.

Each parses its flags into an `EngineConfig` and a `RuntimeConfig`, builds its
node and hands it to the shared worker runtime. torch is imported only in `run`.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import TYPE_CHECKING, Any

from pdserve.cli.args import (
    UsageError,
    add_dtype_arg,
    add_gpu_args,
    add_kv_cache_dtype_arg,
    add_lm_head_quantization_arg,
    add_model_arg,
    add_quantization_arg,
    add_speculative_arg,
    byte_size,
    check_listen,
    check_max_model_len,
    check_model,
    check_parallel,
    check_speculative,
    device,
    fraction,
    host,
    model_dir,
    non_negative_int,
    port_or_zero,
    positive_float,
    positive_int,
)
from pdserve.common import envs
from pdserve.common.logs import configure_logging
from pdserve.worker.cpu_cores import format_cpu_list, parse_cpu_list, pin_process

if TYPE_CHECKING:
    from kv_transfer.auth import KVCurve

ROLE_COMMANDS = {"prefill": "prefill", "decode": "decode", "worker": "colocated"}


def gateway_address(text: str) -> str:
    from pdserve.worker.gateways import parse_gateway

    try:
        return parse_gateway(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def default_threads(local_workers: int = 1) -> int:
    return max(1, (os.cpu_count() or 1) // max(local_workers, 1))


def add_worker_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gateway", required=True, action="append", type=gateway_address,
                    help="gateway control address, tcp://HOST:PORT or dns+tcp://NAME:PORT (every A record, "
                    "re-resolved); repeat for several gateways")
    add_model_arg(ap)
    ap.add_argument("--device", default="cpu", type=device, help="cpu | cuda | cuda:N")
    add_dtype_arg(ap)
    add_kv_cache_dtype_arg(ap)
    add_quantization_arg(ap)
    add_lm_head_quantization_arg(ap)
    ap.add_argument("--spin-wait", action="store_true",
                    help="let OpenMP threads spin briefly between parallel regions (OpenMP's own "
                    "default): ~20%% faster steps when this worker's threads have their cores to "
                    "themselves, a collapse when other busy processes share them. Without it "
                    "the worker sets OMP_WAIT_POLICY=PASSIVE unless the environment sets it")
    ap.add_argument("--thread-policy", default=None, choices=("adaptive", "fixed"),
                    help="adaptive: each step runs with all torch threads spinning or with their "
                    "OpenMP waits throttled (1 thread without libgomp), whichever recent steps show "
                    "faster (one busy neighbour process makes spinning threads 10x slower; "
                    "docs/internals.md, Threads and cores); fixed: always --threads. "
                    "Default: adaptive on CPU with more than one thread (or borrowed cores), "
                    "fixed on CUDA and with tensor or pipeline parallelism")
    ap.add_argument("--kv-cache-memory", type=byte_size, default=None, help="KV pool bytes, e.g. 256MiB")
    add_gpu_args(ap, "0.9")
    ap.add_argument("--num-blocks", type=positive_int, default=None, help="explicit KV block count")
    ap.add_argument("--block-size", type=positive_int, default=16)
    ap.add_argument("--max-num-seqs", type=positive_int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)
    ap.add_argument("--long-prefill-token-threshold", type=non_negative_int, default=0,
                    help="cap on one sequence's prefill tokens per step, so short prompts "
                    "are not queued behind a long one (0: no cap)")
    ap.add_argument("--max-model-len", type=positive_int, default=None)
    ap.add_argument("--reserve-decode-tokens", type=non_negative_int, default=512,
                    help="decode admission: a reservation is granted only if every live stream keeps "
                    "room to grow by this many more tokens (capped by its max_tokens)")
    ap.add_argument("--kv-watermark", type=fraction, default=0.01,
                    help="decode admission: fraction of the KV pool also kept free")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--grammar-compile-timeout", type=positive_float, default=10.0, metavar="SECONDS",
                    help="structured outputs: a constraint not compiled in time is refused (400)")
    ap.add_argument("--threads", type=positive_int, default=None,
                    help="torch intra-op threads per rank (default: the cores split among --local-workers)")
    ap.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                    help="ranks of this worker's tensor-parallel group (CPU: gloo, one process per rank, "
                    "one registration); must divide the attention heads and intermediate size, and "
                    "divide or be a multiple of the KV heads")
    ap.add_argument("--pipeline-parallel-size", type=positive_int, default=1,
                    help="pipeline stages of this worker, one process each, layers split evenly "
                    "(one step at a time, no micro-batch overlap yet; not with --tensor-parallel-size)")
    ap.add_argument("--local-workers", type=positive_int, default=1, help="workers sharing this host")
    ap.add_argument("--cpu-cores", type=cpu_list, default=None, metavar="LIST",
                    help="pin the worker's threads to these cores, e.g. 0-3 (default: unpinned); "
                    "--threads then defaults to their count")
    ap.add_argument("--core-share", default=None, metavar="FILE",
                    help="prefill/decode: the file `pdserve up` made so the decode worker may "
                    "use the prefill worker's cores while it has no work")
    ap.add_argument("--borrow-cores", type=cpu_list, default=None, metavar="LIST",
                    help="decode, with --core-share and --cpu-cores: the prefill worker's cores")
    ap.add_argument("--metrics-host", type=host, default="127.0.0.1")
    ap.add_argument("--metrics-port", type=port_or_zero, default=0, help="worker /health and /metrics (0: free)")
    ap.add_argument("--heartbeat", type=positive_float, default=0.5, help="seconds between heartbeats")
    ap.add_argument("--worker-id", default=None)
    ap.add_argument("--kv-host", type=host, default="127.0.0.1", help="decode: address the KV receiver binds")
    ap.add_argument("--kv-port", type=port_or_zero, default=0, help="decode: KV receiver tcp port (0: ephemeral)")
    ap.add_argument("--kv-transport", default="auto", choices=("auto", "tcp", "shm"),
                    help="auto: shared memory (CPU) or CUDA IPC (GPU) with same-host peers, tcp "
                    "otherwise; tcp: always tcp (a GPU pool through pinned host staging)")
    ap.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                    help="OpenTelemetry: export this process's spans to this OTLP collector (vLLM's flag; "
                    "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, else no tracing); protocol, headers, "
                    "service name and sampler from the standard OTEL_* variables. Needs pdserve[otel]")
    ap.add_argument("--enable-fault-injection", action="store_true",
                    help="tests only: inject the faults PDSERVE_FAULTS and PDSERVE_KV_FAULTS ask for "
                    "(ignored without this flag); logs a WARNING")
    ap.add_argument("--curve-key", default=None, help="CURVE: this worker's secret certificate file")
    ap.add_argument("--curve-server-key", default=None, help="CURVE: the gateway's public certificate file")
    ap.add_argument("--curve-authorized-keys", default=None,
                    help="CURVE, prefill and decode: directory of the workers' public certificates "
                    "(the gateway's); KV sockets then use CURVE and accept only these peers")


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for command, role in ROLE_COMMANDS.items():
        ap = sub.add_parser(command, help=f"run a {role} worker")
        add_worker_args(ap)
        if command == "worker":
            ap.add_argument("--colocated", action="store_true", required=True,
                            help="prefill and decode in one process")
        add_speculative_arg(ap)  # a prefill worker uses only a draft_kv=prefill draft
        ap.set_defaults(func=run, role=role)


def check_args(args: argparse.Namespace) -> None:
    """What parsing alone cannot see: the model, the ports, flags that go together."""
    if bool(args.curve_key) != bool(args.curve_server_key):
        flag = "--curve-server-key" if args.curve_key else "--curve-key"
        raise UsageError(flag, "--curve-key and --curve-server-key go together")
    config = check_model(args.model, tokenizer=False)
    check_max_model_len(args.max_model_len, config)
    check_speculative(getattr(args, "speculative_config", None))
    flag = "--pipeline-parallel-size" if args.pipeline_parallel_size > 1 else "--tensor-parallel-size"
    check_parallel(flag, args.tensor_parallel_size, args.pipeline_parallel_size, args.device, config)
    if args.metrics_port:
        check_listen("--metrics-port", args.metrics_host, args.metrics_port)
    if args.kv_port and args.role == "decode":
        check_listen("--kv-port", args.kv_host, args.kv_port)
    check_core_args(args)
    check_gpu_args(args)
    check_tracing(args.otlp_traces_endpoint)
    args.thread_policy = thread_policy(args)


def check_tracing(endpoint: str | None) -> None:
    """Bad OTEL_* variables stop the process before it loads a model."""
    from pdserve.common.tracing import TracingConfig

    try:
        TracingConfig.resolve(endpoint)
    except ValueError as e:
        raise UsageError("--otlp-traces-endpoint", str(e)) from None


def thread_policy(args: argparse.Namespace) -> str:
    """--thread-policy as given, or its default; adaptive only where one process's torch
    threads are the worker's whole compute (CPU, no parallel ranks)."""
    parallel = args.tensor_parallel_size > 1 or args.pipeline_parallel_size > 1
    if args.thread_policy == "adaptive" and (args.device != "cpu" or parallel):
        why = f"is for a CPU worker, not {args.device}" if args.device != "cpu" else \
            "does not apply to tensor or pipeline parallel ranks (their threads must match)"
        raise UsageError("--thread-policy", f"adaptive {why}")
    if args.thread_policy:
        return str(args.thread_policy)
    threads = args.threads or (len(args.cpu_cores) if args.cpu_cores else default_threads(args.local_workers))
    widens = bool(args.borrow_cores)
    return "adaptive" if args.device == "cpu" and not parallel and (threads > 1 or widens) else "fixed"


def check_gpu_args(args: argparse.Namespace) -> None:
    from pdserve.engine.attention.backend_choice import installed, refusal

    choice = args.attention_backend
    why = refusal(choice, "cuda" if args.device.startswith("cuda") else args.device,
                  args.kv_cache_dtype != "auto", choice in ("auto", "torch") or installed(choice))
    if why is not None:
        raise UsageError("--attention-backend", why)
    if args.device.startswith("cuda"):
        return
    if args.cuda_graphs:
        raise UsageError("--cuda-graphs", f"needs a CUDA --device, not {args.device}")
    if args.gpu_memory_utilization is not None:
        raise UsageError("--gpu-memory-utilization", f"applies to a CUDA --device, not {args.device}; "
                         "size a CPU pool with --kv-cache-memory")


def check_core_args(args: argparse.Namespace) -> None:
    if args.core_share and args.role == "colocated":
        raise UsageError("--core-share", "is for a prefill and a decode worker")
    if args.core_share and not os.path.isfile(args.core_share):
        raise UsageError("--core-share", f"no such file: {args.core_share}")
    if args.borrow_cores and (args.role != "decode" or not args.core_share or not args.cpu_cores):
        raise UsageError("--borrow-cores", "needs a decode worker with --core-share and --cpu-cores")
    if args.core_share and args.role == "decode" and not args.borrow_cores:
        raise UsageError("--core-share", "a decode worker needs --borrow-cores and --cpu-cores too")
    allowed = os.sched_getaffinity(0)
    for flag, cores in (("--cpu-cores", args.cpu_cores), ("--borrow-cores", args.borrow_cores)):
        if cores and not set(cores) <= allowed:
            raise UsageError(flag, f"cores {format_cpu_list(sorted(set(cores) - allowed))} are not "
                             f"among this process's cores ({format_cpu_list(sorted(allowed))})")


def run(args: argparse.Namespace) -> int:
    configure_logging(envs.log_level())
    # Workers may share a host with the gateway and each other: OpenMP threads that
    # spin-wait steal the cores the other processes need (a 2-thread decode step went
    # from 3 ms to 74 ms under contention). But passive waiting costs every parallel
    # region a futex wake-up (~20% of a decode step on dedicated cores), so `pdserve up`
    # passes --spin-wait when the workers' threads fit the cores. Set before torch loads.
    if not args.spin_wait:
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    check_args(args)
    if args.cpu_cores:  # before torch starts its threads: they inherit the mask
        pin_process(args.cpu_cores)
    kv_curve = kv_curve_option(args)
    from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.loading.dtype import model_dtype
    from pdserve.engine.runner.memory_budget import DEFAULT_GPU_MEMORY_UTILIZATION

    model = model_dir(args.model)
    try:
        engine_cfg = EngineConfig(
            model_dir=str(model),
            dtype=model_dtype(args.dtype, model, args.device),  # `auto`: what this host serves in
            device=args.device,
            grammar_compile_timeout_s=args.grammar_compile_timeout,
            quantization=args.quantization,
            lm_head_quantization=args.lm_head_quantization,
            num_threads=args.threads or (len(args.cpu_cores) if args.cpu_cores
                                         else default_threads(args.local_workers)),
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            pipeline_parallel_size=args.pipeline_parallel_size,
            cache=CacheConfig(
                block_size=args.block_size,
                kv_cache_memory=args.kv_cache_memory,
                gpu_memory_utilization=args.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
                num_blocks=args.num_blocks,
                enable_prefix_caching=not args.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
                long_prefill_token_threshold=args.long_prefill_token_threshold,
                max_model_len=args.max_model_len,
                reserve_decode_tokens=args.reserve_decode_tokens,
                watermark=args.kv_watermark,
            ),
            speculative=getattr(args, "speculative_config", None),
            cuda_graphs=args.cuda_graphs,
            attention_backend=args.attention_backend,
        )
    except ValueError as e:
        raise SystemExit(f"pdserve {args.role}: {e}") from None
    logging.getLogger(__name__).info("serving in %s (--dtype %s, KV cache %s, device %s, --quantization %s)",
                                     engine_cfg.dtype, args.dtype, args.kv_cache_dtype, args.device,
                                     args.quantization)
    from pdserve.common.transport import CurveClient
    from pdserve.worker.main import WorkerOptions, run_worker

    curve = CurveClient(args.curve_key, args.curve_server_key) if args.curve_key else None

    opts = WorkerOptions(
        role=args.role,
        gateways=tuple(args.gateway),
        worker_id=args.worker_id,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        heartbeat_s=args.heartbeat,
        kv_host=args.kv_host,
        kv_port=args.kv_port,
        kv_transport=args.kv_transport,
        curve=curve,
        fault_injection=args.enable_fault_injection,
        kv_curve=kv_curve,
        core_share=args.core_share,
        cpu_cores=tuple(args.cpu_cores or ()),
        borrow_cores=tuple(args.borrow_cores or ()),
        thread_policy=args.thread_policy,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
    )
    # Prefill and decode workers can switch between the two live (gateway admin call).
    flips = {r: node_builder(r) for r in ("prefill", "decode")} if args.role != "colocated" else None
    return run_worker(engine_cfg, opts, node_builder(args.role), flips)


def kv_curve_option(args: argparse.Namespace) -> KVCurve | None:
    """CURVE for the KV sockets: with --curve-key, prefill and decode workers need the
    authorized directory too (the KV plane authenticates both ends). Checked here, so a
    bad key file stops the worker before it loads a model."""
    from kv_transfer.auth import KVCurve, load_keys

    if args.curve_authorized_keys and not args.curve_key:
        raise UsageError("--curve-authorized-keys", "needs --curve-key")
    if not args.curve_key or args.role == "colocated":
        return None
    if not args.curve_authorized_keys:
        raise UsageError("--curve-key", f"a {args.role} worker with --curve-key needs "
                         "--curve-authorized-keys (the workers' public certificates: its KV peers)")
    kv_curve = KVCurve(args.curve_key, args.curve_authorized_keys)
    try:
        load_keys(kv_curve)
    except ValueError as e:
        flag = "--curve-authorized-keys" if "authorized" in str(e) else "--curve-key"
        raise UsageError(flag, str(e)) from None
    return kv_curve


def node_builder(role: str) -> Any:
    """The role's node builder: the CLI is the one place that knows every role."""
    if role == "prefill":
        from prefill_node.main import build_prefill

        return build_prefill
    if role == "decode":
        from decode_node.main import build_decode

        return build_decode
    from pdserve.worker.main import build_colocated

    return build_colocated
