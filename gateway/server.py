"""The gateway's aiohttp application and process entry point.

`build_app(config, backend, tokenizer)` wires routes, middlewares (OpenAI error
envelope, API keys), admission and metrics into an `aiohttp.web.Application`; the
backend is started on app startup and closed on cleanup. `run_gateway(...)` serves
it until SIGTERM/SIGINT, then drains: `/ready` and new generation requests answer
503, in-flight requests finish for up to `drain_timeout_s`, the rest are cancelled
(which aborts them in the backend), and it returns exit code 0.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models,
GET /v1/models/{model}, POST /v1/responses and GET/DELETE /v1/responses/{id}
(gateway/responses/), POST /tokenize, POST /detokenize, GET /v1/workers, GET /health,
GET /ready, GET /metrics, POST /admin/workers/{id}/role (gateway/admin_roles.py),
POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (gateway/lora_api.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.admin_roles import check_admin
from gateway.admission import AdmissionController
from gateway.auth import check_authorization, is_protected
from gateway.backend import GenerationBackend
from gateway.config import GatewayConfig
from gateway.connections import GatewayRunner
from gateway.errors import APIError
from gateway.lora_adapters import LoraAdapters
from gateway.lora_api import adapter_cards, install_lora
from gateway.metrics import GatewayMetrics
from gateway.openai_api import REQUEST_ID_HEADER, chat_completions, completions
from gateway.planner_loop import install_roles
from gateway.prompt_pool import PromptPool
from gateway.responses.handler import install_responses
from gateway.state import STATE, GatewayState
from gateway.tokenize_api import detokenize, tokenize
from gateway.tokenizer import Tokenizer
from pdserve.common.hosts import is_loopback
from pdserve.common.tracing import Tracer

log = logging.getLogger("pdserve.gateway")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_CODE_BY_STATUS = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 400: "bad_request"}


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's envelope; tracebacks only go to the log."""
    try:
        return await handler(request)
    except APIError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return APIError(e.status, e.reason, code=_CODE_BY_STATUS.get(e.status)).response()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response()


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    keys = state.config.api_keys
    if keys and is_protected(request.path, state.config.metrics_protected):
        try:
            check_authorization(request.headers.get("Authorization"), keys)
        except APIError as e:
            state.metrics.rejected.labels(reason="unauthorized").inc()
            e.headers[REQUEST_ID_HEADER] = request.headers.get(REQUEST_ID_HEADER, "")[:128]
            raise
    return await handler(request)


