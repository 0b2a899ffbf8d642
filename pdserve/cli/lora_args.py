"""`--enable-lora` and its flags (vLLM's names; fields of `WorkerArgs` and `GatewayArgs`):
their checks and the configs they build: the gateway serves adapters by name
(gateway/lora_adapters.py), the workers bound what they hold (pdserve/engine/lora)."""

from __future__ import annotations

import argparse
from typing import Any

from pdserve.cli.args import UsageError


def lora_module(text: str) -> tuple[str, str]:
    """`name=path` (vLLM's --lora-modules form)."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected name=path, got {text!r}")
    return name, path


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

