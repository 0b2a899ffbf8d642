"""KV-transfer micro-benchmark: one request's KV, prefill process -> decode process.

For each model shape and transport, a decode-side receiver runs in its own
process (as in deployment); this process is the prefill side. One run = begin
-> send_all -> the sender sees the receiver's ack of the complete, verified
transfer: that is the per-request handoff latency. GB/s = KV bytes / latency.
A numpy memcpy of the same source bytes is timed (best of 5) before and after the
runs; "% memcpy" = the faster memcpy's time / the median transfer time.
"GB/s per CPU-s" = KV bytes / CPU seconds of the busier process (medians): what
the pipeline would sustain with a core per side, and much less sensitive than
wall time to other load on a shared machine.

    .venv/bin/python -m bench.kv_transfer                  # both shapes, all transports
    .venv/bin/python -m bench.kv_transfer --tokens 1024 --runs 3 --transports shm ipc
    .venv/bin/python -m bench.kv_transfer --copy-threads 2     # helper copy threads per side
    python -m bench.kv_transfer --transports cuda cuda-tcp --output-json kv.json   # on a GPU

`cuda`: device pools on both sides, CUDA IPC (same host); `cuda-tcp`: device pools on both
sides over plain tcp, the path between GPU pods (staged through host memory). A transport
that fails (absent, or refused by this build) is reported as failed and the others still
run; the exit status is then 1.
"""

from __future__ import annotations

import multiprocessing
import statistics
import sys
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from bench import harness
from kv_transfer.api import TransferState
from kv_transfer.checksum import frame_checksum
from kv_transfer.links import ZmqLinkFactory
from kv_transfer.pool import hostcopy
from kv_transfer.pool.copy_threads import DEFAULT_COPY_THREADS
from kv_transfer.pool.shm import create_shm_pool
from kv_transfer.receiver.receiver import ZmqReceiver
from kv_transfer.sender.sender import DEFAULT_CHUNK_BYTES, DEFAULT_SHM_CHUNK_BYTES, Sender
from pdserve.common.kv_layout import KVLayout

SHAPES = {
    "llama-125m": KVLayout(
        "bench-125m", num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="float16"
    ),
    "llama3-8b": KVLayout(
        "bench-8b", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16"
    ),
}
TRANSPORTS = ["shm", "ipc", "tcp", "cuda", "cuda-tcp"]
DEVICE_TRANSPORTS = {"cuda": "cuda", "cuda-tcp": "tcp"}  # bench name -> receiver transport
DEFAULT_TRANSPORTS = ["shm", "ipc", "tcp"]  # "cuda" needs cupy and a GPU (bench/gpu_check.sh)


class Memcpy:
    """A plain copy of the transfer's source bytes into a buffer of the same size: host
    memcpy, or device-to-device for a device pool."""

    def __init__(self, source: Any, nbytes: int) -> None:
        self.device = not isinstance(source, np.ndarray)
        self._src = source.reshape(-1).view("uint8")[:nbytes]
        self._dst = self._src.copy()

    def copy(self) -> None:
        self._dst[...] = self._src
        if self.device:
            import cupy

            cupy.cuda.runtime.deviceSynchronize()

    def seconds(self, repeats: int = 3) -> float:
        """Best of `repeats` copies (the first may fault pages in)."""
        return harness.fastest(self.copy, repeats)


def receiver_main(shape: str, transport: str, num_blocks: int, conn: Connection,
                  copy_threads: int = DEFAULT_COPY_THREADS) -> None:
    """Decode side: serve `expect`/`forget` requests over a pipe until told to stop."""
    layout = SHAPES[shape]
    shm = create_shm_pool(layout, num_blocks) if transport == "shm" else None
    pool: Any = shm if shm is not None else np.zeros(layout.pool_shape(num_blocks), np.float16)
    if transport in DEVICE_TRANSPORTS:
        from kv_transfer.pool.cuda_ipc import create_cuda_pool

        pool = create_cuda_pool(layout, num_blocks)
    wire = DEVICE_TRANSPORTS.get(transport, transport)
    with ZmqReceiver(layout, pool, transport=wire, copy_threads=copy_threads) as receiver:
        conn.send(receiver.address)
        cpu0 = 0.0
        while True:
            cmd = conn.recv()
            if cmd[0] == "stop":
                break
            if cmd[0] == "expect":
                receiver.expect(cmd[1], "bench", cmd[2], lease_s=120)
                cpu0 = time.process_time()
                conn.send("ok")
            else:  # report success and this process's CPU seconds for the transfer
                ok = receiver.poll(cmd[1]) is TransferState.COMPLETE
                receiver.forget(cmd[1])
                conn.send((ok, time.process_time() - cpu0))
    if shm is not None:
        shm.close()
        shm.unlink()


