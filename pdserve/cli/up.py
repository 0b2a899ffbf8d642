"""`pdserve up`: a gateway plus N prefill + M decode workers (or colocated workers)
as separate processes on this machine. Checks every argument and the model
before starting anything; prints the URL once ready, or exits non-zero at once
with the one-line reason of a process that failed to start. Once it is ready, a
worker that exits (a crash, a kill -9) is started again with the same command line,
at most 3 times a minute each (then `up` stops), while the gateway recovers its
streams on the workers left; the gateway exiting stops `up`. Ctrl-C or SIGTERM stops
the workers (they drain and deregister), then the gateway.

Every `up` makes fresh CURVE key pairs for its processes (pdserve/cli/cluster_keys.py,
a private directory removed when it stops), so its control plane and KV plane admit
no peer but its own workers. Secrets never go on a child's command line (which
every user of the host can read): the key pairs by path, `--api-key`s by the
gateway's environment (`PDSERVE_API_KEYS`, readable by this user only).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.cli import supervise
from pdserve.cli.args import (
    UsageError,
    add_model_arg,
    check_listen,
    check_max_model_len,
    check_model,
    check_parallel,
    check_speculative,
    model_dir,
    port,
    positive_float,
    positive_int,
)
from pdserve.cli.gateway_args import GatewayArgs
from pdserve.cli.gateway_options import (
    api_keys,
    check_served_names,
    check_tool_flags,
    sampling_defaults,
)
from pdserve.cli.lora_args import check_lora_args
from pdserve.cli.worker_args import WorkerArgs
from pdserve.common import envs
from pdserve.common.roles import Role
from pdserve.worker.cpu_cores import plan_cores

if TYPE_CHECKING:
    from pdserve.cli.cluster_keys import ClusterKeys
from pdserve.cli.workers import check_tracing


def register(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    ap = sub.add_parser("up", help="start a gateway and workers on this machine")
    add_model_arg(ap, " (resolved once here; the children get the directory)")
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
                    help="with one pinned prefill and one decode worker, do not let either run "
                    "on the other's cores while the other has nothing to compute")
    ap.add_argument("--prefill-tp", type=positive_int, default=1,
                    help="tensor-parallel ranks per prefill worker")
    ap.add_argument("--decode-tp", type=positive_int, default=1,
                    help="tensor-parallel ranks per decode (or colocated) worker")
    ap.add_argument("--prefill-pp", type=positive_int, default=1, help="pipeline stages per prefill worker")
    ap.add_argument("--decode-pp", type=positive_int, default=1,
                    help="pipeline stages per decode (or colocated) worker")
    ap.add_argument("--prefill-num-blocks", type=positive_int, default=None,
                    help="KV blocks of each prefill worker (default: --num-blocks)")
    WorkerArgs.add_to(ap, up=True)  # every worker flag `up` offers, passed on to each worker
    # and every gateway flag it offers; one both take (--max-model-len) is registered once
    GatewayArgs.add_to(ap, up=True, skip=frozenset(f.name for f in WorkerArgs.flags(up=True)))
    ap.add_argument("--ready-timeout", type=positive_float, default=120.0)
    ap.set_defaults(func=run)


def _pdserve() -> list[str]:
    return [sys.executable, "-m", "pdserve"]


def _roles(args: argparse.Namespace) -> list[Role]:
    return [Role.COLOCATED] * args.workers if args.colocated else [Role.PREFILL] * args.prefill + [Role.DECODE] * args.decode


def _thread_counts(args: argparse.Namespace) -> list[int]:
    roles = _roles(args)
    threads = args.threads or max(1, len(os.sched_getaffinity(0)) // max(len(roles), 1))
    per_role = {Role.PREFILL: args.prefill_threads, Role.DECODE: args.decode_threads}
    return [per_role.get(role) or threads for role in roles]


def _worker_cmds(args: argparse.Namespace, control: str,
                 share_dir: str | None = None) -> list[list[str]]:
    """Each worker's command line: the flags `up` passes on, and what it sets per worker."""
    roles, counts = _roles(args), _thread_counts(args)
    # Threads that fit the cores may spin between parallel regions (see workers.py).
    ranks = [_parallel(args, role)[0] * _parallel(args, role)[1] for role in roles]
    spin = sum(n * r for n, r in zip(counts, ranks, strict=True)) <= len(os.sched_getaffinity(0))
    base = WorkerArgs.from_namespace(
        args, up=True, gateway=(control,), model=None if args.model is None else str(args.model), spin_wait=spin,
        thread_policy=None if args.thread_policy == "auto" else args.thread_policy, **gpu_settings(args, len(roles)))
    spec = args.speculative_config
    cmds = []
    events = base.kv_events_config
    for i, (role, n, cores) in enumerate(zip(roles, counts, core_settings(args, roles, share_dir), strict=True)):
        tp, pp = _parallel(args, role)
        child = replace(base, threads=n, tensor_parallel_size=tp, pipeline_parallel_size=pp, **cores,
                        kv_events_config=events.for_worker(i) if events is not None else None,
                        num_blocks=(args.prefill_num_blocks if role == Role.PREFILL else None) or args.num_blocks,
                        speculative_config=None if role == Role.PREFILL and spec and not spec.ships_draft_kv else spec)
        command = ["worker", "--colocated"] if role == Role.COLOCATED else [role.value]
        cmds.append([*_pdserve(), *command, *child.to_argv(role)])
    return cmds


