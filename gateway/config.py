"""Gateway configuration: frozen dataclasses, composed. The CLI builds them; nothing here
reads the environment or parses arguments."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.backend import PRIORITIES
from gateway.lora_adapters import GatewayLoraConfig
from gateway.planner import PlannerSettings
from pdserve.common.generation_config import SamplingDefaults


@dataclass(frozen=True)
class RequestLimits:
    """Size limits enforced by input validation (gateway/validation.py)."""

    max_body_bytes: int = 1 << 20
    max_header_bytes: int = 16 << 10  # one header line / field
    max_messages: int = 256
    max_prompt_tokens: int | None = None  # None: only max_model_len bounds the prompt
    max_n: int = 8
    max_tokens: int | None = None  # None: only max_model_len bounds it
    max_stop: int = 4
    max_stop_len: int = 256  # characters per stop string
    max_logprobs: int = 20
    max_stop_token_ids: int = 64  # distinct ids in stop_token_ids
    max_user_len: int = 256  # characters of the `user` field
    # Prompt characters (a completion's text, or a chat's message contents and tools) beyond
    # which a prompt is refused before it is tokenized. None: max_model_len times the
    # longest token's length in characters, so no prompt that could fit is refused.
    max_prompt_chars: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "max_header_bytes", "max_messages", "max_n", "max_stop",
                     "max_stop_token_ids", "max_user_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")


@dataclass(frozen=True)
class ConnectionLimits:
    """What one client connection may hold (gateway/connections.py): none of it for longer
    than it uses it."""

    max_connections: int = 4096  # open connections per gateway; beyond it: 503 and close
    # A connection must deliver a complete request head within this many seconds of
    # opening or of its previous response (this is also the keep-alive idle limit).
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0  # the whole request body, from its head on; past it: 408
    # A connection whose unsent output has not drained at all for this long (the client
    # stopped reading) is cut; its request is aborted as on a disconnect.
    idle_write_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError("max_connections must be >= 1")
        for name in ("header_timeout_s", "body_timeout_s", "idle_write_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")


@dataclass(frozen=True)
class QueueLimits:
    """Admission limits of one priority class."""

    max_depth: int = 256  # requests waiting for a slot; beyond it -> 503
    max_wait_s: float = 30.0  # longest wait for a slot; beyond it -> 503


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission control: at most `max_in_flight` requests are inside the backend;
    the rest wait in one bounded queue per priority class (see gateway/admission.py)."""

    max_in_flight: int = 256
    interactive: QueueLimits = field(default_factory=QueueLimits)
    batch: QueueLimits = field(default_factory=lambda: QueueLimits(max_depth=1024, max_wait_s=300.0))
    # A batch request waiting longer than this is served as if it were interactive,
    # so a steady interactive stream cannot starve batch forever. None: strict priority.
    batch_aging_s: float | None = 60.0
    retry_after_s: int = 1  # Retry-After header on 503s

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")

    def queue(self, priority: str) -> QueueLimits:
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}")
        limits: QueueLimits = getattr(self, priority)
        return limits


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # The served model id: reported in responses and first in /v1/models. A request's
    # `model` must be it or one of `model_aliases` (vLLM's --served-model-name A B ...).
    model_name: str = "pdserve-default"
    model_aliases: tuple[str, ...] = ()
    model_dir: str | None = None
    max_model_len: int = 2048
    limits: RequestLimits = field(default_factory=RequestLimits)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    connections: ConnectionLimits = field(default_factory=ConnectionLimits)
    # Threads rendering chat templates and tokenizing prompts (gateway/prompt_pool.py), and
    # how many prompts may wait for one before a 503.
    tokenizer_threads: int = 2
    tokenizer_queue: int = 256
    # False: special-token strings inside message content are tokenized as text, so a user
    # cannot forge a turn (gateway/chat_prompt.py); True: as control tokens (the old way).
    special_tokens_in_content: bool = False
    api_keys: tuple[str, ...] = ()  # empty: no authentication
    metrics_protected: bool = False  # require the API key on /metrics too
    drain_timeout_s: float = 30.0  # SIGTERM: how long in-flight requests may finish
    request_timeout_s: float | None = None  # per-request deadline from arrival, whole response
    default_max_tokens: int = 16  # completions without max_tokens (OpenAI's default)
    # Defaults for sampling fields a request leaves out (from generation_config.json).
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # --enable-auto-tool-choice --tool-call-parser: tool_choice "auto" parses calls in
    # this format (gateway/tool_calls.py); None: only required/named tool choices.
    tool_call_parser: str | None = None
    # Bearer token of the admin routes (/admin/..., gateway/admin_roles.py); None: no admin API.
    admin_token: str | None = None
    # --planner: the P:D planner (gateway/planner_loop.py); None: off.
    planner: PlannerSettings | None = None
    # --responses-store-size: stored /v1/responses kept for previous_response_id
    # (least recently used evicted first; 0: nothing is stored).
    responses_store_size: int = 1024

    # --enable-lora: LoRA adapters served by name (gateway/lora_adapters.py); None: off.
    lora: GatewayLoraConfig | None = None

    def __post_init__(self) -> None:
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.responses_store_size < 0:
            raise ValueError("responses_store_size must be >= 0")
        if self.tokenizer_threads < 1 or self.tokenizer_queue < 1:
            raise ValueError("tokenizer_threads and tokenizer_queue must be >= 1")
        if any(not k for k in self.api_keys):
            raise ValueError("api keys must be non-empty")
        if self.admin_token is not None and len(self.admin_token) < 16:
            raise ValueError("the admin token must be at least 16 characters")
        names = self.served_model_names
        if any(not n for n in names) or len(set(names)) != len(names):
            raise ValueError("served model names must be non-empty and distinct")

    @property
    def served_model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)
