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
    byte_size,
    check_listen,
    check_max_model_len,
    check_model,
    check_parallel,
    check_speculative,
    model_dir,
)
from pdserve.cli.curve_options import (
    add_insecure_arg,
    check_kv_events_exposure,
    check_worker_exposure,
)
from pdserve.cli.kv_tier_args import tier_config
from pdserve.cli.lora_args import check_lora_args, worker_lora_config
from pdserve.cli.worker_args import WorkerArgs, default_threads
from pdserve.common import envs
from pdserve.common.logs import configure_logging
from pdserve.common.roles import FLIP_ROLES, Role
from pdserve.worker.cpu_cores import format_cpu_list, pin_at_start

if TYPE_CHECKING:
    from kv_transfer.auth import KVCurve

ROLE_COMMANDS = {"prefill": Role.PREFILL, "decode": Role.DECODE, "worker": Role.COLOCATED}


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    for command, role in ROLE_COMMANDS.items():
        ap = sub.add_parser(command, help=f"run a {role} worker")
        WorkerArgs.add_to(ap)
        add_insecure_arg(ap)
        if command == "worker":
            ap.add_argument("--colocated", action="store_true", required=True,
                            help="prefill and decode in one process")
        ap.set_defaults(func=run, role=role)


def check_args(args: argparse.Namespace) -> None:
    """What parsing alone cannot see: the model, the ports, flags that go together."""
    if bool(args.curve_key) != bool(args.curve_server_key):
        flag = "--curve-server-key" if args.curve_key else "--curve-key"
        raise UsageError(flag, "--curve-key and --curve-server-key go together")
    check_worker_exposure(args)
    check_kv_events_exposure(args)
    config = check_model(args.model, tokenizer=False)
    check_max_model_len(args.max_model_len, config)
    check_lora_args(args)
    check_speculative(getattr(args, "speculative_config", None))
    flag = "--pipeline-parallel-size" if args.pipeline_parallel_size > 1 else "--tensor-parallel-size"
    check_parallel(flag, args.tensor_parallel_size, args.pipeline_parallel_size, args.device, config)
    if args.metrics_port:
        check_listen("--metrics-port", args.metrics_host, args.metrics_port)
    if args.kv_port and args.role == Role.DECODE:
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
    if args.core_share and args.role == Role.COLOCATED:
        raise UsageError("--core-share", "is for a prefill and a decode worker")
    if args.core_share:
        from pdserve.worker.core_sharing import SHARING_ROLES, share_path

        missing = [share_path(args.core_share, r) for r in SHARING_ROLES
                   if not os.path.isfile(share_path(args.core_share, r))]
        if missing:
            raise UsageError("--core-share", f"not a core-sharing directory (no {missing[0]})")
    if args.borrow_cores and (not args.core_share or not args.cpu_cores):
        raise UsageError("--borrow-cores", "needs --core-share and --cpu-cores")
    allowed = os.sched_getaffinity(0)
    for flag, cores in (("--cpu-cores", args.cpu_cores), ("--borrow-cores", args.borrow_cores)):
        if cores and not set(cores) <= allowed:
            raise UsageError(flag, f"cores {format_cpu_list(sorted(set(cores) - allowed))} are not "
                             f"among this process's cores ({format_cpu_list(sorted(allowed))})")


BORROWER_SPIN_COUNT = 20_000  # libgomp spin rounds of a core-borrowing worker (~0.4 ms on Zen 5)


def openmp_waits(spin_wait: bool, borrows: bool) -> dict[str, str]:
    """How the worker's OpenMP threads wait between parallel regions (set before torch
    loads, where the environment does not say): passively unless `spin_wait`; a worker
    that borrows cores spins only briefly. A borrowed team's idle thread, narrowed back
    onto its own worker's cores, would otherwise spin for libgomp's default 300,000
    rounds (~6 ms on Zen): into the other worker's next step, whose widened team then
    waits for it at every region. A short spin still bridges one step's regions."""
    if not spin_wait:
        return {"OMP_WAIT_POLICY": "PASSIVE"}
    return {"GOMP_SPINCOUNT": str(BORROWER_SPIN_COUNT)} if borrows else {}