def gpu_settings(args: argparse.Namespace, num_workers: int) -> dict[str, float]:
    """A CUDA worker's memory share (all of `up`'s workers sit on --device); the GPU flags
    refused on a CPU --device."""
    if not args.device.startswith("cuda"):
        if args.cuda_graphs or args.gpu_memory_utilization is not None:
            flag = "--cuda-graphs" if args.cuda_graphs else "--gpu-memory-utilization"
            raise UsageError(flag, f"applies to a CUDA --device, not {args.device}")
        if args.attention_backend in ("triton", "flashinfer"):
            raise UsageError("--attention-backend", f"{args.attention_backend} needs a CUDA --device, "
                             f"not {args.device}")
        return {}
    from pdserve.engine.runner.memory_budget import default_gpu_memory_utilization

    share = args.gpu_memory_utilization or default_gpu_memory_utilization(num_workers)
    return {"gpu_memory_utilization": float(f"{share:.6g}")}


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
    """One pinned prefill and one decode worker: each may borrow the other's cores."""
    return (not args.colocated and args.prefill == 1 and args.decode == 1
            and not args.no_core_borrowing and core_plan(args) is not None)


def core_settings(args: argparse.Namespace, roles: list[Role],
                  share_dir: str | None) -> list[dict[str, Any]]:
    """Each worker's cores (and core-sharing directory), as `WorkerArgs` fields."""
    plan = core_plan(args)
    if plan is None:
        return [{} for _ in roles]
    settings: list[dict[str, Any]] = [{"cpu_cores": c} for c in plan]
    if share_dir is not None:  # one prefill, one decode worker: each borrows the other's
        settings[0].update(core_share=share_dir, borrow_cores=plan[1])
        settings[1].update(core_share=share_dir, borrow_cores=plan[0])
    return settings


def _parallel(args: argparse.Namespace, role: Role) -> tuple[int, int]:
    """(tensor, pipeline) parallel sizes of one worker of `role`."""
    return (args.prefill_tp, args.prefill_pp) if role == Role.PREFILL else (args.decode_tp, args.decode_pp)


def _gateway_cmd(args: argparse.Namespace, control_port: int) -> list[str]:
    """The gateway's command line: the flags `up` passes on, with paths made absolute."""
    names = args.served_model_name or ([args.repo_id] if getattr(args, "repo_id", None) else None)
    mode = args.generation_config  # a repo id is served by its name, not by its snapshot directory's
    gateway = GatewayArgs.from_namespace(
        args, up=True, port=args.port, control_port=control_port, model=args.model and str(Path(args.model)),
        served_model_name=names and tuple(names), api_key=(),  # by the environment: `gateway_env`
        api_key_file=tuple(str(Path(f).resolve()) for f in args.api_key_file),
        generation_config=mode if mode in ("auto", "vllm") else str(Path(mode).resolve()),
        lora_modules=tuple((n, str(Path(p).resolve())) for n, p in args.lora_modules),
        lora_dir=args.lora_dir and str(Path(args.lora_dir).resolve()))
    return [*_pdserve(), "gateway", *gateway.to_argv()]


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    """The gateway child's environment: ours, with every `--api-key` added to
    PDSERVE_API_KEYS (after the ones already there), never on its command line."""
    env = dict(os.environ)
    if args.api_key:
        env["PDSERVE_API_KEYS"] = ",".join(dict.fromkeys([*envs.api_keys(), *args.api_key]))
    return env


def check_api_keys(args: argparse.Namespace) -> None:
    """Every --api-key-file readable and not empty; no --api-key the environment cannot carry."""
    api_keys(args)
    if any("," in k or k != k.strip() for k in args.api_key):
        raise UsageError("--api-key", "a key with a comma or surrounding blanks cannot be passed on; "
                                      "use --api-key-file")
    if args.api_key:
        print("pdserve up: --api-key is visible in this process's command line to every user of the host; "
              "prefer --api-key-file or PDSERVE_API_KEYS (the gateway gets it by its environment)", file=sys.stderr)


