"""`POST /v1/responses`, `GET /v1/responses/{id}`, `DELETE /v1/responses/{id}`.

A Responses request runs the chat path (gateway/openai_api.py `RequestRun`: the
same validation, chat template, admission, generation, tool-call parsing, metrics and
log line); only the body is read differently (gateway/responses/request.py) and the
output written differently (a Response object, or its event stream). With `store`
(the default, as in OpenAI's API) the finished response and its conversation are
kept in the gateway's bounded store for `previous_response_id`.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from gateway import sse
from gateway.backend import BackendError
from gateway.body import json_body
from gateway.errors import APIError, from_backend
from gateway.formatting import ResponseBuilder
from gateway.generation import ChoiceUpdate
from gateway.openai_api import PRIORITY_HEADER, REQUEST_ID_HEADER, RequestRun
from gateway.responses.events import ResponseEvents
from gateway.responses.output import (
    ResponseShell,
    conversation_turns,
    output_items,
    status_of,
    usage,
)
from gateway.responses.request import ResponsesRequest, renamed, translate
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.state import STATE
from gateway.validation import CHAT, ParsedRequest, parse_request

STORE: web.AppKey[ResponseStore] = web.AppKey("pdserve_responses_store", ResponseStore)


def install_responses(app: web.Application) -> None:
    """The routes and the store (its evictions counted in `llm_responses_evicted_total`)."""
    state = app[STATE]
    evicted = Counter("llm_responses_evicted", "Stored responses evicted from the bounded store.",
                      registry=state.metrics.registry)
    app[STORE] = ResponseStore(state.config.responses_store_size, evicted.inc)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{id}", get_response)
    app.router.add_delete("/v1/responses/{id}", delete_response)


async def create_response(request: web.Request) -> web.StreamResponse:
    return await _ResponsesRun(request).serve()


def _not_found(rid: str) -> APIError:
    return APIError(404, f"Response with id {rid[:64]!r} not found.", param="response_id", code="response_not_found")


async def get_response(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    stored = request.app[STORE].get(rid)
    if stored is None:
        raise _not_found(rid)
    return web.json_response(stored.response)


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["id"]
    if not request.app[STORE].delete(rid):
        raise _not_found(rid)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})


class _ResponsesRun(RequestRun):
    def __init__(self, request: web.Request) -> None:
        super().__init__(request, CHAT, endpoint="responses")
        self.store = request.app[STORE]
        self.req: ResponsesRequest | None = None
        self.shell: ResponseShell | None = None

    async def _parse(self) -> ParsedRequest:
        config = self.state.config
        self.req = req = translate(await json_body(self.request, config), self.store.get)
        try:
            parsed = parse_request(CHAT, req.chat_body, config, self.request.headers.get(PRIORITY_HEADER))
        except APIError as e:
            raise renamed(e) from None
        self.shell = ResponseShell("resp_" + self.rid, config.model_name, req.echo, req.store)
        return parsed

    def _keep(self, output: list[dict[str, Any]], response: dict[str, Any]) -> None:
        assert self.req is not None
        if self.req.store:
            turns = (*self.req.conversation, *conversation_turns(output))
            self.store.put(response["id"], StoredResponse(response, turns))

    async def _collect(self, builder: ResponseBuilder, first: ChoiceUpdate | None) -> web.Response:
        assert self.gen is not None and self.shell is not None
        await self._gather(builder, first)
        with self.timer.measure("respond"):
            s = self.gen.stats
            choice = builder.final({})["choices"][0]
            output = output_items(choice["message"], choice["finish_reason"])
            response = self.shell.body(status_of(output), output,
                                       usage(self.prompt_len, s.completion_tokens, s.cached_tokens))
            self._keep(output, response)
        return web.Response(body=json.dumps(response).encode(), content_type="application/json",
                            headers={REQUEST_ID_HEADER: self.rid})

    async def _stream(self, parsed: ParsedRequest, builder: ResponseBuilder,
                      first: ChoiceUpdate | None) -> web.StreamResponse:
        assert self.gen is not None and self.shell is not None
        resp = web.StreamResponse(headers={**sse.SSE_HEADERS, REQUEST_ID_HEADER: self.rid})
        events = ResponseEvents(self.shell)
        try:
            await resp.prepare(self.request)
            await self._write(resp, events.start())
            update, updates = first, self.gen.rest()
            try:
                while update is not None:
                    choice = builder.chunk(update)["choices"][0]
                    await self._write(resp, events.delta(choice.get("delta", {}), choice["finish_reason"]))
                    update = await anext(updates, None)
            except BackendError as e:
                err = from_backend(e, self.state.config.admission.retry_after_s)
                self.status, self.error = err.status, err.code
                await self._write(resp, [events.error(err.body())])
                return resp
            s = self.gen.stats
            done = events.finish(usage(self.prompt_len, s.completion_tokens, s.cached_tokens))
            self._keep(events.output, done["response"])
            await self._write(resp, [done])
            await resp.write_eof()
        except ConnectionResetError:
            self.status, self.error = 499, "client_disconnected"
        return resp

    async def _write(self, resp: web.StreamResponse, events: list[dict[str, Any]]) -> None:
        with self.timer.measure("respond"):
            for ev in events:
                await resp.write(f"event: {ev['type']}\n".encode() + sse.event(ev))
