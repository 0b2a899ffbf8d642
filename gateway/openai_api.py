"""`POST /v1/completions` and `POST /v1/chat/completions`.

The life of a request in the gateway:
1. parse: content type, body size, JSON, parameters (gateway/validation.py);
2. tokenize: a character-count check, then chat template + encoding in the prompt pool
   (gateway/prompts.py, gateway/prompt_pool.py), then the context-length check;
3. queue_wait: admission (gateway/admission.py) — 503 with Retry-After past the limits;
4. generate: `Generation.first()` waits for the first output, so errors before any
   output get a real status code; then the rest is streamed (SSE) or collected;
5. one JSON log line, histograms and counters, whatever the outcome.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from typing import Any

from aiohttp import web

from gateway import sse
from gateway.backend import BackendError, GenerateRequest
from gateway.body import json_body
from gateway.errors import APIError, from_backend, unavailable
from gateway.formatting import ResponseBuilder, usage
from gateway.generation import ChoiceUpdate, Generation
from gateway.prompt_echo import PromptView
from gateway.prompts import check_prompt_chars, encode_request, prompt_chars
from gateway.state import STATE, GatewayState
from gateway.timing import RequestTimer
from gateway.tool_calls import parser_factory
from gateway.tracing import RequestSpan
from gateway.validation import (
    CHAT,
    COMPLETION,
    ParsedRequest,
    check_prompt,
    parse_request,
)
from pdserve.common.lora import LoraRef

log = logging.getLogger("pdserve.gateway")

REQUEST_ID_HEADER = "x-request-id"
TIMINGS_HEADER = "x-pdserve-timings"
PRIORITY_HEADER = "x-pdserve-priority"
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
CLIENT_CLOSED = 499  # nginx's convention, for logs and metrics only
LOGGED_USER_CHARS = 64  # of the `user` field, in the request log line
RESPONSE_GRACE_S = 1.0  # past --request-timeout, before a stream whose client is not reading is cut


def request_id(request: web.Request) -> str:
    """The client's x-request-id when it is sane, else a fresh one."""
    rid = request.headers.get(REQUEST_ID_HEADER, "")
    return rid if _REQUEST_ID_RE.match(rid) else uuid.uuid4().hex


async def completions(request: web.Request) -> web.StreamResponse:
    return await RequestRun(request, COMPLETION).serve()


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await RequestRun(request, CHAT).serve()


