"""Everything one gateway app shares between its handlers (stored in `app[STATE]`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from aiohttp import web

from gateway.admission import AdmissionController
from gateway.backend import GenerationBackend
from gateway.config import GatewayConfig
from gateway.lora_adapters import LoraAdapters
from gateway.metrics import GatewayMetrics
from gateway.prompt_pool import PromptPool
from gateway.tokenizer import Tokenizer
from pdserve.common.tracing import Tracer


@dataclass
class GatewayState:
    config: GatewayConfig
    backend: GenerationBackend
    tokenizer: Tokenizer
    admission: AdmissionController
    metrics: GatewayMetrics
    prompts: PromptPool
    loras: LoraAdapters | None = None  # --enable-lora: the adapters served by name
    tracer: Tracer | None = None  # --otlp-traces-endpoint: spans of each request (gateway/tracing.py)
    draining: bool = False
    active: int = 0  # generation requests being handled (queued, running or streaming)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    def start_draining(self) -> None:
        """Stop admitting: /ready turns 503, new generation requests get 503."""
        self.draining = True
        self.admission.start_draining()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is active; False if `timeout` passed first."""
        if self.active == 0:
            return True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True


STATE: web.AppKey[GatewayState] = web.AppKey("pdserve_gateway_state", GatewayState)
