"""No client holds a slot, a socket or memory it does not use (gateway/connections.py):
streams whose client stops reading, --request-timeout over the whole response, slow
headers, slow bodies and the connection cap, over real sockets against a gateway on the
LocalBackend. Timeouts are small; every wait is on the condition, with a generous
deadline."""

from __future__ import annotations

import json
import select
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from gateway.config import AdmissionConfig, ConnectionLimits, GatewayConfig
from gateway.connections import GatewayRunner
from gateway.state import STATE
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from tests.e2e.cluster import metric_value
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

MODEL = "m"
DEADLINE_S = 60.0  # generous: the conditions below never hold without the feature


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("conn-model"))
    return Tokenizer.from_model_dir(d)


def gateway(tok: Tokenizer, backend: LocalBackend, **kwargs: object) -> GatewayThread:
    conns = kwargs.pop("connections", ConnectionLimits())
    config = GatewayConfig(model_name=MODEL, max_model_len=40000, connections=conns, **kwargs)  # type: ignore[arg-type]
    return GatewayThread(config, backend, tok)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> float:
    """Poll `cond` until true; the seconds it took. Fails after `timeout`."""
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
    return time.monotonic() - t0


def request_bytes(body: dict[str, object], path: str = "/v1/completions") -> bytes:
    data = json.dumps(body)
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n{data}").encode()


