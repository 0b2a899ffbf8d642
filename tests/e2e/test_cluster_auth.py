"""A default `pdserve up` under a hostile peer on the same host, with real processes
and sockets (docs/security.md):

* a fake worker (a plain ZeroMQ DEALER sending `RegisterWorker` and heartbeats as a
  worker would, with the real compatibility hash and a huge free-block count; and the
  same with a CURVE key nobody authorized) is refused, and no prompt token reaches it;
* a plain unauthenticated ZeroMQ handshake to every internal port fails -- the ports
  are read from /proc, so a port nobody thought of is caught too;
* the keys are private files, and no key is on any process's command line or in its
  environment;
* an oversize frame on a control port is dropped by the socket: the connection goes,
  the gateway's peak RSS does not grow by the frame.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth

from kv_transfer.auth import split_address
from tests.e2e import peers
from tests.e2e.cluster import ADMIN, DTYPE, Cluster, http, wait_for
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up

SECRET_PROMPTS = [f"Note {i}: my secret password is" for i in range(3)]
OVERSIZE = 64 << 20  # twice the control plane's 32 MiB cap
OVERSIZE_FRAMES = 4


@dataclass(frozen=True)
class Up:
    url: str  # .../v1
    pid: int
    control: str  # tcp://127.0.0.1:PORT
    key_dir: Path

    def workers(self) -> list[dict[str, Any]]:
        status, body = http("GET", f"{self.url}/workers", headers=ADMIN, timeout=5)
        assert status == 200, body
        return list(body["data"])


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    log = tmp_path_factory.mktemp("up_auth") / "up.log"
    key_dir: Path | None = None
    with pdserve_up(log, "--num-blocks", "256", "--threads", "1", "--dtype", DTYPE) as served:
        gateway = next(pid for pid in peers.children(served.pid) if "gateway" in peers.cmdline(pid))
        args = peers.cmdline(gateway)
        key_dir = Path(peers.flag(args, "--curve-secret-key")).parent
        yield Up(served.url, served.pid, f"tcp://127.0.0.1:{peers.flag(args, '--control-port')}", key_dir)
    assert key_dir is not None and not key_dir.exists(), "up left its keys behind"


def test_fake_workers_are_refused_and_read_no_prompt(up: Up, reference: Reference) -> None:
    real = up.workers()
    assert sorted(w["role"] for w in real) == ["decode", "prefill"]
    decode = next(w for w in real if w["role"] == "decode")
    fakes = peers.FakeWorkers(up.control, str(decode["compat_hash"]), int(decode["block_size"]),
                              str(up.key_dir / "gateway.key"))
    try:
        fakes.wait_refused()
        for prompt in SECRET_PROMPTS:
            want = reference.text(reference.generate(reference.completion_ids(prompt), max_tokens=6,
                                                     temperature=0.0)[0])
            status, out = http("POST", f"{up.url}/completions",
                               {"model": reference.model_name, "prompt": prompt, "max_tokens": 6,
                                "temperature": 0})
            assert status == 200 and out["choices"][0]["text"] == want, out  # the real workers answered
        assert sorted(w["id"] for w in up.workers()) == sorted(w["id"] for w in real)
        fakes.assert_got_nothing()
    finally:
        fakes.close()


def test_every_internal_port_refuses_an_unauthenticated_handshake(up: Up) -> None:
    pids = [up.pid, *peers.children(up.pid)]
    ports = peers.listening(pids)
    workers = up.workers()
    http_port = int(up.url.rsplit(":", 1)[1].split("/")[0])
    metrics_ports = {int(w["metrics_port"]) for w in workers}
    kv = {w["id"]: split_address(str(w["kv_address"]).partition("+")[2] or str(w["kv_address"]))
          for w in workers if w["kv_address"]}
    assert kv and all(key is not None for _, key in kv.values()), kv  # every receiver serves CURVE
    # ZeroMQ endpoints: every listening socket but the HTTP ones (gateway API, worker probes).
    control_port = int(up.control.rsplit(":", 1)[1])
    assert ports.tcp_ports - {http_port} - metrics_ports == {control_port} | {
        int(e.rsplit(":", 1)[1]) for e, _ in kv.values() if e.startswith("tcp://")}
    endpoints = [up.control, *(f"ipc://{path}" for path in ports.unix_paths),
                 *(e for e, _ in kv.values() if e.startswith("tcp://"))]
    assert {e for e, _ in kv.values()} <= set(endpoints)
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        probes = [peers.Peer(ctx, e) for e in endpoints]
        for probe in probes:
            probe.send(b"hello?")
        wait_for(lambda: all(pr.handshake_failed() for pr in probes),
                 lambda: {e: pr.events for e, pr in zip(endpoints, probes, strict=True)}, 30)
        assert not any(pr.handshake_succeeded() or pr.received() for pr in probes)
    finally:
        ctx.destroy(linger=0)


def test_keys_are_private_files_and_never_on_a_command_line(up: Up) -> None:
    assert stat.S_IMODE(up.key_dir.stat().st_mode) == 0o700
    files = [f for f in up.key_dir.rglob("*") if f.is_file()]
    assert {f.name for f in files} >= {"gateway.key", "gateway.key_secret", "worker.key", "worker.key_secret"}
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600 and f.stat().st_uid == os.getuid(), f
    keys = [line.split('"')[1] for f in files for line in f.read_text().splitlines() if "-key = " in line]
    assert len(keys) >= 6
    for pid in [up.pid, *peers.children(up.pid)]:
        seen = " ".join(peers.cmdline(pid)) + peers.environ(pid)
        assert not any(k in seen for k in keys), peers.cmdline(pid)


def test_an_oversize_control_frame_is_dropped_by_the_socket(log_dir: Path) -> None:
    c = Cluster(log_dir, curve=False)  # the attacker must get past the handshake to send at all
    try:
        c.start_gateway()
        assert c.gateway is not None
        pid = c.gateway.popen.pid
        ctx: zmq.Context[Any] = zmq.Context()
        try:
            peer = peers.Peer(ctx, c.control, b"big-sender")
            wait_for(peer.handshake_succeeded, lambda: peer.events, 30, 0.05)
            before = peers.rss_peak_bytes(pid)
            frame = zmq.Frame(bytes(OVERSIZE))
            for _ in range(OVERSIZE_FRAMES):
                peer.sock.send(frame, copy=False)
            # The gateway's socket drops the connection at the frame's size header; the
            # DEALER reconnects and sends the next one, dropped the same way.
            wait_for(lambda: peer.events.count(zmq.EVENT_DISCONNECTED) >= OVERSIZE_FRAMES, lambda: peer.events,
                     90, 0, step=lambda: peer.pump_events(200))
        finally:
            ctx.destroy(linger=0)
        assert peers.rss_peak_bytes(pid) - before < OVERSIZE // 2
        assert c.gateway.alive() and http("GET", f"{c.url}/health", timeout=5)[0] == 200
    finally:
        c.stop()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_3000_kv_hellos_naming_a_lock_leave_the_decode_worker_bounded(log_dir: Path, reference: Reference) -> None:
    """The issue's reproduction against a real decode worker: 3,000 peers each send one
    Hello naming a live liveness lock, then go. Each used to leave a descriptor open in
    the worker; now at most the table's capacity, and none once the lock is released."""
    from kv_transfer import wire
    from kv_transfer.liveness_table import DEFAULT_CAPACITY
    from kv_transfer.pool.shm import LivenessLock

    c = Cluster(log_dir, curve=False)  # CURVE would refuse these peers before any Hello
    lock = LivenessLock()
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        c.start_gateway(wait=False)
        c.add_worker("prefill")
        c.add_worker("decode")
        c.wait_gateway()
        decode = next(w for w in c.wait_roles(prefill=1, decode=1) if w["role"] == "decode")
        kind, _, endpoint = str(decode["kv_address"]).partition("+")
        assert kind == "shm", decode["kv_address"]  # shared memory: the senders name liveness locks
        pid, compat = int(decode["pid"]), str(decode["compat_hash"])
        baseline = _fds(pid)
        for _ in range(30):
            socks = [ctx.socket(zmq.DEALER) for _ in range(100)]  # 100 new peers at a time
            for s in socks:
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                s.send(wire.encode(wire.Hello(compat, lock.name)))
            for s in socks:
                assert s.poll(20_000), "no HelloAck"
                s.recv()
                s.close()
        wait_for(lambda: _fds(pid) - baseline <= DEFAULT_CAPACITY + 16, "the peers' descriptors closed")
        lock.close()  # the peer goes for good
        wait_for(lambda: _fds(pid) - baseline <= 16, "the liveness descriptors released")
        status, out = http("POST", f"{c.url}/v1/completions",
                           {"model": reference.model_name, "prompt": "after the flood", "max_tokens": 4,
                            "temperature": 0})
        assert status == 200, out
        c.wait_idle()
    finally:
        lock.close()
        ctx.destroy(linger=0)
        c.stop()
