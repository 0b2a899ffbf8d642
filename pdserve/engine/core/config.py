"""Engine configuration: frozen dataclasses composed into one EngineConfig.

Command-line parsing lives in pdserve.cli; this module only holds values and
derived properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.kv_layout import normalize_kv_cache_dtype
from pdserve.engine.attention.backend_choice import ATTENTION_BACKENDS
from pdserve.engine.lora.config import LoraConfig
from pdserve.engine.quant.formats import LM_HEAD_CHOICES, QUANTIZATION_CHOICES
from pdserve.engine.spec.config import SpeculativeConfig

SERVING_DTYPES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = ("auto", *SERVING_DTYPES)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # KV pool budget in bytes. None: on GPU what `gpu_memory_utilization` of the device's
    # total memory leaves after weights and activations (pdserve.engine.runner.memory_budget); on CPU
    # DEFAULT_CPU_KV_BYTES.
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    # Explicit block count (tests, tiny budgets); overrides kv_cache_memory.
    num_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


DEFAULT_CPU_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    # Per-step token budget shared by decode tokens and prefill chunks.
    max_num_batched_tokens: int = 2048
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    # When False a prompt must be prefilled in one step (it must fit the budget).
    enable_chunked_prefill: bool = True
    # > 0: no sequence gets more than this many prefill tokens in one step, so the
    # rest of the budget stays open for prompts that arrive behind a long one
    # (vLLM's long_prefill_token_threshold). 0: a prefill may take the whole budget.
    long_prefill_token_threshold: int = 0
    # Decode admission (`Scheduler.check_reserve`): a reservation is granted only if
    # every live stream, the new one included, keeps room to grow by this many more
    # tokens (capped by its max_tokens; SGLang's num_reserved_decode_tokens) ...
    reserve_decode_tokens: int = 512
    # ... plus this fraction of the pool left free (vLLM's `watermark`).
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if self.reserve_decode_tokens < 0:
            raise ValueError(f"reserve_decode_tokens must be >= 0, got {self.reserve_decode_tokens}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"the KV watermark must be in [0, 1), got {self.watermark}")


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str
    # auto | float32 | float16 | bfloat16; auto: see pdserve.engine.loading.dtype (`resolved_config`).
    dtype: str = "auto"
    device: str = "cpu"  # cpu | cuda | cuda:N
    # torch intra-op threads; None leaves torch's default. Workers sharing a host set it.
    num_threads: int | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    seed: int = 0
    # Structured outputs: a constraint whose grammar takes longer to compile is refused.
    grammar_compile_timeout_s: float = 10.0
    # auto (the compute dtype) | fp8 | fp8_e4m3 | int8: see pdserve.engine.runner.kv_quant.
    kv_cache_dtype: str = "auto"
    # Weight-only quantization on the fly: none | int8 | int4 (pdserve/engine/quant/formats.py).
    # A pre-quantized (AWQ/GPTQ) checkpoint is served as stored, with "none" here.
    quantization: str = "none"
    # The LM head's weights: auto (int8 under on-the-fly int8/int4, else the compute dtype)
    # | none | int8 (pdserve/engine/quant/formats.py `served_lm_head`).
    lm_head_quantization: str = "auto"
    # Speculative decoding (`--speculative-config`); None: off.
    speculative: SpeculativeConfig | None = None
    # Ranks of one tensor-parallel group (`pdserve.engine.parallel`); rank 0 is this process.
    tensor_parallel_size: int = 1
    # Pipeline stages, one process each, layers split evenly (not with tensor parallel yet).
    pipeline_parallel_size: int = 1
    # Decode steps replayed from CUDA graphs (pdserve.engine.runner.cuda_graphs); None: on with CUDA.
    cuda_graphs: bool | None = None
    # auto | torch | triton | flashinfer (pdserve.engine.attention.backend_choice); checked against the
    # device and installed packages when the runner picks its backend.
    attention_backend: str = "auto"
    # LoRA adapters served on this model (`--enable-lora`, pdserve.engine.lora); None: off.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r}; "
                             f"choose one of {', '.join(ATTENTION_BACKENDS)}")
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs a CUDA device, not {self.device!r}")
        if self.grammar_compile_timeout_s <= 0:
            raise ValueError(f"grammar_compile_timeout_s must be > 0, got {self.grammar_compile_timeout_s}")
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError("tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                             f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}")
        if self.lora is not None and (self.tensor_parallel_size > 1 or self.pipeline_parallel_size > 1):
            raise ValueError("--enable-lora serves dense models on one rank only (no tensor or pipeline "
                             f"parallel), got tensor_parallel_size {self.tensor_parallel_size} and "
                             f"pipeline_parallel_size {self.pipeline_parallel_size}")
        if self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(DTYPE_CHOICES)}")
        normalize_kv_cache_dtype(self.kv_cache_dtype)  # ValueError naming the choices
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"unsupported quantization {self.quantization!r}; "
                             f"choose one of {', '.join(QUANTIZATION_CHOICES)}")
        if self.lm_head_quantization not in LM_HEAD_CHOICES:
            raise ValueError(f"unsupported lm_head_quantization {self.lm_head_quantization!r}; "
                             f"choose one of {', '.join(LM_HEAD_CHOICES)}")