def run(args: argparse.Namespace) -> int:
    configure_logging(envs.log_level())
    # Workers may share a host with the gateway and each other: OpenMP threads that
    # spin-wait steal the cores the other processes need (a 2-thread decode step went
    # from 3 ms to 74 ms under contention). But passive waiting costs every parallel
    # region a futex wake-up (~20% of a decode step on dedicated cores), so `pdserve up`
    # passes --spin-wait when the workers' threads fit the cores. Set before torch loads.
    for name, value in openmp_waits(args.spin_wait, bool(args.borrow_cores)).items():
        os.environ.setdefault(name, value)
    check_args(args)
    if args.cpu_cores:  # before torch starts its threads: they inherit the mask
        pin_at_start(args.cpu_cores, args.borrow_cores or ())
    kv_curve = kv_curve_option(args)
    w = WorkerArgs.from_namespace(args)
    kv_offload = tier_config(args)
    from pdserve.engine.core.config import CacheConfig, EngineConfig, SchedulerConfig
    from pdserve.engine.loading.dtype import model_dtype
    from pdserve.engine.runner.memory_budget import DEFAULT_GPU_MEMORY_UTILIZATION

    model = model_dir(w.model)
    try:
        engine_cfg = EngineConfig(
            model_dir=str(model),
            dtype=model_dtype(w.dtype, model, w.device),  # `auto`: what this host serves in
            device=w.device,
            grammar_compile_timeout_s=w.grammar_compile_timeout,
            quantization=w.quantization,
            lm_head_quantization=w.lm_head_quantization,
            num_threads=w.threads or (len(w.cpu_cores) if w.cpu_cores else default_threads(w.local_workers)),
            kv_cache_dtype=w.kv_cache_dtype,
            tensor_parallel_size=w.tensor_parallel_size,
            pipeline_parallel_size=w.pipeline_parallel_size,
            cache=CacheConfig(
                block_size=w.block_size,
                kv_cache_memory=byte_size(w.kv_cache_memory) if w.kv_cache_memory else None,
                gpu_memory_utilization=w.gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
                num_blocks=w.num_blocks,
                enable_prefix_caching=not w.no_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=w.max_num_seqs,
                max_num_batched_tokens=w.max_num_batched_tokens,
                long_prefill_token_threshold=w.long_prefill_token_threshold,
                max_model_len=w.max_model_len,
                reserve_decode_tokens=w.reserve_decode_tokens,
                watermark=w.kv_watermark,
            ),
            speculative=w.speculative_config,
            cuda_graphs=w.cuda_graphs,
            attention_backend=w.attention_backend,
            lora=worker_lora_config(args),
        )
    except ValueError as e:
        raise SystemExit(f"pdserve {args.role}: {e}") from None
    logging.getLogger(__name__).info("serving in %s (--dtype %s, KV cache %s, device %s, --quantization %s)",
                                     engine_cfg.dtype, w.dtype, w.kv_cache_dtype, w.device, w.quantization)
    from pdserve.common.transport import CurveClient
    from pdserve.worker.main import WorkerOptions, run_worker

    curve = CurveClient(w.curve_key, w.curve_server_key) if w.curve_key and w.curve_server_key else None

    opts = WorkerOptions(
        role=args.role,
        gateways=w.gateway,
        worker_id=w.worker_id,
        metrics_host=w.metrics_host,
        metrics_port=w.metrics_port,
        heartbeat_s=w.heartbeat,
        kv_host=w.kv_host,
        kv_port=w.kv_port,
        kv_transport=w.kv_transport,
        curve=curve,
        fault_injection=w.enable_fault_injection,
        kv_curve=kv_curve,
        core_share=w.core_share,
        cpu_cores=w.cpu_cores or (),
        borrow_cores=w.borrow_cores or (),
        thread_policy=str(args.thread_policy),  # resolved by check_args
        kv_offload=kv_offload,
        otlp_traces_endpoint=w.otlp_traces_endpoint,
        kv_events=w.kv_events_config,
    )
    # Prefill and decode workers can switch between the two live (gateway admin call).
    flips = {r: node_builder(r) for r in FLIP_ROLES} if args.role in FLIP_ROLES else None
    return run_worker(engine_cfg, opts, node_builder(args.role), flips)


def kv_curve_option(args: argparse.Namespace) -> KVCurve | None:
    """CURVE for the KV sockets: with --curve-key, prefill and decode workers need the
    authorized directory too (the KV plane authenticates both ends). Checked here, so a
    bad key file stops the worker before it loads a model."""
    from kv_transfer.auth import KVCurve, load_keys

    if args.curve_authorized_keys and not args.curve_key:
        raise UsageError("--curve-authorized-keys", "needs --curve-key")
    if not args.curve_key or args.role == Role.COLOCATED:
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


def node_builder(role: Role) -> Any:
    """The role's node builder: the CLI is the one place that knows every role."""
    if role == Role.PREFILL:
        from prefill_node.main import build_prefill

        return build_prefill
    if role == Role.DECODE:
        from decode_node.main import build_decode

        return build_decode
    from pdserve.worker.main import build_colocated

    return build_colocated
