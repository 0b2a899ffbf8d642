"""Publishing the prefix cache's block events in vLLM's format, off the step loop.

The main loop hands each tick's events to `publish`, which numbers the batch and puts
it on a bounded queue without waiting; a thread encodes it (wire.py) and sends it
on a ZeroMQ PUB socket. Nothing the subscribers do reaches the step loop:

- a subscriber that reads slowly fills its own PUB queue up to `hwm`, after which
  ZeroMQ drops *its* batches (PUB never blocks the sender);
- a publisher thread that falls behind fills the queue up to `max_queue_size`, after
  which a batch is dropped, counted and logged once. Batches are numbered when
  they are queued, so a dropped batch is a gap a subscriber sees.

With `replay_endpoint` a ROUTER socket resends the last `buffer_steps` batches from a
requested sequence number on (vLLM's protocol: the request is one 8-byte big-endian
frame after the REQ delimiter; each reply is (seq, payload), then (-1, b"")).
Sockets are made (and bound) in the constructor, so a bad or busy endpoint fails the
worker's start; after that only the thread touches them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import zmq
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from pdserve.common.queues import drained
from pdserve.worker.vllm_events.config import KVEventsConfig, binds
from pdserve.worker.vllm_events.wire import END_SEQ, WireEvent, encode_batch, seq_frame

log = logging.getLogger(__name__)

REPLAY_REQUEST_LIMIT = 256  # bytes: a replay request is an identity, a delimiter and 8 bytes


class _Batch(NamedTuple):
    seq: int
    ts: float
    events: Sequence[WireEvent]
    block_size: int


class PublisherCounts(NamedTuple):
    published: int  # batches sent
    dropped: int  # batches not sent: the queue was full
    replayed: int  # batches resent on a replay request


class KVEventPublisher:
    """One worker's event stream (every role; it outlives a role flip)."""

    def __init__(self, config: KVEventsConfig, context: zmq.Context[Any] | None = None) -> None:
        self.config = config
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = _attach(self._pub, config.endpoint)
        self._replay: zmq.Socket[Any] | None = None
        self.replay_endpoint: str | None = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.setsockopt(zmq.MAXMSGSIZE, REPLAY_REQUEST_LIMIT)
            self.replay_endpoint = _attach(self._replay, config.replay_endpoint)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[_Batch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = itertools.count()
        self._lock = threading.Lock()
        self._published = self._dropped = self._replayed = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info("KV events (vLLM format) on %s%s", self.endpoint,
                 f", replay on {self.replay_endpoint}" if self.replay_endpoint else "")

    # ---------------------------------------------------------------- main loop
    def publish(self, events: Sequence[WireEvent], block_size: int) -> bool:
        """Queue one batch (the events now belong to the publisher); False if dropped."""
        if not events:
            return True
        batch = _Batch(next(self._seq), time.time(), events, block_size)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            with self._lock:
                self._dropped += 1
                first = self._dropped == 1
            if first:
                log.warning("KV events: the publisher fell behind; batch %d dropped (further drops are "
                            "only counted: llm_kv_events_dropped_batches)", batch.seq)
            return False
        return True

    def counts(self) -> PublisherCounts:
        with self._lock:
            return PublisherCounts(self._published, self._dropped, self._replayed)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued batch is sent (tests, shutdown); False on timeout."""
        return drained(self._queue, timeout_s)

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), stop the thread, close the sockets."""
        self.flush(timeout_s)
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    # ------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                self._serve_replays()
            try:
                batch = self._queue.get(timeout=0.05 if self._replay is not None else None)
            except queue.Empty:
                continue
            try:
                if batch is None:
                    return
                self._send(batch)
            except Exception:  # a dead publisher would silently end the stream
                log.exception("KV events: a batch was not published")
            finally:
                self._queue.task_done()

    def _send(self, batch: _Batch) -> None:
        payload = encode_batch(batch.ts, batch.events, batch.block_size)
        self._buffer.append((batch.seq, payload))
        with self._lock:  # counted before it leaves: a subscriber that got it sees the count
            self._published += 1
        try:
            self._pub.send_multipart((self._topic, seq_frame(batch.seq), payload), copy=False)
        except zmq.ZMQError:
            with self._lock:
                self._published -= 1
            raise

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] or len(frames[2]) != 8:
                continue  # not a REQ asking for a sequence number: ignored
            client, start = frames[0], int.from_bytes(frames[2], "big")
            sent = 0
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((client, b"", seq_frame(seq), payload))
                    sent += 1
            with self._lock:  # counted before the end marker: whoever saw it sees the count
                self._replayed += sent
            self._replay.send_multipart((client, b"", END_SEQ, b""))


def _attach(sock: zmq.Socket[Any], endpoint: str) -> str:
    """Bind (ipc, wildcard, loopback) or connect `endpoint`; the address a subscriber
    uses (a bound port 0 resolved)."""
    if not binds(endpoint):
        sock.connect(endpoint)
        return endpoint
    sock.bind(endpoint)
    bound = sock.getsockopt(zmq.LAST_ENDPOINT)
    return bound.decode() if isinstance(bound, bytes) else str(bound)


class PublisherCollector(Collector):
    """`llm_kv_events_*`: the publisher's counters, read at scrape time."""

    def __init__(self, publisher: KVEventPublisher, labels: dict[str, str]) -> None:
        self._publisher = publisher
        self._labels = labels

    def collect(self) -> Iterator[Any]:
        counts = self._publisher.counts()
        names, values = list(self._labels), list(self._labels.values())
        for name, doc, value in (
            ("llm_kv_events_published_batches", "KV event batches published (vLLM format)", counts.published),
            ("llm_kv_events_dropped_batches", "KV event batches dropped: the publisher fell behind",
             counts.dropped),
            ("llm_kv_events_replayed_batches", "KV event batches resent on a replay request", counts.replayed),
        ):
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(values, value)
            yield family
