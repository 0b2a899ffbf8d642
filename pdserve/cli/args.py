"""Argument types and up-front checks shared by every `pdserve` subcommand.

Bad input is refused in one line before anything starts, the way argparse
refuses it: `pdserve up: error: argument --port: ...`, exit status 2. Syntax
(numbers, ports, sizes, hosts, devices, URLs) is checked by the `type=`
functions here while parsing; what needs the file system or the network (the
model directory, a free listening port) is checked by the `check_*` functions
at the top of each command's `run`, so that parsing alone still works for a
command line meant for another machine (the deploy manifests are parsed that
way in tests).
"""

from __future__ import annotations

import argparse
import ipaddress
import math
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeVar
from urllib.parse import urlparse

from pdserve.common.kv_layout import normalize_kv_cache_dtype
from pdserve.engine.loading.dtype import normalize_dtype
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.planner.capacity import PlanError, parse_size
from pdserve.worker.vllm_events.config import KVEventsConfig

T = TypeVar("T")
N = TypeVar("N", int, float)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose error is one line on stderr (no usage block)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


class UsageError(SystemExit):
    """A bad argument found after parsing; `pdserve.cli.main` prints
    `pdserve CMD: error: argument FLAG: MESSAGE` and exits 2."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {_one_line(message)}")
        self.flag = flag
        self.code = 2


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _bad(expected: str, text: str) -> NoReturn:
    raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def _int(text: str, expected: str) -> int:
    try:
        return int(text)
    except ValueError:
        _bad(expected, text)


def _float(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        _bad(expected, text)
    if not math.isfinite(value):
        _bad(expected, text)
    return value


def _bounded(number: Callable[[str, str], N], expected: str, ok: Callable[[N], bool]) -> Callable[[str], N]:
    """An argparse type: `number` (`_int` or `_float`) read from the text, refused as
    "expected `expected`" unless `ok` holds for it."""
    def conv(text: str) -> N:
        value = number(text, expected)
        if not ok(value):
            _bad(expected, text)
        return value
    return conv


positive_int = _bounded(_int, "an integer >= 1", lambda v: v >= 1)  # counts, sizes in tokens, threads
non_negative_int = _bounded(_int, "an integer >= 0", lambda v: v >= 0)  # where 0 means "none" or "no cap"
port = _bounded(_int, "a port 1..65535", lambda v: 1 <= v <= 65535)  # to listen on or connect to
port_or_zero = _bounded(_int, "a port 1..65535, or 0 for a free one", lambda v: 0 <= v <= 65535)  # 0: the OS picks
positive_float = _bounded(_float, "a number > 0", lambda v: v > 0)  # finite, as every float here (seconds)
non_negative_float = _bounded(_float, "a number >= 0", lambda v: v >= 0)
fraction = _bounded(_float, "a fraction 0 <= x < 1", lambda v: 0 <= v < 1)  # a share of something
memory_fraction = _bounded(_float, "a fraction 0 < x <= 1", lambda v: 0 < v <= 1)  # a share of a device's memory


def byte_size(text: str) -> int:
    """Bytes > 0: `256MiB`, `1GiB`, `2GB`, `1048576` (one parser: `pdserve.planner.capacity.parse_size`)."""
    try:
        value = parse_size(text)
    except PlanError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        _bad("a size > 0", text)
    return value


def byte_size_text(text: str) -> str:
    """A valid `byte_size`, kept as written (for flags passed on to another process)."""
    byte_size(text)
    return text.strip()


_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def host(text: str) -> str:
    """An IPv4/IPv6 address or a DNS host name (syntax only; nothing is resolved)."""
    value = text.strip()
    try:
        return str(ipaddress.ip_address(value.strip("[]")))
    except ValueError:
        pass
    if re.fullmatch(r"[0-9.]+", value):
        _bad("an IPv4 address (four numbers 0..255)", text)
    if ":" in value:
        _bad("an IPv6 address", text)
    labels = value.rstrip(".").split(".")
    if not value or len(value) > 253 or not all(_LABEL.match(label) for label in labels):
        _bad("an IP address or host name", text)
    return value


def device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N`."""
    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        _bad("cpu, cuda or cuda:N", text)
    return text


def checked(parse: Callable[[str], T]) -> Callable[[str], T]:
    """`parse` as an argparse type: its ValueError or TypeError is the refusal, in its words."""
    def conv(text: str) -> T:
        try:
            return parse(text)
        except (ValueError, TypeError) as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    conv.__name__ = parse.__name__
    return conv


dtype = checked(normalize_dtype)  # auto, float32, float16, bfloat16 (also fp32, fp16, half, bf16)
kv_cache_dtype = checked(normalize_kv_cache_dtype)  # auto, fp8 (= fp8_e4m3), fp8_e4m3 or int8, normalized
speculative_config = checked(SpeculativeConfig.from_json)  # vLLM's --speculative-config JSON
kv_events_config = checked(KVEventsConfig.from_json)  # vLLM's --kv-events-config JSON


def check_speculative(spec: SpeculativeConfig | None) -> None:
    """A draft model must be a readable model directory."""
    if spec is not None and spec.model is not None:
        check_model(spec.model, tokenizer=False, flag="--speculative-config")