def never_reading_stream(port: int) -> socket.socket:
    """A streaming request whose client never reads a byte (a small receive window, so
    the gateway's output backs up quickly): big chunks (4 choices, 20 logprobs each)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    s.sendall(request_bytes({"model": MODEL, "prompt": "hi", "max_tokens": 30000, "stream": True,
                             "ignore_eos": True, "logprobs": 20, "n": 4}))
    return s


def closed_by_peer(s: socket.socket) -> bool:
    """True once the gateway has closed `s` (EOF or reset); reads whatever was sent."""
    s.setblocking(False)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
    finally:
        s.setblocking(True)


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    opened: list[socket.socket] = []
    yield opened
    for s in opened:
        s.close()


def in_flight(gw: GatewayThread) -> int:
    assert gw.app is not None
    return int(gw.call(lambda: gw.app[STATE].admission.in_flight))  # type: ignore[index]


def test_streams_never_read_release_their_slots(tok: Tokenizer, sockets: list[socket.socket]) -> None:
    """--max-in-flight 2, three clients that open streams and never read: each is cut after
    the idle-write timeout, its request aborted in the backend, and then a normal request
    is served."""
    backend = LocalBackend(tok)
    with gateway(tok, backend, admission=AdmissionConfig(max_in_flight=2),
                 connections=ConnectionLimits(idle_write_timeout_s=1.0)) as gw:
        sockets += [never_reading_stream(gw.port) for _ in range(3)]
        wait_for(lambda: in_flight(gw) == 2, "both slots held")
        wait_for(lambda: len(backend.aborted) == 3 and in_flight(gw) == 0, "every stream cut and aborted")
        assert sorted(backend.aborted) == sorted(backend.started) and not backend.finished
        r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3
        metrics = raw(gw.url, "GET", "/metrics").body.decode()
        assert metric_value(metrics, "llm_connections_dropped_total") == 3
        wait_for(lambda: all(closed_by_peer(s) for s in sockets), "every stalled connection closed")


def test_request_timeout_bounds_the_whole_response(tok: Tokenizer, sockets: list[socket.socket]) -> None:
    """With the idle-write cut far away, --request-timeout alone ends a stream its client
    does not read: the deadline covers writing, not only waiting for the backend."""
    backend = LocalBackend(tok)
    with gateway(tok, backend, request_timeout_s=2.0,
                 connections=ConnectionLimits(idle_write_timeout_s=600.0)) as gw:
        t0 = time.monotonic()
        sockets.append(never_reading_stream(gw.port))
        wait_for(lambda: len(backend.aborted) == 1 and in_flight(gw) == 0, "the stream cut at its deadline")
        assert time.monotonic() - t0 >= 2.0  # not before the deadline
        wait_for(lambda: closed_by_peer(sockets[0]), "the connection closed")
        r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert r.status == 200


def test_slow_headers_are_closed_within_the_header_timeout(tok: Tokenizer, sockets: list[socket.socket]) -> None:
    """Slowloris: 20 connections each sending one header line every 0.2 s (and one that
    sends nothing) are all closed within the header timeout + 5 s, API key or not."""
    timeout = 1.0
    with gateway(tok, LocalBackend(tok), api_keys=("sekrit",),
                 connections=ConnectionLimits(header_timeout_s=timeout)) as gw:
        t0 = time.monotonic()
        for _ in range(21):
            s = socket.create_connection(("127.0.0.1", gw.port))
            sockets.append(s)
        for s in sockets[:20]:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        open_ = set(range(21))
        n = 0
        while open_ and time.monotonic() - t0 < DEADLINE_S:
            n += 1
            for i in list(open_):
                if closed_by_peer(sockets[i]):
                    open_.discard(i)
                elif i < 20:
                    try:
                        sockets[i].sendall(f"X-Slow-{n}: {n}\r\n".encode())
                    except OSError:  # closed between the check and the send
                        open_.discard(i)
            select.select([], [], [], 0.2)
        took = time.monotonic() - t0
        assert not open_, f"{len(open_)} slow-header connections still open after {took:.1f}s"
        assert took <= timeout + 5.0
        r = raw(gw.url, "GET", "/health")
        assert r.status == 200


def test_slow_body_gets_408_within_the_body_timeout(tok: Tokenizer, sockets: list[socket.socket]) -> None:
    """A body dribbled a byte at a time is answered 408 (OpenAI's error shape) and the
    connection closed, within the body timeout + 5 s."""
    timeout = 1.0
    with gateway(tok, LocalBackend(tok), connections=ConnectionLimits(body_timeout_s=timeout)) as gw:
        for _ in range(10):
            s = socket.create_connection(("127.0.0.1", gw.port))
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100000\r\n\r\n{")
            sockets.append(s)
        t0 = time.monotonic()
        replies = {i: b"" for i in range(len(sockets))}
        done: set[int] = set()
        while len(done) < len(sockets) and time.monotonic() - t0 < DEADLINE_S:
            for i, s in enumerate(sockets):
                if i in done:
                    continue
                s.setblocking(False)
                try:
                    while chunk := s.recv(65536):
                        replies[i] += chunk
                    done.add(i)  # EOF
                except BlockingIOError:
                    s.sendall(b" ")
                except (ConnectionResetError, BrokenPipeError):
                    done.add(i)
                finally:
                    s.setblocking(True)
            select.select([], [], [], 0.2)
        took = time.monotonic() - t0
        assert len(done) == len(sockets) and took <= timeout + 5.0, f"{len(sockets) - len(done)} still open"
        for reply in replies.values():
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 408")
            assert json.loads(body)["error"]["code"] == "body_timeout"


ADMIN_TOKEN = "admin-token-for-tests-0123"


@pytest.mark.parametrize("route", ["admin", "lora"])
def test_the_admin_and_lora_routes_bound_their_body_in_time_too(tok: Tokenizer, route: str) -> None:
    """Their bodies are read as the OpenAI routes' are: a client that sends one byte of
    one and stops is answered 408 (OpenAI's shape) and closed after the body timeout."""
    from gateway.cluster import ClusterBackend
    from gateway.lora_adapters import GatewayLoraConfig

    conns = ConnectionLimits(body_timeout_s=1.0)
    if route == "admin":
        config = GatewayConfig(model_name=MODEL, max_model_len=256, admin_token=ADMIN_TOKEN, connections=conns)
        backend: object = ClusterBackend()
        path, auth = "/admin/workers/d1/role", f"Authorization: Bearer {ADMIN_TOKEN}\r\n"
    else:
        config = GatewayConfig(model_name=MODEL, max_model_len=256, lora=GatewayLoraConfig(), connections=conns)
        backend, path, auth = LocalBackend(tok), "/v1/load_lora_adapter", ""
    with GatewayThread(config, backend, tok) as gw, socket.create_connection(("127.0.0.1", gw.port)) as s:  # type: ignore[arg-type]
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: application/json\r\n"
                  "Content-Length: 100\r\n\r\n{".encode())
        s.settimeout(DEADLINE_S)  # the reply is due after the 1 s body timeout
        reply = b""
        while chunk := s.recv(65536):  # until the gateway closes the connection
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), head
    assert json.loads(body)["error"]["code"] == "body_timeout"


def test_connections_past_the_cap_get_503_and_the_cap_frees(tok: Tokenizer, sockets: list[socket.socket]) -> None:
    with gateway(tok, LocalBackend(tok), connections=ConnectionLimits(max_connections=4)) as gw:
        assert isinstance(gw._runner, GatewayRunner)
        server = gw._runner.guarded
        sockets += [socket.create_connection(("127.0.0.1", gw.port)) for _ in range(4)]
        wait_for(lambda: gw.call(lambda: server.open_connections) == 4, "4 connections open")
        extra = socket.create_connection(("127.0.0.1", gw.port))
        sockets.append(extra)
        extra.sendall(request_bytes({"model": MODEL, "prompt": "hi", "max_tokens": 2}))
        reply = b""
        while chunk := extra.recv(65536):
            reply += chunk
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in head
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        sockets[0].close()
        wait_for(lambda: gw.call(lambda: server.open_connections) == 3, "a connection freed")
        r = raw(gw.url, "POST", "/v1/completions", json_body={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status == 200
