"""Every worker flag, once: `pdserve prefill/decode/worker` parse them, `pdserve up`
offers those marked `up` and passes each child a `WorkerArgs` as its command line."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from pdserve.cli import shared_flags
from pdserve.cli.args import (
    MODEL_HELP,
    byte_size_text,
    checked,
    device,
    dtype,
    fraction,
    host,
    kv_cache_dtype,
    kv_events_config,
    memory_fraction,
    non_negative_int,
    port_or_zero,
    positive_float,
    positive_int,
    speculative_config,
)
from pdserve.cli.argspec import ArgGroup, flag
from pdserve.common.kv_layout import KV_CACHE_DTYPE_HELP
from pdserve.common.roles import Role
from pdserve.engine.attention.backend_choice import ATTENTION_BACKENDS
from pdserve.engine.loading.dtype import DTYPE_HELP
from pdserve.engine.quant.formats import LM_HEAD_CHOICES, QUANTIZATION_CHOICES
from pdserve.engine.spec.config import SpeculativeConfig
from pdserve.worker.cpu_cores import format_cpu_list, parse_cpu_list
from pdserve.worker.vllm_events.config import KVEventsConfig

P_D = (Role.PREFILL, Role.DECODE)
GPU_MEMORY_HELP = ("CUDA: fraction of the device's total memory a worker may use (weights, activations and KV "
                   "cache); default ")
ENGINE_FLAGS = ("dtype", "kv_cache_dtype", "quantization", "lm_head_quantization")  # shared with `generate`


def gateway_address(text: str) -> str:
    from pdserve.worker.gateways import (
        parse_gateway,  # zmq: loaded only when a worker's flags are parsed
    )

    return parse_gateway(text)


def default_threads(local_workers: int = 1) -> int:
    return max(1, (os.cpu_count() or 1) // max(local_workers, 1))


@dataclass(frozen=True)
class WorkerArgs(ArgGroup):
    gateway: tuple[str, ...] = flag((), "gateway control address, tcp://HOST:PORT or dns+tcp://NAME:PORT (every "
                                    "A record, re-resolved); repeat for several gateways", type=checked(gateway_address),
                                    action="append", required=True, up=False)
    model: str | None = flag(None, MODEL_HELP, up=False)  # `up` passes the directory it resolved
    revision: str | None = shared_flags.revision()
    download_dir: Path | None = shared_flags.download_dir()
    device: str = flag("cpu", "cpu | cuda | cuda:N", type=device)
    dtype: str = flag("auto", DTYPE_HELP, type=dtype,
                      up_help="workers' weight and KV dtype, each resolved on its own host; " + DTYPE_HELP)
    kv_cache_dtype: str = flag("auto", KV_CACHE_DTYPE_HELP, type=kv_cache_dtype)
    quantization: str = flag("none", "weight-only quantization of the decoder linears on load: int8 (per-channel "
                             "scales) or int4 (groups of 128, asymmetric); AWQ/GPTQ checkpoints are served as stored "
                             "with none", choices=QUANTIZATION_CHOICES)
    lm_head_quantization: str = flag("auto", "the LM head's weights: auto (int8 per-channel with --quantization "
                                     "int8/int4, else the compute dtype), none (always the compute dtype) or int8",
                                     choices=LM_HEAD_CHOICES)
    spin_wait: bool = flag(False, "let OpenMP threads spin briefly between parallel regions (OpenMP's own "
                           "default): ~20%% faster steps when this worker's threads have their cores to themselves, "
                           "a collapse when other busy processes share them. Without it the worker sets "
                           "OMP_WAIT_POLICY=PASSIVE unless the environment sets it", action="store_true", up=False)
    thread_policy: str | None = flag(
        None, "adaptive: each step runs with all torch threads spinning or with their OpenMP waits throttled "
        "(1 thread without libgomp), whichever recent steps show faster (one busy neighbour process makes "
        "spinning threads 10x slower; docs/internals.md, Threads and cores); fixed: always --threads. "
        "Default: adaptive on CPU with more than one thread (or borrowed cores), fixed on CUDA and with "
        "tensor or pipeline parallelism", choices=("adaptive", "fixed"), up=False)
    kv_offload_memory: str | None = flag(
        None, "host KV tier: blocks evicted from (and written through) the worker's pool are kept in shared "
        "memory that every worker on this host reads, e.g. 8GiB", type=byte_size_text, metavar="SIZE")
    kv_offload_memory_dir: str | None = flag(None, "the host tier's shared-memory directory (default "
                                             "/dev/shm/pdserve-kv-USER)", metavar="DIR")
    kv_offload_dir: str | None = flag(None, "disk KV tier: block files in DIR, kept across restarts, shareable "
                                      "by the servers of one host", metavar="DIR")
    kv_offload_disk: str | None = flag(None, "the disk tier's bound (default 16GiB; needs --kv-offload-dir)",
                                       type=byte_size_text, metavar="SIZE")
    kv_remote_url: str | None = flag(None, "remote KV tier shared across hosts: a Redis (pip install "
                                     "'pdserve[redis]')", metavar="redis://HOST:PORT/DB")
    enable_lora: bool = shared_flags.enable_lora()
    max_loras: int = shared_flags.max_loras()
    max_lora_rank: int = shared_flags.max_lora_rank()
    max_cpu_loras: int | None = flag(None, "LoRA adapters kept in host memory per worker (LRU; default: "
                                     "--max-loras)", type=positive_int)
    otlp_traces_endpoint: str | None = shared_flags.otlp_traces_endpoint()
    kv_cache_memory: str | None = flag(None, "KV pool bytes, e.g. 256MiB", type=byte_size_text,
                                       up_help="per-worker KV pool bytes, e.g. 256MiB")
    gpu_memory_utilization: float | None = flag(None, GPU_MEMORY_HELP + "0.9", type=memory_fraction, metavar="FRACTION",
                                                up_help=GPU_MEMORY_HELP + "0.9 / the number of workers on the device")
    cuda_graphs: bool | None = flag(None, "CUDA: replay decode steps from CUDA graphs captured at batch sizes 1, 2, "
                                    "4 ... 64 (default on with a CUDA device; never on CPU)",
                                    action=argparse.BooleanOptionalAction)
    attention_backend: str = flag("auto", "auto: on CUDA flashinfer if installed, else triton; on CPU the "
                                  "native/torch kernels. triton and flashinfer need CUDA and the package installed",
                                  choices=ATTENTION_BACKENDS)
    num_blocks: int | None = flag(None, "explicit KV block count", type=positive_int, up_help="")
    block_size: int = flag(16, type=positive_int, up_help="per-worker KV block size in tokens")
    max_num_seqs: int = flag(64, type=positive_int, up_help="per-worker running sequences")
    max_num_batched_tokens: int = flag(2048, type=positive_int, up_help="per-worker token budget per step")
    long_prefill_token_threshold: int = flag(
        0, "cap on one sequence's prefill tokens per step, so short prompts are not queued behind a long one "
        "(0: no cap)", type=non_negative_int, up_help="per-worker cap on one sequence's prefill tokens per step")
    max_model_len: int | None = flag(None, type=positive_int, up_help="longest prompt + output, for the gateway "
                                     "and every worker (default: the model's)")
    reserve_decode_tokens: int = flag(512, "decode admission: a reservation is granted only if every live stream "
                                      "keeps room to grow by this many more tokens (capped by its max_tokens)",
                                      type=non_negative_int)
    kv_watermark: float = flag(0.01, "decode admission: fraction of the KV pool also kept free", type=fraction)
    no_prefix_caching: bool = flag(False, action="store_true", up_help="disable the workers' prefix cache")
    grammar_compile_timeout: float = flag(
        10.0, "structured outputs: a constraint not compiled in time is refused (400)", type=positive_float,
        metavar="SECONDS", up_help="workers: refuse a structured-output constraint not compiled in time (default 10)")
    threads: int | None = flag(None, "torch intra-op threads per rank (default: the cores split among "
                               "--local-workers)", type=positive_int, up=False)
    tensor_parallel_size: int = flag(
        1, "ranks of this worker's tensor-parallel group (CPU: gloo, one process per rank, one registration); "
        "must divide the attention heads and intermediate size, and divide or be a multiple of the KV heads",
        type=positive_int, up=False)
    pipeline_parallel_size: int = flag(
        1, "pipeline stages of this worker, one process each, layers split evenly (one step at a time, no "
        "micro-batch overlap yet; not with --tensor-parallel-size)", type=positive_int, up=False)
    local_workers: int = flag(1, "workers sharing this host", type=positive_int, up=False)
    cpu_cores: tuple[int, ...] | None = flag(None, "pin the worker's threads to these cores, e.g. 0-3 (default: "
                                             "unpinned); --threads then defaults to their count", type=checked(parse_cpu_list),
                                             metavar="LIST", render=format_cpu_list, up=False)
    core_share: str | None = flag(None, "prefill/decode: the directory `pdserve up` made so that a prefill and "
                                  "a decode worker may run on each other's cores while the other has nothing to "
                                  "compute", metavar="DIR", roles=P_D, up=False)
    borrow_cores: tuple[int, ...] | None = flag(None, "with --core-share and --cpu-cores: the other worker's cores, "
                                                "run on while it is idle", type=checked(parse_cpu_list), metavar="LIST",
                                                render=format_cpu_list, roles=P_D, up=False)
    metrics_host: str = flag("127.0.0.1", type=host, up=False)
    metrics_port: int = flag(0, "worker /health and /metrics (0: free)", type=port_or_zero, up=False)
    heartbeat: float = flag(0.5, "seconds between heartbeats", type=positive_float, up=False)
    worker_id: str | None = flag(None, up=False)
    kv_host: str = flag("127.0.0.1", "decode: address the KV receiver binds", type=host, up=False)
    kv_port: int = flag(0, "decode: KV receiver tcp port (0: ephemeral)", type=port_or_zero, up=False)
    kv_transport: str = flag("auto", "auto: shared memory (CPU) or CUDA IPC (GPU) with same-host peers, tcp "
                             "otherwise; tcp: always tcp (a GPU pool through pinned host staging)",
                             choices=("auto", "tcp", "shm"), roles=P_D, up_help="")
    enable_fault_injection: bool = flag(False, "tests only: inject the faults PDSERVE_FAULTS and PDSERVE_KV_FAULTS "
                                        "ask for (ignored without this flag); logs a WARNING", action="store_true",
                                        up=False)
    curve_key: str | None = flag(None, "CURVE: this worker's secret certificate file", up=False)
    curve_server_key: str | None = flag(None, "CURVE: the gateway's public certificate file", up=False)
    curve_authorized_keys: str | None = flag(
        None, "CURVE, prefill and decode: directory of the workers' public certificates (the gateway's); KV "
        "sockets then use CURVE and accept only these peers", up=False)
    speculative_config: SpeculativeConfig | None = flag(
        None, 'speculative decoding, vLLM\'s shape: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_min": a, "prompt_lookup_max": b} or {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": K}; optional "disable_by_batch_size" (default 8): no drafts in a step with more '
        'running sequences; draft_model: optional "draft_kv": "decode" (default: the decode worker prefills the '
        'draft) or "prefill" (the prefill worker runs the draft too and ships its KV; give the same config to '
        'both). Output is identical with it on or off', type=speculative_config, metavar="JSON",
        render=SpeculativeConfig.to_json)
    kv_events_config: KVEventsConfig | None = flag(
        None, 'publish the KV pool\'s block stored/removed/cleared events as vLLM does, for external KV-aware '
        'routers (llm-d, Dynamo): vLLM\'s JSON, {"enable_kv_cache_events": true, "endpoint": '
        '"tcp://127.0.0.1:5557", "replay_endpoint": null, "buffer_steps": 10000, "hwm": 100000, '
        '"max_queue_size": 100000, "topic": ""}; ZeroMQ PUB + msgpack. The endpoint defaults to loopback; '
        'one off loopback needs --insecure (the stream has no CURVE)', type=kv_events_config, metavar="JSON",
        render=KVEventsConfig.to_json,
        up_help='every worker publishes vLLM-format KV events (vLLM\'s JSON, as for a worker); worker i binds '
        'the endpoint\'s port + i (vLLM\'s rule for data-parallel ranks); loopback or ipc only')
