"""The KV plane under hostile peers, with real processes and sockets (loopback only):
with CURVE an unauthenticated client gets nothing accepted by a decode worker's KV
port; without it, random bytes and random well-formed-looking frames on the control
and KV ports leave every process alive and serving."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgpack
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from kv_transfer import wire
from kv_transfer.auth import split_address
from pdserve.common import protocol
from tests.e2e.cluster import Cluster, http
from tests.e2e.conftest import Reference

FUZZ_SECONDS = 10.0
FUZZ_MAX_MESSAGES = 4000
HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
MESSAGES = [m for m in vars(protocol).values()
            if isinstance(m, type) and issubclass(m, protocol.Message) and m.TAG]


def complete(c: Cluster, reference: Reference, prompt: str) -> None:
    """One greedy completion through the cluster, checked against the reference engine."""
    want = reference.text(reference.generate(reference.completion_ids(prompt), max_tokens=6, temperature=0.0)[0])
    status, out = http("POST", f"{c.url}/v1/completions",
                       {"model": reference.model_name, "prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert status == 200 and out["choices"][0]["text"] == want, out


def kv_endpoint(c: Cluster) -> tuple[str, bytes | None, str]:
    decode = next(w for w in c.worker_list() if w["role"] == "decode")
    endpoint, key = split_address(decode["kv_address"].partition("+")[2] or decode["kv_address"])
    assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
    return endpoint, key, str(decode["compat_hash"])


def test_kv_port_with_curve_refuses_unauthenticated_clients(log_dir: Path, reference: Reference) -> None:
    keys, allowed = log_dir / "keys", log_dir / "authorized"
    keys.mkdir()
    allowed.mkdir()
    _, gw_secret = zmq.auth.create_certificates(str(keys), "gateway")
    secrets = {name: zmq.auth.create_certificates(str(allowed), name)[1] for name in ("prefill", "decode")}
    _, rogue_secret = zmq.auth.create_certificates(str(keys), "rogue")

    c = Cluster(log_dir)
    try:
        c.start_gateway("--curve-secret-key", gw_secret, "--curve-authorized-keys", str(allowed))
        for role in ("prefill", "decode"):
            c.add_worker(role, "--curve-key", secrets[role], "--curve-server-key", str(keys / "gateway.key"),
                         "--curve-authorized-keys", str(allowed))
        c.wait_roles(prefill=1, decode=1)
        endpoint, server_key, compat = kv_endpoint(c)
        assert server_key is not None  # the receiver serves CURVE, and says with which key
        complete(c, reference, "secret handoff")  # KV moved over the CURVE socket

        rogue_public, rogue_key = zmq.auth.load_certificate(rogue_secret)
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            for curve in (None, (rogue_public, rogue_key)):  # no CURVE; a key the worker does not know
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 0)
                if curve is not None:
                    sock.curve_publickey, sock.curve_secretkey = curve
                    sock.curve_serverkey = server_key
                monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED)
                sock.connect(endpoint)
                sock.send(wire.encode(wire.Hello(compat, "")))
                sock.send(wire.encode(wire.Claim("xfer-rogue", "r", compat, (1,))))
                assert monitor.poll(15_000), "no handshake outcome"
                event = recv_monitor_message(monitor)["event"]
                assert event & HANDSHAKE_FAILED, f"handshake event {event}"
                assert sock.poll(0) == 0  # nothing came back: no HelloAck, no pool, no hash
        finally:
            ctx.destroy(linger=0)  # closes every socket, also after a failed assert
        c._wait(lambda: "KV receiver refused a peer" in c.workers[1].log(), "the decode worker's refusal log")
        assert all(w.alive() for w in c.workers)
        complete(c, reference, "still serving")
        c.wait_idle()
    finally:
        c.stop()


def random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "neg", "big", "float", "str", "bool", "none"] + (["list", "map"] if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randrange(0, 300)
    if kind == "neg":
        return -rng.randrange(1, 1 << 40)
    if kind == "big":
        return rng.randrange(1 << 40, 1 << 63)
    if kind == "float":
        return rng.choice([rng.random() * 1e6, float("nan"), float("inf"), -0.0])
    if kind == "str":
        return "".join(rng.choice("abcxyz-#/é\x00") for _ in range(rng.randrange(0, 40)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randrange(0, 6))]
    return {str(random_value(rng, 2)): random_value(rng, depth + 1) for _ in range(rng.randrange(0, 4))}


def control_frame(rng: random.Random) -> bytes:
    """A frame with the right magic, version and a real tag, its fields filled at random."""
    cls = rng.choice(MESSAGES)
    body = {f.name: random_value(rng) for f in dataclasses.fields(cls) if rng.random() < 0.9}
    return bytes(msgpack.packb([protocol.MAGIC, protocol.VERSION, cls.TAG, body], use_bin_type=True))


def kv_frames(rng: random.Random, compat: str) -> list[bytes]:
    """A KV header of a real type, plausible or random fields, sometimes a tensor frame."""
    tid = f"xfer-{rng.randrange(1 << 20):x}"
    blocks = tuple(rng.randrange(0, 300) for _ in range(rng.randrange(1, 5)))
    choice = rng.randrange(5)
    if choice == 0:
        header = wire.encode(wire.Hello(rng.choice([compat, "bogus"]), rng.choice(["", "pdkvlive_1_00"])))
    elif choice == 1:
        header = wire.encode(wire.Claim(tid, "r", rng.choice([compat, "bogus"]), blocks))
    elif choice == 2:
        nbytes = rng.randrange(0, 1 << 16)
        header = wire.encode(wire.Chunk(tid, "r", compat, blocks, rng.randrange(0, 4), rng.randrange(0, 5),
                                        nbytes, rng.randrange(1 << 64), rng.random() < 0.7))
        return [header, rng.randbytes(nbytes)] if rng.random() < 0.7 else [header]
    elif choice == 3:
        header = wire.encode(wire.Abort(tid, "fuzz"))
    else:
        header = bytes(msgpack.packb([wire.WIRE_VERSION, rng.randrange(0, 10)]
                                     + [random_value(rng) for _ in range(rng.randrange(0, 10))]))
    return [header]


def fuzz(control: str, kv: str, compat: str, rng: random.Random) -> int:
    """Send garbage to both ports until the time or message budget is spent; returns the count."""
    ctx: zmq.Context[Any] = zmq.Context()
    sent = 0
    socks: list[zmq.Socket[Any]] = []
    end = time.monotonic() + FUZZ_SECONDS
    try:
        while sent < FUZZ_MAX_MESSAGES and time.monotonic() < end:
            if sent % 200 == 0:  # fresh connections now and then: new peers, new identities
                for s in socks:
                    s.close(linger=0)
                socks = [ctx.socket(zmq.DEALER) for _ in range(2)]
                for s, address in zip(socks, (control, kv), strict=True):
                    s.setsockopt(zmq.SNDHWM, 100)
                    s.connect(address)
            if sent % 50 == 0:  # not even ZeroMQ: raw bytes on a plain TCP connection
                host, port = rng.choice([control, kv]).removeprefix("tcp://").rsplit(":", 1)
                with socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(rng.randbytes(rng.randrange(1, 4096)))
            kind = rng.randrange(4)
            if kind == 0:
                parts = [control_frame(rng)]
            elif kind == 1:
                parts = kv_frames(rng, compat)
            else:
                parts = [rng.randbytes(rng.randrange(0, 512)) for _ in range(rng.randrange(1, 4))]
            target = socks[0] if kind == 0 or (kind == 2 and rng.random() < 0.5) else socks[1]
            with contextlib.suppress(zmq.Again):  # the peer is not keeping up: drop it
                target.send_multipart(parts, flags=zmq.NOBLOCK)
            sent += 1
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.destroy(linger=0)  # closes every socket, also after a failed assert
    return sent


def test_fuzzed_control_and_kv_ports_leave_every_process_serving(log_dir: Path, reference: Reference) -> None:
    c = Cluster(log_dir, curve=False)  # the unauthenticated planes, as a loopback-only cluster may run
    try:
        c.start_gateway()
        c.add_worker("prefill")
        c.add_worker("decode", "--kv-transport", "tcp")
        c.wait_roles(prefill=1, decode=1)
        kv, _, compat = kv_endpoint(c)
        complete(c, reference, "before the storm")

        during: list[BaseException] = []

        def serve_during() -> None:
            try:
                complete(c, reference, "during the storm")
            except BaseException as e:  # reported below, in the test's own thread
                during.append(e)

        client = threading.Thread(target=serve_during)
        client.start()
        sent = fuzz(c.control, kv, compat, random.Random(20))
        client.join(120)
        assert not client.is_alive() and not during, during
        assert sent > 100

        assert c.gateway is not None and c.gateway.alive()
        assert all(w.alive() for w in c.workers), [w.log() for w in c.workers]
        assert len(c.worker_list()) == 2  # no phantom registered, nobody dropped
        # the garbage did reach both ports
        assert "dropped malformed frame" in c.gateway.log()
        assert "refused a KV handshake" in c.workers[1].log()
        complete(c, reference, "after the storm")
        c.wait_idle()
    finally:
        c.stop()
