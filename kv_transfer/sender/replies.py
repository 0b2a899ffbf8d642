"""Sender side of the handshake and of the receiver's replies (see sender.py).

A `HelloAck` makes a peer ready (or refused) and picks how blocks travel to it;
`Grant`, `Ack` and `Cancel` move one transfer's state. Neither touches a socket:
what must be said back is queued on the peer's control queue.
"""

from __future__ import annotations

from kv_transfer import wire
from kv_transfer.api import TransferState
from kv_transfer.pool.ops import pool_ops
from kv_transfer.sender.state import PeerRecord, TransferRecord, attach_direct
from pdserve.common.kv_layout import KVLayout

TransferReply = wire.Grant | wire.Ack | wire.Cancel


def accept_hello_ack(peer: PeerRecord, msg: wire.HelloAck, layout: KVLayout,
                     on_device: bool) -> None:
    """Mark `peer` ready, or refused with a reason each of its transfers will fail with."""
    mine = layout.compat_hash
    if not msg.ok or msg.compat_hash != mine:
        # A receiver names no hash of its own when it refuses; ours is what an operator needs.
        peer.refused = f"handshake refused: {msg.reason or 'compatibility hash mismatch'} (sender {mine})"
        return
    peer.max_frame = msg.max_frame_bytes
    # No direct mapping (another host, or a host pool on one side): inline frames, a
    # device pool's staged through pinned host buffers (staging.py).
    if peer.want_direct and msg.shm is not None:
        try:
            peer.direct = attach_direct(layout, msg.shm, on_device)
            peer.direct_ops = pool_ops(peer.direct.array)
        except (OSError, ValueError, ImportError, RuntimeError):
            peer.direct = None  # another host or namespace: fall back to inline frames
    peer.ready = True


def apply_reply(peer: PeerRecord, msg: TransferReply, t: TransferRecord | None,
                abort_owed: bool) -> None:
    """Apply a reply about transfer `t` (None: not ours, or forgotten) from `peer`.

    Caller holds the sender lock. `abort_owed`: a forgotten record of this transfer
    still has its Abort queued to send.
    """
    if isinstance(msg, wire.Cancel) and (t is None or (t.peer == peer.address and t.state.terminal)):
        # Not writing it (writes happen only under the lock, for live records):
        # say so, or the receiver keeps the blocks until its lease ends.
        if not abort_owed and not (t is not None and t.abort_pending):
            peer.control.append([wire.encode(wire.Abort(msg.transfer_id, "not sending"))])
        return
    if t is None or t.peer != peer.address or t.state.terminal:
        return
    if isinstance(msg, wire.Grant):
        t.granted = True
        t.write_deadline = min(t.deadline, msg.deadline)
        t.state = TransferState.TRANSFERRING
    elif isinstance(msg, wire.Ack) and msg.ok:
        t.end(TransferState.COMPLETE, "")
    elif isinstance(msg, wire.Ack):
        t.end(TransferState.FAILED, f"receiver rejected: {msg.reason}")
    else:
        t.end(TransferState.FAILED, f"receiver cancelled: {msg.reason}")
