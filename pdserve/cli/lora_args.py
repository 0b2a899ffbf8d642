"""`--enable-lora` and its flags (vLLM's names), shared by `up`, `gateway` and the worker
commands, and the configs they build: the gateway serves adapters by name
(gateway/lora_adapters.py), the workers bound what they hold (pdserve/engine/lora)."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.cli.args import UsageError, positive_int


def lora_module(text: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


def add_lora_args(ap: argparse.ArgumentParser, *, gateway: bool, workers: bool) -> None:
    ap.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters on the base model")
    ap.add_argument("--max-loras", type=positive_int, default=1,
                    help="LoRA adapters resident per worker, so at most this many in one step")
    ap.add_argument("--max-lora-rank", type=positive_int, default=16, help="largest LoRA rank served")
    if workers:
        ap.add_argument("--max-cpu-loras", type=positive_int, default=None,
                        help="LoRA adapters kept in host memory per worker (LRU; default: --max-loras)")
    if gateway:
        ap.add_argument("--lora-modules", nargs="+", type=lora_module, default=[], metavar="NAME=PATH",
                        help="PEFT adapters served from the start; a request selects one with "
                             '"model": NAME')
        ap.add_argument("--lora-dir", default=None, metavar="DIR",
                        help="POST /v1/load_lora_adapter only loads adapters under this directory")


def check_lora_args(args: argparse.Namespace) -> None:
    if not args.enable_lora:
        for flag in ("lora_modules", "lora_dir"):
            if getattr(args, flag, None):
                raise UsageError(f"--{flag.replace('_', '-')}", "needs --enable-lora")
        return
    cpu = getattr(args, "max_cpu_loras", None)
    if cpu is not None and cpu < args.max_loras:
        raise UsageError("--max-cpu-loras", f"must be at least --max-loras ({args.max_loras})")
    names = [n for n, _ in getattr(args, "lora_modules", [])]
    if len(set(names)) != len(names):
        raise UsageError("--lora-modules", "adapter names must be distinct")


def worker_lora_config(args: argparse.Namespace) -> Any:
    """The engine's LoraConfig, or None without --enable-lora."""
    from pdserve.engine.lora.config import LoraConfig

    if not args.enable_lora:
        return None
    return LoraConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras)


def gateway_lora_config(args: argparse.Namespace) -> Any:
    from pathlib import Path

    from gateway.lora_adapters import GatewayLoraConfig

    if not args.enable_lora:
        return None
    modules = tuple((n, str(Path(p).resolve())) for n, p in args.lora_modules)
    return GatewayLoraConfig(modules, args.max_lora_rank, args.max_loras, args.lora_dir)


def worker_lora_flags(args: argparse.Namespace) -> list[str]:
    """What `up` passes its workers."""
    if not args.enable_lora:
        return []
    flags = ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    return flags + (["--max-cpu-loras", str(args.max_cpu_loras)] if args.max_cpu_loras else [])


def gateway_lora_flags(args: argparse.Namespace) -> list[str]:
    """What `up` passes its gateway."""
    if not args.enable_lora:
        return []
    from pathlib import Path

    flags = ["--enable-lora", "--max-loras", str(args.max_loras), "--max-lora-rank", str(args.max_lora_rank)]
    if args.lora_modules:
        flags += ["--lora-modules", *(f"{n}={Path(p).resolve()}" for n, p in args.lora_modules)]
    return flags + (["--lora-dir", str(Path(args.lora_dir).resolve())] if args.lora_dir else [])