class RequestRun:
    """One generation request, from body bytes to the last byte of the response.

    Other endpoints that are a chat request in another dress (gateway/responses/)
    reuse it, replacing `_parse` (body -> ParsedRequest) and the two writers
    (`_collect`, `_stream`); `endpoint` labels metrics and logs."""

    def __init__(self, request: web.Request, kind: str, endpoint: str | None = None) -> None:
        self.request = request
        self.kind = kind
        self.endpoint = endpoint or ("chat" if kind == CHAT else "completions")
        self.state: GatewayState = request.app[STATE]
        self.timer = RequestTimer()
        self.arrival = time.monotonic()
        self.rid = request_id(request)
        self.want_timings = request.headers.get(TIMINGS_HEADER, "").strip().lower() in ("1", "true", "yes")
        self.status = 200
        self.error: str | None = None
        self.parsed: ParsedRequest | None = None
        self.prompt_len = 0
        self.gen: Generation | None = None
        self.resp: web.StreamResponse | None = None  # a stream's response, once started
        self.queue_s: float | None = None
        tracer = self.state.tracer  # None unless --otlp-traces-endpoint: then one span per request
        self.trace = None if tracer is None else RequestSpan.start(
            tracer, request.headers, kind, request.path, self.state.config.model_name, self.rid)

    async def serve(self) -> web.StreamResponse:
        self.state.enter()
        try:
            return await self._serve()
        except APIError as e:
            self.status, self.error = e.status, e.code
            if e.reason:
                self.state.metrics.rejected.labels(reason=e.reason).inc()
            e.headers[REQUEST_ID_HEADER] = self.rid
            return e.response()
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels the handler): closing the generation
            # on the way out aborted the request in the backend.
            self.status, self.error = CLIENT_CLOSED, "client_disconnected"
            raise
        except Exception:
            # A bug: the error middleware answers a 500 envelope without the traceback.
            self.status, self.error = 500, "internal_error"
            raise
        finally:
            self.state.leave()
            self._record()

    async def _serve(self) -> web.StreamResponse:
        state = self.state
        if state.draining:
            raise unavailable("server is shutting down", "draining", state.config.admission.retry_after_s, "draining")
        with self.timer.measure("parse"):
            parsed = await self._parse()
        with self.timer.measure("tokenize"):
            parsed, ids = await self._tokenize(parsed)
        self.parsed, self.prompt_len = parsed, len(ids)
        with self.timer.measure("queue_wait"):
            admission = await state.admission.acquire(parsed.priority)
        try:
            state.metrics.queue_wait.labels(priority=parsed.priority).observe(admission.wait_s)
            self.queue_s = admission.wait_s
            bound = self._response_bound()
            if bound is None:
                return await self._generate(parsed, ids)
            end = time.monotonic() + bound
            try:
                return await asyncio.wait_for(self._generate(parsed, ids), bound)
            except asyncio.TimeoutError:
                if time.monotonic() < end:
                    raise  # not ours
                return self._cut_off()
        finally:
            state.admission.release()

    def _response_bound(self) -> float | None:
        """Seconds from now by which the whole response must be out: --request-timeout from
        arrival, plus a grace period. Waits for the backend end at the deadline itself with a
        clean 504 or error event; this bound catches the rest: writes to a client not reading."""
        timeout = self.state.config.request_timeout_s
        if timeout is None:
            return None
        return max(0.0, self.arrival + timeout + RESPONSE_GRACE_S - time.monotonic())

    def _cut_off(self) -> web.StreamResponse:
        """The response deadline passed: a stream already under way is cut (the connection is
        aborted: nothing more can be said on it); otherwise a 504."""
        self.status, self.error = 504, "deadline_exceeded"
        if self.resp is None:
            raise APIError(504, "request deadline exceeded", code="timeout", reason="timeout")
        if self.request.transport is not None:
            self.request.transport.abort()
        return self.resp

    async def _parse(self) -> ParsedRequest:
        config = self.state.config
        body = await json_body(self.request, config)
        loras = self.state.loras
        return parse_request(self.kind, body, config, self.request.headers.get(PRIORITY_HEADER),
                             loras if loras is not None else ())

    async def _tokenize(self, parsed: ParsedRequest) -> tuple[ParsedRequest, list[int]]:
        """Cheap checks on the loop, the template and tokenizer in the prompt pool."""
        state, tok, config = self.state, self.state.tokenizer, self.state.config
        chars = prompt_chars(parsed)
        check_prompt_chars(parsed, chars, config, tok)
        enc = await state.prompts.run(chars, lambda: encode_request(parsed, tok, config))
        parsed = check_prompt(parsed, enc.num_tokens, tok.vocab_size, config)
        assert enc.ids is not None, "check_prompt refuses every prompt past token_limit"
        return parsed, enc.ids

    async def _generate(self, parsed: ParsedRequest, ids: list[int]) -> web.StreamResponse:
        loras = self.state.loras
        if loras is None or parsed.model is None or parsed.model not in loras:
            return await self._generate_as(parsed, ids, None)
        lora = loras.acquire(parsed.model)  # pinned: it cannot be unloaded while it runs
        try:
            return await self._generate_as(parsed, ids, lora)
        finally:
            loras.release(parsed.model)

    async def _generate_as(self, parsed: ParsedRequest, ids: list[int], lora: LoraRef | None
                           ) -> web.StreamResponse:
        state = self.state
        timeout = state.config.request_timeout_s
        greq = GenerateRequest(
            request_id=self.rid,
            prompt_token_ids=ids,
            params=parsed.params,
            priority=parsed.priority,
            deadline=self.arrival + timeout if timeout is not None else None,
            lora=lora,
            traceparent=self.trace.traceparent if self.trace is not None else None,
        )
        self.gen = gen = Generation(
            state.backend, greq, state.tokenizer, self.timer,
            stop=parsed.stop, skip_special_tokens=parsed.skip_special_tokens,
            include_stop_str=parsed.include_stop_str,
            on_first_token=lambda: state.metrics.ttft.observe(self.timer.elapsed()),
        )
        shape = parsed.shape
        builder = ResponseBuilder(
            self.kind, self.rid, lora.name if lora else state.config.model_name, state.tokenizer, parsed.params.n,
            parsed.params.logprobs is not None,
            parser_factory(shape.tool_mode, shape.tool_name, state.config.tool_call_parser, shape.parallel),
            named_tool=shape.tool_mode == "named",
        )
        try:
            try:
                first = await gen.first()
            except BackendError as e:
                raise from_backend(e, state.config.admission.retry_after_s) from None
            builder.set_prompt(self._prompt_view(parsed, ids))
            if parsed.stream:
                return await self._stream(parsed, builder, first)
            return await self._collect(builder, first)
        finally:
            await gen.aclose()

    def _prompt_view(self, parsed: ParsedRequest, ids: list[int]) -> PromptView:
        assert self.gen is not None
        lps = self.gen.stats.prompt_logprobs
        text = parsed.prompt_text if parsed.prompt_text is not None else self.state.tokenizer.decode(ids)
        return PromptView(text, tuple(ids), tuple(lps) if lps is not None else None, parsed.echo)

    def _usage(self) -> dict[str, Any]:
        assert self.gen is not None
        s = self.gen.stats
        return usage(self.prompt_len, s.completion_tokens, s.cached_tokens)

    async def _gather(self, builder: ResponseBuilder, first: ChoiceUpdate | None) -> None:
        """Every update of a non-streamed generation into `builder`; a backend failure
        becomes the API error."""
        assert self.gen is not None
        if first is not None:
            builder.add(first)
        try:
            async for update in self.gen.rest():
                builder.add(update)
        except BackendError as e:
            raise from_backend(e, self.state.config.admission.retry_after_s) from None

    async def _collect(self, builder: ResponseBuilder, first: ChoiceUpdate | None) -> web.Response:
        await self._gather(builder, first)
        with self.timer.measure("respond"):
            body = json.dumps(builder.final(self._usage())).encode()
            headers = {REQUEST_ID_HEADER: self.rid}
        if self.want_timings:
            headers[TIMINGS_HEADER] = json.dumps(self.timer.result(), separators=(",", ":"))
        return web.Response(body=body, content_type="application/json", headers=headers)

    async def _stream(self, parsed: ParsedRequest, builder: ResponseBuilder, first: ChoiceUpdate | None) -> web.StreamResponse:
        assert self.gen is not None
        self.resp = resp = web.StreamResponse(headers={**sse.SSE_HEADERS, REQUEST_ID_HEADER: self.rid})
        try:
            with self.timer.measure("respond"):
                await resp.prepare(self.request)
                if self.kind == CHAT:
                    await resp.write(sse.event(builder.role_chunk()))
            await self._stream_events(parsed, builder, first, resp)
        except ConnectionResetError:
            # The client went away mid-stream; the caller closes the generation (abort).
            self.status, self.error = CLIENT_CLOSED, "client_disconnected"
        return resp

    async def _stream_events(
        self, parsed: ParsedRequest, builder: ResponseBuilder, first: ChoiceUpdate | None, resp: web.StreamResponse
    ) -> None:
        assert self.gen is not None
        update = first
        updates = self.gen.rest()
        try:
            while update is not None:
                with self.timer.measure("respond"):
                    await resp.write(sse.event(builder.chunk(update)))
                update = await anext(updates, None)
        except BackendError as e:
            # Streaming already started: the status is sent, so the error is the last event.
            err = from_backend(e, self.state.config.admission.retry_after_s)
            self.status, self.error = err.status, err.code
            await resp.write(sse.event(err.body()))
            await resp.write(sse.DONE)
            return
        with self.timer.measure("respond"):
            if parsed.include_usage or self.want_timings:
                usage_obj = self._usage() if parsed.include_usage else None
                timings = self.timer.result() if self.want_timings else None
                await resp.write(sse.event(builder.final_chunk(usage_obj, timings)))
            await resp.write(sse.DONE)
            await resp.write_eof()

    def _record(self) -> None:
        """Metrics and the per-request JSON log line, whatever the outcome."""
        m = self.state.metrics
        timings = self.timer.result()
        endpoint = self.endpoint
        m.requests.labels(endpoint=endpoint, status=str(self.status)).inc()
        record: dict[str, Any] = {
            "event": "request", "request_id": self.rid, "endpoint": endpoint, "status": self.status,
        }
        if self.error:
            record["error"] = self.error
        if self.parsed is not None:
            record.update(priority=self.parsed.priority, stream=self.parsed.stream, n=self.parsed.params.n,
                          prompt_tokens=self.prompt_len, user=(self.parsed.user or "")[:LOGGED_USER_CHARS] or None)
        if self.gen is not None:
            s = self.gen.stats
            m.prompt_tokens.inc(self.prompt_len)
            m.generation_tokens.inc(s.completion_tokens)
            m.cached_tokens.inc(s.cached_tokens)
            m.e2e.observe(timings["e2e"])
            m.observe_stages(timings)
            n = self.parsed.params.n if self.parsed is not None else 1
            per_choice = s.completion_tokens / n  # choices decode side by side
            if s.first_token_at is not None and s.last_token_at is not None and per_choice > 1:
                m.tpot.observe((s.last_token_at - s.first_token_at) / (per_choice - 1))
            record.update(completion_tokens=s.completion_tokens, cached_tokens=s.cached_tokens,
                          finish_reasons=[s.finish_reasons.get(i) for i in range(n)])
        record["timings"] = {k: round(v, 6) for k, v in timings.items()}
        log.info(json.dumps(record, separators=(",", ":")))
        if self.trace is not None:
            self._end_span(timings["e2e"])

    def _end_span(self, e2e_s: float) -> None:
        assert self.trace is not None
        parsed, s = self.parsed, (self.gen.stats if self.gen is not None else None)
        if parsed is not None:
            p = parsed.params
            self.trace.parsed(self.state.config.model_name, p.max_tokens, p.n, p.temperature, p.top_p,
                              parsed.stream, self.prompt_len)
        n = parsed.params.n if parsed is not None else 1
        ttft = s.first_token_at - self.timer.start if s is not None and s.first_token_at is not None else None
        self.trace.end(self.status, self.error, s.completion_tokens if s is not None else None,
                       s.cached_tokens if s is not None else 0,
                       [s.finish_reasons.get(i) for i in range(n)] if s is not None else [],
                       ttft, self.queue_s, e2e_s)
