"""LoRA adapter routes, as vLLM serves them under `--enable-lora`:

    POST /v1/load_lora_adapter    {"lora_name": "...", "lora_path": "..."}
    POST /v1/unload_lora_adapter  {"lora_name": "..."}

Both sit behind the API key when one is set (the auth middleware protects every
route but /health, /ready and, unless configured, /metrics). A bad adapter is a 400
that says why, an unknown name a 404, a name already loaded or one still in use a 409,
all in OpenAI's error shape; the gateway keeps serving the others. Without
`--enable-lora` the routes answer 404. `/v1/models` lists each adapter with
`parent` = the base model (`model_cards`); `llm_lora_requests{adapter}` and vLLM's
`llm_lora_requests_info{running_lora_adapters,max_lora}` report what runs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any

from aiohttp import web
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.body import json_object
from gateway.errors import APIError
from gateway.lora_adapters import LoraAdapters
from gateway.state import STATE
from pdserve.common.lora import LoraError

MAX_BODY_BYTES = 16 << 10


def _adapters(request: web.Request) -> LoraAdapters:
    loras = request.app[STATE].loras
    if loras is None:
        raise APIError(404, "LoRA is not enabled on this server (--enable-lora)", code="not_found")
    return loras


async def _body(request: web.Request, fields: tuple[str, ...]) -> dict[str, str]:
    data = await json_object(request, MAX_BODY_BYTES, request.app[STATE].config.connections.body_timeout_s)
    out = {}
    for f in fields:
        v = data.get(f)
        if not isinstance(v, str) or not v:
            raise APIError(400, f"{f} must be a non-empty string", param=f, code="invalid_value")
        out[f] = v
    return out


async def load_lora_adapter(request: web.Request) -> web.Response:
    loras = _adapters(request)
    body = await _body(request, ("lora_name", "lora_path"))
    name = body["lora_name"]
    if name in loras:
        raise APIError(409, f"The lora adapter '{name[:64]}' has already been loaded.",
                       param="lora_name", code="conflict")
    try:  # the files are read and hashed on a thread: the streams keep flowing meanwhile
        ref = await asyncio.to_thread(loras.check, name, body["lora_path"])
        if name in loras:
            raise APIError(409, f"The lora adapter '{name[:64]}' has already been loaded.",
                           param="lora_name", code="conflict")
        loras.add(ref)
    except LoraError as e:
        raise APIError(400, str(e), param="lora_path", code="invalid_lora") from None
    request.app[_COUNTS]["loads"] += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


async def unload_lora_adapter(request: web.Request) -> web.Response:
    loras = _adapters(request)
    name = (await _body(request, ("lora_name",)))["lora_name"]
    try:
        loras.unload(name)
    except KeyError:
        raise APIError(404, f"The lora adapter '{name[:64]}' cannot be found.", param="lora_name",
                       code="model_not_found") from None
    except LoraError as e:
        raise APIError(409, str(e), param="lora_name", code="conflict") from None
    request.app[_COUNTS]["unloads"] += 1
    return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def adapter_cards(request: web.Request) -> list[dict[str, Any]]:
    """The OpenAI model objects of the served adapters (vLLM's shape: root = the
    adapter's path, parent = the base model)."""
    state = request.app[STATE]
    if state.loras is None:
        return []
    return [{"id": r.name, "object": "model", "created": request.app[_CREATED_AT], "owned_by": "pdserve",
             "root": r.path, "parent": state.config.model_name,
             "max_model_len": state.config.max_model_len} for r in state.loras]


class LoraCollector(Collector):
    """Requests in flight per adapter, the running-adapters info gauge, loads/unloads."""

    def __init__(self, app: web.Application) -> None:
        self.app = app

    def collect(self) -> Iterable[Metric]:
        loras = self.app[STATE].loras
        if loras is None:
            return
        running = loras.running()
        per = GaugeMetricFamily("llm_lora_requests", "Requests in flight per LoRA adapter",
                                labels=["adapter"])
        for r in loras:
            per.add_metric([r.name], running.get(r.name, 0))
        yield per
        info = GaugeMetricFamily("llm_lora_requests_info", "Running LoRA adapters (vLLM's "
                                 "vllm:lora_requests_info)", labels=["running_lora_adapters", "max_lora"])
        info.add_metric([",".join(sorted(n for n, c in running.items() if c > 0)),
                         str(self.app[_MAX_LORAS])], time.time())
        yield info
        for what in ("loads", "unloads"):
            fam = CounterMetricFamily(f"llm_lora_adapter_{what}", f"LoRA adapter runtime {what}")
            fam.add_metric([], self.app[_COUNTS][what])
            yield fam


_COUNTS: web.AppKey[dict[str, int]] = web.AppKey("pdserve_lora_counts", dict)
_CREATED_AT: web.AppKey[int] = web.AppKey("pdserve_lora_created", int)
_MAX_LORAS: web.AppKey[int] = web.AppKey("pdserve_max_loras", int)


def install_lora(app: web.Application) -> None:
    """The adapter routes and metrics (`app[STATE].loras` None: the routes answer 404)."""
    lora = app[STATE].config.lora
    app[_COUNTS] = {"loads": 0, "unloads": 0}
    app[_CREATED_AT] = int(time.time())
    app[_MAX_LORAS] = lora.max_loras if lora is not None else 0
    app.router.add_post("/v1/load_lora_adapter", load_lora_adapter)
    app.router.add_post("/v1/unload_lora_adapter", unload_lora_adapter)
    app[STATE].metrics.registry.register(LoraCollector(app))
