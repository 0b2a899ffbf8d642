"""The worker runtime's main loop publishes load and gauges every tick: `/metrics` is
current at the next scrape, with no heartbeat in between, and only the main loop ever
reads the node's state (the heartbeat thread sends the latest snapshot). A heartbeat
lists each request that arrived once, in the first heartbeat whose load counts it."""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable

import zmq

from pdserve.common import protocol as p
from pdserve.common.hosts import free_port
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_events import BlockEventLog
from pdserve.worker.gateways import GatewayLinks
from pdserve.worker.metrics import WorkerMetrics
from pdserve.worker.node_api import NodeLoad, NodeRegistration
from pdserve.worker.runtime import RuntimeConfig, WorkerRuntime
from tests.observability.obs import value

TOTAL = 100
BLOCKS_PER_REQUEST = 10


class ScriptedNode:
    """A node whose used blocks the test sets; it records which threads read its load."""

    role = "decode"

    def __init__(self) -> None:
        self.used = 0
        self.steps = 0
        self.load_threads: set[str] = set()
        self.stepped = threading.Condition()
        self.log = BlockEventLog(16)

    def registration(self) -> NodeRegistration:
        return NodeRegistration("", "", "compat", TOTAL, 16)

    def handle(self, msg: p.Message) -> None:
        if isinstance(msg, p.RunRequest):
            self.used += BLOCKS_PER_REQUEST

    def step(self) -> bool:
        with self.stepped:
            self.steps += 1
            self.stepped.notify_all()
        return False

    def wait_steps(self, n: int) -> None:
        with self.stepped:
            target = self.steps + n
            assert self.stepped.wait_for(lambda: self.steps >= target, timeout=30), "the loop stopped ticking"

    def load(self) -> NodeLoad:
        self.load_threads.add(threading.current_thread().name)
        return NodeLoad(0, TOTAL - self.used, TOTAL, 1 if self.used else 0, 0)

    def busy(self) -> bool:
        return False

    def block_event_log(self) -> BlockEventLog:
        return self.log

    def cached_keys(self) -> list[int]:
        return []

    def close(self) -> None:
        pass


def run_in_main_thread(runtime: WorkerRuntime, node: ScriptedNode, body: Callable[[], None]) -> None:
    """The runtime installs signal handlers, so it runs here; `body` drives it from a thread."""
    errors: list[BaseException] = []

    def drive() -> None:
        try:
            body()
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)
        finally:
            runtime.request_stop()

    t = threading.Thread(target=drive, name="test-driver")
    t.start()
    assert runtime.run(node) == 0
    t.join(30)
    if errors:
        raise errors[0]


def test_gauges_are_current_at_the_next_scrape_without_a_heartbeat() -> None:
    gateway = f"tcp://127.0.0.1:{free_port()}"  # nothing listens: registration just queues
    port = free_port()
    config = RuntimeConfig((gateway,), "decode-test", metrics_port=port, heartbeat_s=3600.0)
    metrics = WorkerMetrics("decode", "decode-test")
    runtime = WorkerRuntime(config, GatewayLinks((gateway,), "decode-test"), metrics)
    node = ScriptedNode()
    url = f"http://127.0.0.1:{port}/metrics"

    def scrape() -> str:
        with urllib.request.urlopen(url, timeout=5) as r:
            return str(r.read().decode())

    def body() -> None:
        node.wait_steps(1)
        assert value(scrape(), "llm_kv_cache_usage_ratio") == 0.0
        node.used = 40
        node.wait_steps(2)  # a whole tick has run since the change
        text = scrape()
        assert value(text, "llm_kv_cache_usage_ratio") == 0.4
        assert value(text, "llm_kv_free_blocks") == TOTAL - 40
        assert value(text, "llm_current_batch_size") == 1
        node.used = 0
        node.wait_steps(2)
        assert value(scrape(), "llm_kv_cache_usage_ratio") == 0.0

    run_in_main_thread(runtime, node, body)
    assert node.load_threads == {threading.main_thread().name}


def test_heartbeats_report_each_arrival_once_with_a_load_that_counts_it() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)  # the gateway's end
    port = router.bind_to_random_port("tcp://127.0.0.1")
    gateway = f"tcp://127.0.0.1:{port}"
    config = RuntimeConfig((gateway,), "hb-test", metrics_port=free_port(), heartbeat_s=0.02)
    runtime = WorkerRuntime(config, GatewayLinks((gateway,), "hb-test"), WorkerMetrics("decode", "hb-test"))
    node = ScriptedNode()
    ids = ["a#1", "b#1", "c#1"]

    def next_message() -> p.Message:
        assert router.poll(30_000), "no message from the worker"
        return p.decode(router.recv_multipart()[1])

    def next_heartbeat() -> p.Heartbeat:
        while True:
            msg = next_message()
            if isinstance(msg, p.Heartbeat):
                return msg

    def body() -> None:
        seen: set[type] = set()
        while not {p.RegisterWorker, p.Heartbeat} <= seen:  # both of its sockets are connected
            seen.add(type(next_message()))
        for rid in ids:
            router.send_multipart([b"hb-test", p.encode(p.RunRequest(rid, p.RequestPayload([1, 2], SamplingParams())))])
        beats: list[p.Heartbeat] = []
        while sum(len(b.received or []) for b in beats) < len(ids):
            assert len(beats) < 500, "the arrivals were never reported"
            beats.append(next_heartbeat())
        beats += [next_heartbeat() for _ in range(3)]  # later heartbeats list nothing again
        assert [b.seq for b in beats] == list(range(beats[0].seq, beats[0].seq + len(beats)))
        listed: list[str] = []
        for b in beats:
            assert b.received is not None
            listed += b.received
            # The load of the heartbeat that lists a request already counts it.
            assert TOTAL - b.free_blocks == BLOCKS_PER_REQUEST * len(listed)
        assert listed == ids

    try:
        run_in_main_thread(runtime, node, body)
    finally:
        router.close(linger=0)


def test_a_wake_from_another_thread_before_the_idle_wait_ends_it_at_once() -> None:
    links = GatewayLinks((f"tcp://127.0.0.1:{free_port()}",), "wake-test")  # nothing listens
    try:
        assert links.wait(0) is False  # nothing came
        t = threading.Thread(target=links.wake)  # a KV tier read landing on the loader thread
        t.start()
        t.join(30)
        assert links.wait(60_000) is True  # level-triggered: a wake before the wait counts too
        assert links.wait(0) is False  # drained: one wake ends one wait
    finally:
        links.close()
    links.wake()  # after close: nothing, never an error on the loader thread


def test_a_wake_from_another_thread_ends_a_blocked_idle_wait() -> None:
    links = GatewayLinks((f"tcp://127.0.0.1:{free_port()}",), "wake-test")
    waiting, woken = threading.Event(), []
    def idle() -> None:
        waiting.set()
        woken.append(links.wait(600_000))  # without the wake: ten minutes, then False
    try:
        t = threading.Thread(target=idle)
        t.start()
        assert waiting.wait(30)
        links.wake()
        t.join(60)
        assert not t.is_alive() and woken == [True]
    finally:
        links.close()
    links.wake()  # after close: nothing, never an error on the loader thread