def http_url(text: str) -> str:
    """An http(s)://HOST[:PORT][/path] base URL."""
    url = urlparse(text)
    try:
        url.port  # noqa: B018 - raises ValueError on a port outside 0..65535
    except ValueError:
        _bad("http(s)://HOST[:PORT]", text)
    if url.scheme not in ("http", "https") or not url.hostname:
        _bad("http(s)://HOST[:PORT]", text)
    return text


def add_model_arg(ap: argparse.ArgumentParser, note: str = "") -> None:
    """`--model` (a directory or a Hugging Face repo id) with `--revision` and `--download-dir`;
    `pdserve.cli.main` resolves an id to its snapshot directory before the command runs."""
    ap.add_argument("--model", default=None, help=MODEL_HELP + note)
    ap.add_argument("--revision", default=None, help=REVISION_HELP)
    ap.add_argument("--download-dir", type=Path, default=None, help=DOWNLOAD_DIR_HELP)


MODEL_HELP = "model directory or Hugging Face repo id org/name (default: built-in)"
REVISION_HELP = "with a repo id: branch, tag or commit (default: main)"
DOWNLOAD_DIR_HELP = "with a repo id: the Hugging Face cache to use (default: $HF_HUB_CACHE or $HF_HOME/hub)"


def resolve_model_arg(args: argparse.Namespace) -> None:
    """Replace a repo id in `args.model` by its local snapshot directory (see pdserve/cli/hub.py);
    `args.repo_id` keeps the id (None for a directory), the name the gateway serves it as."""
    from pdserve.cli.hub import HubError, HubSource, is_repo_id, resolve_model

    try:  # LoRA adapters given as repo ids resolve the same way (at their main revision)
        args.lora_modules = [(n, resolve_model(p, HubSource(None, getattr(args, "download_dir", None))))
                             for n, p in getattr(args, "lora_modules", None) or []]
    except HubError as e:
        raise UsageError("--lora-modules", str(e)) from None
    if getattr(args, "model", None) is None or not hasattr(args, "revision"):
        return
    args.repo_id = str(args.model) if is_repo_id(str(args.model)) else None
    try:
        args.model = resolve_model(str(args.model), HubSource(args.revision, args.download_dir))
    except HubError as e:
        raise UsageError("--model", str(e)) from None


def model_dir(path: str | Path | None) -> Path:
    """The model directory a command will use: `path`, or the built-in model."""
    if path is None:
        from pdserve.builtin.default_model import default_model_dir

        return Path(default_model_dir())
    return Path(path)


def check_model(path: str | Path | None, *, tokenizer: bool = True, flag: str = "--model") -> Any:
    """The model's `pdserve.engine.loading.model_config.ModelConfig` (torch-free), after checking that
    the directory exists, its config.json parses and names a supported model, and
    (with `tokenizer`) its tokenizer loads. Raises UsageError naming `flag`."""
    from pdserve.engine.loading.model_config import ModelConfig, ModelConfigError

    d = model_dir(path)
    if not d.is_dir():
        raise UsageError(flag, f"{d} is not a directory")
    try:
        config = ModelConfig.from_hf_dir(d)
    except ModelConfigError as e:
        raise UsageError(flag, str(e)) from None
    if tokenizer:
        from gateway.tokenizer import Tokenizer, TokenizerError

        try:
            Tokenizer.from_model_dir(d)
        except TokenizerError as e:
            raise UsageError(flag, str(e)) from None
    return config


def check_max_model_len(value: int | None, model_config: Any) -> int:
    """`value` (or the model's limit when None), refused beyond the model's limit."""
    limit = int(model_config.position_limit)
    if value is not None and value > limit:
        raise UsageError("--max-model-len", f"{value} exceeds the model's limit of {limit} positions")
    if value is not None and value < 2:
        raise UsageError("--max-model-len", f"expected an integer >= 2, got {value}")
    return limit if value is None else value


def check_listen(flag: str, host_name: str, port_number: int) -> None:
    """Refuse a host:port this machine cannot listen on now (in use, not a local address)."""
    try:
        infos = socket.getaddrinfo(host_name, port_number, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except OSError as e:
        raise UsageError(flag, f"cannot resolve {host_name}: {e.strerror or e}") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        # What the servers do too: a port in TIME_WAIT is free, a listening one is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise UsageError(
                flag, f"cannot listen on {host_name}:{port_number}: {e.strerror or e}"
            ) from None


def check_parallel(flag: str, tp: int, pp: int, device_name: str, config: Any) -> None:
    """A tensor-parallel size must split the model's heads and MLP, a pipeline size its
    layers, on CPU (gloo) for now; `flag` names the refusal."""
    from pdserve.engine.parallel.plan import ParallelLayoutError, check_pp, check_tp

    if tp * pp > 1 and not device_name.startswith("cpu"):
        raise UsageError(flag, "tensor and pipeline parallel run on --device cpu only so far")
    try:
        check_tp(config, tp)
        check_pp(config, pp)
    except ParallelLayoutError as e:
        raise UsageError(flag, str(e)) from None