def checksum_gbps(nbytes: int, rows: int, repeats: int = 5) -> tuple[float, float]:
    """GB/s of the frame checksum used on the wire, and of zlib.crc32, on `nbytes`."""
    frame = np.random.default_rng(1).integers(0, 255, nbytes, dtype=np.uint8)
    ours = harness.fastest(lambda: frame_checksum(frame, rows), repeats)
    return nbytes / ours / 1e9, nbytes / harness.fastest(lambda: zlib.crc32(frame.data), repeats) / 1e9


# How often the benchmark looks for the ack (its own granularity, added to every latency).
POLL_S = 0.0002
WARMUP_RUNS = 2  # connect, handshake, map the peer's pool and fault in every page first


@dataclass(frozen=True)
class Result:
    nbytes: int  # KV bytes of one request
    latency_s: float  # median wall time, begin -> sender sees the ack
    data_s: float  # median wall time, grant -> ack: the data phase alone
    cpu_s: float  # median CPU seconds of the busier side (sender or receiver process)
    memcpy_s: float  # the best memcpy of the same bytes, timed before and after the runs

    @property
    def gbps(self) -> float:
        return self.nbytes / self.latency_s / 1e9

    @property
    def data_gbps(self) -> float:
        return self.nbytes / self.data_s / 1e9

    @property
    def cpu_gbps(self) -> float:
        return self.nbytes / self.cpu_s / 1e9

    @property
    def memcpy_gbps(self) -> float:
        return self.nbytes / self.memcpy_s / 1e9

    @property
    def ratio(self) -> float:
        """Of memcpy's speed (1.0 = as fast as memcpy), begin -> ack."""
        return self.memcpy_s / self.latency_s

    @property
    def data_ratio(self) -> float:
        return self.memcpy_s / self.data_s


RUN_TIMEOUT_S = 60.0  # one transfer; a stuck one fails the transport, not the whole run


