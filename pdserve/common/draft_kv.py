"""Draft-model KV that travels with the target's (`draft_kv=prefill`).

The decode worker reserves blocks in its draft pool next to the target's and names
them, with its draft receiver's address, in `ReserveResult.draft`; the gateway passes
them on in `TransferTarget.draft`. The draft transfer is a second transfer of the same
kv_transfer protocol (its own checksums, lease and handshake over the draft's layout)
whose id is derived from the target transfer's, so no other message changes.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DraftBlocks:
    """Where a request's draft KV goes: the decode worker's draft receiver and the
    destination blocks in its draft pool (every block of the prompt: no prefix reuse)."""

    kv_address: str
    block_ids: list[int]


def draft_transfer_id(transfer_id: str) -> str:
    """The draft transfer that goes with target transfer `transfer_id`."""
    return f"{transfer_id}.draft"