def _role_names(args: argparse.Namespace) -> list[str]:
    roles = _roles(args)
    return [f"{role} worker {roles[:i].count(role) + 1}" for i, role in enumerate(roles)]


def check_args(args: argparse.Namespace) -> None:
    """Everything a child would otherwise fail on, refused before any child starts."""
    check_tracing(args.otlp_traces_endpoint)  # the OTEL_* variables every child reads
    check_tool_flags(args)
    check_lora_args(args)
    config = check_model(args.model)
    check_max_model_len(args.max_model_len, config)
    check_parallel("--prefill-tp", args.prefill_tp, args.prefill_pp, args.device, config)
    check_parallel("--decode-tp", args.decode_tp, args.decode_pp, args.device, config)
    check_served_names(args.served_model_name)
    check_speculative(args.speculative_config)
    events = args.kv_events_config
    if events is not None and events.exposed:
        raise UsageError("--kv-events-config", f"`pdserve up` publishes KV events on loopback or ipc only, not "
                         f"{events.exposed[0]}; start the workers by hand (with --insecure) for that")
    sampling_defaults(args.generation_config, model_dir(args.model))
    check_api_keys(args)
    check_listen("--port", args.host, args.port)
    core_plan(args)  # --cpu-affinity on: the threads must fit
    gpu_settings(args, 1)  # the GPU flags need a CUDA --device


def run(args: argparse.Namespace) -> int:
    from pdserve.cli import cluster_keys
    from pdserve.common.hosts import free_ports

    check_args(args)
    # Keys for this `up`'s own processes only: its control and KV planes refuse any
    # other peer. Their paths, never the keys, go on the children's command lines.
    keys = cluster_keys.create_private()
    try:
        # The gateway's --port is not bound yet: the OS could hand it out as the control port.
        return _run(args, keys, next(p for p in free_ports(2) if p != args.port))
    finally:
        cluster_keys.remove(keys)


def _run(args: argparse.Namespace, keys: ClusterKeys, control_port: int) -> int:
    control = f"tcp://127.0.0.1:{control_port}"
    stop = {"now": False}

    def on_signal(*_: object) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    share_dir = new_share_dir() if borrows_cores(args) else None
    gateway = supervise.Child.start("gateway", [*_gateway_cmd(args, control_port), *keys.gateway_flags()],
                                    stdout=subprocess.DEVNULL, env=gateway_env(args))
    names = _role_names(args)
    cmds = [[*cmd, *keys.worker_flags()] for cmd in _worker_cmds(args, control, share_dir)]
    workers = [supervise.Child.start(name, cmd) for name, cmd in zip(names, cmds, strict=True)]
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
        restarts = supervise.RestartBudget()
        while not stop["now"]:
            if gateway.exited():
                print(f"pdserve up: {gateway.exit_reason()}; stopping", file=sys.stderr)
                return 1
            for i, w in enumerate(workers):
                if w.exited() and not _restart(workers, i, cmds[i], restarts):
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        supervise.stop(workers)
        supervise.stop([gateway])
        if share_dir is not None:
            shutil.rmtree(share_dir, ignore_errors=True)


def _restart(workers: list[supervise.Child], i: int, cmd: list[str], restarts: supervise.RestartBudget) -> bool:
    """A worker that exited after the cluster was ready is started again with the same
    command line (the gateway re-routes its requests meanwhile); False, and `up` stops,
    once it has failed `RestartBudget.max_restarts` times within the budget's window.
    First the shared-memory KV pool and locks it left (killed, it could not unlink
    them) are removed, so that its pool's memory is free before the replacement's."""
    from kv_transfer.pool.shm import remove_segments_of

    old = workers[i]
    remove_segments_of(old.proc.pid)
    reason = old.exit_reason()
    if not restarts.allow(old.name):
        print(f"pdserve up: {reason}; it exited {restarts.max_restarts + 1} times within "
              f"{restarts.window_s:g} s, stopping", file=sys.stderr)
        return False
    print(f"pdserve up: {reason}; restarting it", file=sys.stderr)
    workers[i] = supervise.Child.start(old.name, cmd)
    workers[i].forward()
    return True


def new_share_dir(parent: str | None = None) -> str:
    """The core-sharing directory of this `up` (its pid and a random suffix in the name), in
    `parent` (default: /dev/shm where there is one, else the temporary directory)."""
    import tempfile

    from pdserve.worker.core_sharing import create_share_dir

    if parent is None and os.path.isdir("/dev/shm"):
        parent = "/dev/shm"
    path = tempfile.mkdtemp(prefix=f"pdserve-cores-{os.getpid()}-", dir=parent)
    create_share_dir(path)
    return path
