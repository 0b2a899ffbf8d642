"""Several gateway replicas: workers register with every gateway (`--gateway`
repeated), each gateway routes to the whole fleet, replies go back to the
gateway a request came from, and losing one gateway leaves the other serving."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import zmq

from pdserve.common import protocol as p
from pdserve.common.hosts import free_port
from pdserve.worker.gateways import GatewayLinks, parse_gateway, resolve
from tests.e2e.cluster import Cluster, Proc, http, start, wait_for
from tests.e2e.conftest import Reference

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3, 4,", "Hello, my name is"]
MAX_TOKENS = 12


def _complete(url: str, model: str, prompt: str) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, out = http("POST", f"{url}/v1/completions", body, timeout=120)
    assert status == 200, out
    return dict(out)


def _expected(reference: Reference, prompt: str) -> str:
    ids = reference.generate(
        reference.completion_ids(prompt), max_tokens=MAX_TOKENS, temperature=0.0
    )[0]
    return reference.text(ids)


def test_workers_serve_every_gateway(log_dir: Path, reference: Reference) -> None:
    a, b = Cluster(log_dir / "a"), Cluster(log_dir / "b")
    for c in (a, b):
        c.log_dir.mkdir()
    workers: list[Proc] = []
    try:
        a.start_gateway()
        b.start_gateway()
        # The decode worker names the second gateway in the DNS form (localhost's A record).
        second = {"prefill": b.control, "decode": f"dns+tcp://localhost:{b.control_port}"}
        for role in ("prefill", "decode"):
            args = [role, "--gateway", a.control, "--gateway", second[role], "--threads", "1",
                    "--num-blocks", "256", "--heartbeat", "0.25"]
            workers.append(start(role, args, log_dir))
        a.workers = b.workers = workers
        for c in (a, b):
            listed = c.wait_roles(prefill=1, decode=1)
            assert {w["id"] for w in listed} == {w["id"] for w in a.worker_list()}

        expected = {prompt: _expected(reference, prompt) for prompt in PROMPTS}
        jobs = [(c, prompt) for prompt in PROMPTS for c in (a, b)]
        with ThreadPoolExecutor(len(jobs)) as pool:
            outs = list(pool.map(lambda j: _complete(j[0].url, reference.model_name, j[1]), jobs))
        for (_, prompt), out in zip(jobs, outs, strict=True):
            assert out["choices"][0]["text"] == expected[prompt], prompt
        a.wait_idle()
        b.wait_idle()

        # One gateway gone: the other keeps its workers and serves.
        assert a.gateway is not None
        a.gateway.signal(9)
        a.gateway.popen.wait(10)
        a.gateway = None
        for prompt in PROMPTS[:2]:
            assert (
                _complete(b.url, reference.model_name, prompt)["choices"][0]["text"]
                == expected[prompt]
            )
        assert sorted(w["role"] for w in b.worker_list()) == ["decode", "prefill"]
        assert all(w.alive() for w in workers), "a worker died with its gateway"
    finally:
        for w in workers:
            w.stop()
        a.workers = b.workers = []
        a.stop()
        b.stop()


# --- GatewayLinks against real ROUTER sockets, DNS answers faked ----------------


class _Gateway:
    """A bare ROUTER standing in for a gateway's control socket."""

    def __init__(self, ip: str, port: int) -> None:
        self.ip = ip
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        self.address = f"tcp://{ip}:{port}"
        self.sock.bind(self.address)
        self.sock.setsockopt(zmq.RCVTIMEO, 2000)

    def recv(self) -> tuple[str, p.Message]:
        ident, frame = self.sock.recv_multipart()
        return ident.decode(), p.decode(frame)

    def send(self, worker_id: str, msg: p.Message) -> None:
        self.sock.send_multipart([worker_id.encode(), p.encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)


def _recv(links: GatewayLinks) -> list[tuple[str, p.Message]]:
    for _ in range(100):
        links.wait(20)
        got = links.recv_all()
        if got:
            return got
    raise AssertionError("nothing arrived")


def test_links_follow_dns_and_route_replies_to_their_origin() -> None:
    # Two replicas behind one name: same port, two loopback addresses.
    port = free_port("127.0.0.2")
    g1, g2 = _Gateway("127.0.0.2", port), _Gateway("127.0.0.3", port)
    answer = {g1.ip}
    links = GatewayLinks([f"dns+tcp://gateways.test:{port}"], "decode-1", resolve_every_s=0.05,
                         retire_grace_s=0.3, resolver=lambda name, port: sorted(answer))
    try:
        added, _ = links.refresh()
        assert added == [g1.address]
        answer.add(g2.ip)
        wait_for(lambda: g2.address in links.addresses, "g2 linked", 5, 0.01, step=links.refresh)
        assert set(links.addresses) == {g1.address, g2.address}

        links.broadcast(p.Deregister("decode-1", final=False))  # both ROUTERs now know the identity
        assert g1.recv()[0] == g2.recv()[0] == "decode-1"
        g1.send("decode-1", p.StartDecode("r1", "x1", [1], [None]))
        g2.send("decode-1", p.StartDecode("r2", "x2", [2], [None]))
        got: list[tuple[str, p.Message]] = []
        while len(got) < 2:
            got += _recv(links)
        assert {(a, m.request_id) for a, m in got if isinstance(m, p.StartDecode)} == {
            (g1.address, "r1"), (g2.address, "r2")}

        deltas = [
            p.TokenDelta(0, [5], request_id="r1"),
            p.TokenDelta(0, [6], request_id="r2"),
            p.TokenDelta(0, [7], request_id="r9"),
        ]
        links.send(p.TokenBatch("decode-1", deltas))
        seen1 = [g1.recv()[1] for _ in range(2)]
        seen2 = [g2.recv()[1] for _ in range(2)]
        ids1 = sorted(d.request_id for m in seen1 if isinstance(m, p.TokenBatch) for d in m.deltas)
        ids2 = sorted(d.request_id for m in seen2 if isinstance(m, p.TokenBatch) for d in m.deltas)
        assert ids1 == ["r1", "r9"] and ids2 == ["r2", "r9"]  # unknown origin: every gateway

        answer.discard(g2.ip)  # g2 leaves DNS: kept for the grace period, then closed
        orphaned: list[str] = []
        wait_for(lambda: g2.address not in links.addresses, "g2 closed", 5, 0.02,
                 step=lambda: orphaned.extend(links.refresh()[1]))
        assert links.addresses == (g1.address,) and orphaned == ["r2"]
    finally:
        links.close()
        g1.close()
        g2.close()


def test_links_resolve_a_real_name_and_keep_gateways_on_lookup_failure() -> None:
    links = GatewayLinks(
        ["dns+tcp://localhost:5999", "tcp://127.0.0.1:6000"], "w", resolve_every_s=60
    )
    try:
        added, _ = links.refresh()
        assert added == ["tcp://127.0.0.1:5999", "tcp://127.0.0.1:6000"]
    finally:
        links.close()

    def failing(name: str, port: int) -> list[str]:
        raise OSError("lookup failed")

    assert resolve("dns+tcp://gateways.test:1", failing) is None
    for bad in ("127.0.0.1:5", "http://h:5", "tcp://h", "dns+tcp://:5", "tcp://h:5/x"):
        with pytest.raises(ValueError):
            parse_gateway(bad)