def _wait(sender: Sender, tid: str, done: Any, transport: str) -> TransferState:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not done(state := sender.poll(tid)):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{transport}: still {state.name} after {RUN_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    return state


def bench_one(shape: str, transport: str, tokens: int, runs: int,
              chunk_bytes: int = DEFAULT_CHUNK_BYTES,
              copy_threads: int = DEFAULT_COPY_THREADS,
              shm_chunk_bytes: int = DEFAULT_SHM_CHUNK_BYTES) -> Result:
    """Median handoff latency and bandwidth of one transport and shape."""
    layout = SHAPES[shape]
    n = -(-tokens // layout.block_size)
    nbytes = n * layout.num_layers * layout.block_bytes_per_layer
    rng = np.random.default_rng(0)
    src_pool = rng.integers(0, 1 << 15, layout.pool_shape(n + 1), dtype=np.int16).view(np.float16)
    src_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    dst_ids = [int(b) for b in rng.permutation(np.arange(1, n + 1))]
    source: Any = src_pool
    if transport in DEVICE_TRANSPORTS:
        import cupy

        source = cupy.asarray(src_pool)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver_main,
                       args=(shape, transport, n + 1, child, copy_threads))
    proc.start()
    child.close()  # the receiver's end: its exit now ends `recv` with EOFError, never a hang
    try:
        address = parent.recv()
    except EOFError:
        proc.join(30)
        raise RuntimeError(f"{transport}: the receiver process exited ({proc.exitcode}) "
                           "before it listened") from None
    times: list[float] = []
    data: list[float] = []
    cpu: list[float] = []
    # Timed apart from the runs: a copy of this size just before a run measurably slows
    # that run on a shared VM. Best of before and after: the faster baseline.
    memcpy = Memcpy(source, nbytes)
    base = memcpy.seconds(5)
    try:
        with Sender(layout, source, links=ZmqLinkFactory(), chunk_bytes=chunk_bytes,
                    shm_chunk_bytes=shm_chunk_bytes, copy_threads=copy_threads) as sender:
            for i in range(runs + WARMUP_RUNS):
                tid = f"t{i}"
                parent.send(("expect", tid, dst_ids))
                parent.recv()
                wall, cpu_watch = harness.Stopwatch(), harness.Stopwatch(time.process_time)
                sender.begin(tid, "bench", address, src_ids, dst_ids, lease_s=120)
                # In serving, Claim/Grant happen while the prefill runs; wait for the grant
                # (the sender is idle until then) to time the data phase on its own too.
                _wait(sender, tid, lambda st: st is not TransferState.RESERVED, transport)
                grant_s = wall.lap()
                sender.send_all(tid)
                state = _wait(sender, tid, lambda st: st.terminal, transport)
                data_s = wall.lap()
                sender_cpu = cpu_watch.lap()
                if state is not TransferState.COMPLETE:
                    raise RuntimeError(f"{transport}: {state.name}: {sender.reason(tid)}")
                sender.forget(tid)
                parent.send(("forget", tid))
                ok, receiver_cpu = parent.recv()
                if not ok:
                    raise RuntimeError("receiver did not see COMPLETE")
                if i >= WARMUP_RUNS:
                    times.append(grant_s + data_s)
                    data.append(data_s)
                    cpu.append(max(sender_cpu, receiver_cpu))
        base = min(base, memcpy.seconds(5))
    finally:  # a failed run must not leave the receiver process waiting
        parent.send(("stop",))
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    med = statistics.median
    return Result(nbytes, med(times), med(data), med(cpu), base)

def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, model_help=None)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--chunk-mib", type=float, default=DEFAULT_CHUNK_BYTES / 2**20,
                    help="zmq frame size")
    ap.add_argument("--shm-chunk-mib", type=float, default=DEFAULT_SHM_CHUNK_BYTES / 2**20,
                    help="shared-memory chunk (unit of verification) size")
    ap.add_argument("--copy-threads", type=int, default=DEFAULT_COPY_THREADS,
                    help="copy threads per side (Sender/ZmqReceiver copy_threads=)")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--transports", nargs="+", default=DEFAULT_TRANSPORTS, choices=TRANSPORTS)
    args = ap.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print(f"{harness.machine_line()}\nhost copy: {hostcopy.describe()}; shm chunk {args.shm_chunk_mib:g} MiB, "
          f"zmq frame {args.chunk_mib:g} MiB")
    print("latency: begin -> ack (incl. the Claim/Grant round trip); data: grant -> ack; "
          "% memcpy: best memcpy time / median transfer time")
    print(f"{'shape':<12} {'MiB':>7} {'transport':<9} {'latency ms':>11} {'GB/s':>7} "
          f"{'memcpy GB/s':>12} {'% memcpy':>9} {'data ms':>8} {'data GB/s':>10} "
          f"{'data %':>7} {'GB/s per CPU-s':>15}")
    for shape in args.shapes:
        layout = SHAPES[shape]
        blocks = -(-args.tokens // layout.block_size)
        nbytes = blocks * layout.block_size * layout.kv_bytes_per_token
        for transport in args.transports:
            try:
                r = bench_one(shape, transport, args.tokens, args.runs,
                              int(args.chunk_mib * 2**20), args.copy_threads,
                              int(args.shm_chunk_mib * 2**20))
            except Exception as e:  # absent or refused here: report it, run the others
                rows.append({"shape": shape, "transport": transport, "error": repr(e)})
                print(f"{shape:<12} {nbytes / 2**20:>7.1f} {transport:<9} FAILED: {e!r}", flush=True)
                continue
            rows.append({"shape": shape, "transport": transport, "nbytes": r.nbytes,
                         "gbps": r.gbps, "data_gbps": r.data_gbps, "memcpy_gbps": r.memcpy_gbps,
                         "ratio": r.ratio, "data_ratio": r.data_ratio, "latency_s": r.latency_s})
            print(f"{shape:<12} {nbytes / 2**20:>7.1f} {transport:<9} {r.latency_s * 1e3:>11.2f} "
                  f"{r.gbps:>7.2f} {r.memcpy_gbps:>12.2f} {100 * r.ratio:>8.0f}% "
                  f"{r.data_s * 1e3:>8.2f} {r.data_gbps:>10.2f} {100 * r.data_ratio:>6.0f}% "
                  f"{r.cpu_gbps:>15.2f}", flush=True)
        ours, crc = checksum_gbps(nbytes, blocks * layout.num_layers * 2)
        print(f"{shape:<12} checksum (row sums + blake2b): {ours:.2f} GB/s; zlib.crc32: {crc:.2f} GB/s; "
              f"memcpy: {nbytes / Memcpy(np.ones(nbytes, np.uint8), nbytes).seconds(5) / 1e9:.2f} GB/s",
              flush=True)
    harness.write_json(args.output_json, {"tokens": args.tokens, "runs": args.runs, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