@web.middleware
async def header_limit_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Oversized headers get a 431 envelope naming the header. aiohttp's own parser limit
    is set a few times higher (make_runner) and only catches the truly huge ones."""
    limit = request.app[STATE].config.limits.max_header_bytes
    for name, value in request.headers.items():
        if len(name) + len(value) > limit:
            raise APIError(431, f"header exceeds {limit} bytes", param=name[:64], code="header_too_large",
                           reason="invalid")
    return await handler(request)


def _json(obj: Any, status: int = 200) -> web.Response:
    return web.Response(status=status, body=json.dumps(obj).encode(), content_type="application/json")


async def health(request: web.Request) -> web.Response:
    return _json({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.draining:
        return _json({"ready": False, "reason": "draining"}, 503)
    rs = state.backend.ready()
    body = {"ready": rs.ready, "reason": rs.reason, **dict(rs.detail)}
    return _json(body, 200 if rs.ready else 503)


async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _model_card(request: web.Request, name: str) -> dict[str, Any]:
    """The OpenAI model object, plus what the registered workers run: the weight
    quantization, KV-cache dtype and LM head quantization (one value each, as registration refuses a worker
    whose compatibility hash differs; null before any worker has registered)."""
    state = request.app[STATE]
    config = state.config
    workers = state.backend.workers()

    def served(key: str) -> str | None:
        values = sorted({str(w[key]) for w in workers if key in w})
        return ",".join(values) if values else None

    return {"id": name, "object": "model", "created": request.app[_CREATED], "owned_by": "pdserve",
            "root": config.model_name, "max_model_len": config.max_model_len,
            "quantization": served("quantization"), "kv_cache_dtype": served("kv_cache_dtype"),
            "lm_head_quantization": served("lm_head_quantization")}


async def list_models(request: web.Request) -> web.Response:
    """Every served name, the primary one first (as vLLM lists --served-model-name)."""
    names = request.app[STATE].config.served_model_names
    cards = [_model_card(request, n) for n in names] + adapter_cards(request)
    return _json({"object": "list", "data": cards})


async def get_model(request: web.Request) -> web.Response:
    config = request.app[STATE].config
    name = request.match_info["model"]
    for card in adapter_cards(request):
        if card["id"] == name:
            return _json(card)
    if name not in config.served_model_names:
        raise APIError(404, f"The model '{name[:64]}' does not exist.", param="model", code="model_not_found")
    return _json(_model_card(request, name))


async def list_workers(request: web.Request) -> web.Response:
    check_admin(request)  # the fleet's addresses and compatibility hash are for operators only
    workers = [dict(w) for w in request.app[STATE].backend.workers()]
    return _json({"object": "list", "data": workers})


_CREATED: web.AppKey[int] = web.AppKey("pdserve_created", int)


def build_app(config: GatewayConfig, backend: GenerationBackend, tokenizer: Tokenizer,
              tracer: Tracer | None = None) -> web.Application:
    """The gateway app. The backend is started on app startup and closed on cleanup;
    with a tracer every generation request gets a span (gateway/tracing.py)."""
    app = web.Application(middlewares=[error_middleware, header_limit_middleware, auth_middleware])
    admission = AdmissionController(config.admission)
    prompts = PromptPool(config.tokenizer_threads, config.tokenizer_queue, config.admission.retry_after_s)
    app[STATE] = GatewayState(
        config=config, backend=backend, tokenizer=tokenizer, admission=admission,
        metrics=GatewayMetrics(admission, backend), prompts=prompts, tracer=tracer,
        loras=LoraAdapters(config.lora, config.served_model_names) if config.lora is not None else None,
    )
    app[_CREATED] = int(time.time())
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model:.+}", get_model)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/v1/workers", list_workers)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    install_roles(app)  # POST /admin/workers/{id}/role, flip metrics, the planner
    install_responses(app)  # the Responses API and its bounded store
    install_lora(app)  # POST /v1/load_lora_adapter, /v1/unload_lora_adapter, adapter metrics

    async def start_backend(_: web.Application) -> None:
        await backend.start()

    async def close_backend(_: web.Application) -> None:
        await backend.close()
        prompts.close()
        if tracer is not None:
            tracer.shutdown()  # exports the spans still queued

    app.on_startup.append(start_backend)
    app.on_cleanup.append(close_backend)
    return app


def make_runner(app: web.Application, config: GatewayConfig) -> GatewayRunner:
    """An AppRunner with the gateway's server settings: handlers are cancelled when the
    client disconnects (that is what aborts a request in the backend), connections are
    capped and timed (gateway/connections.py), and header sizes are bounded:
    header_limit_middleware answers 431 past the configured limit, aiohttp's parser a
    plain 400 past four times it."""
    parser_limit = 4 * config.limits.max_header_bytes + 1024
    dropped = app[STATE].metrics.connections_dropped
    return GatewayRunner(
        app,
        config.connections,
        retry_after_s=config.admission.retry_after_s,
        on_drop=lambda reason: dropped.labels(reason=reason).inc(),
        handler_cancellation=True,
        access_log=None,
        shutdown_timeout=1.0,  # graceful draining happened before cleanup
        max_line_size=parser_limit,
        max_field_size=parser_limit,
    )


async def serve_gateway(
    config: GatewayConfig,
    backend: GenerationBackend,
    tokenizer: Tokenizer,
    stop: asyncio.Event | None = None,
    tracer: Tracer | None = None,
) -> int:
    """Serve until `stop` is set (or SIGTERM/SIGINT), drain, clean up; return the exit code."""
    stop = stop or asyncio.Event()
    app = build_app(config, backend, tokenizer, tracer)
    runner = make_runner(app, config)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    host, port = runner.addresses[0][:2]
    warn_if_exposed(config)
    # The one line on stdout: launchers and tests read the URL from it.
    print(f"pdserve gateway listening on http://{host}:{port}", flush=True)
    log.info(json.dumps({"event": "listening", "host": host, "port": port, "model": config.model_name}))
    try:
        await stop.wait()
        state = app[STATE]
        state.start_draining()
        log.info(json.dumps({"event": "draining", "active": state.active, "timeout_s": config.drain_timeout_s}))
        drained = await state.wait_idle(config.drain_timeout_s)
        log.info(json.dumps({"event": "drained" if drained else "drain_timeout", "active": state.active}))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
    return 0


def warn_if_exposed(config: GatewayConfig) -> None:
    """Serving beyond loopback without an API key: anyone who can reach the port can use it."""
    if not config.api_keys and not is_loopback(config.host):
        log.warning(json.dumps({
            "event": "no_api_key", "host": config.host,
            "note": "serving off loopback without an API key: anyone who reaches this port can "
                    "generate; set --api-key-file or PDSERVE_API_KEYS",
        }))


def run_gateway(config: GatewayConfig, backend: GenerationBackend, tokenizer: Tokenizer,
                tracer: Tracer | None = None) -> int:
    """Blocking entry point for `pdserve gateway`: uvloop when available; returns the exit code."""
    coro = serve_gateway(config, backend, tokenizer, tracer=tracer)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return int(uvloop.run(coro))
