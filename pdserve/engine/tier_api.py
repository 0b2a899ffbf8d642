"""What the torch-free scheduler knows of the KV tiers below the pool: a store it asks
which blocks of a prefix it holds, the reads it asks the engine to start, and the loads
it hands the engine (pdserve/engine/pool_blocks.py does the copying). Payloads are opaque
byte arrays here (numpy only in annotations: the scheduler never touches them)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from concurrent.futures import Future

    import numpy as np


class PrefixTiers(Protocol):
    """The store the engine reads and writes (kv_transfer.tiers.TieredKVCache)."""

    def load(self, digests: Sequence[bytes]) -> np.ndarray:
        """Payloads of the longest leading run of `digests` found, each checked: one row
        per block ([blocks, payload bytes], uint8)."""

    def release(self, payloads: np.ndarray) -> None:
        """The caller copied a load's `payloads` (or rows of them) and reads them no more."""

    def offer(self, digest: bytes, payload: np.ndarray) -> bool:
        """Queue one block for writing without blocking; False if it was dropped."""

    def present(self, digests: Sequence[bytes]) -> int:
        """How many leading `digests` some tier holds (an existence check, not a read)."""

    def load_async(self, digests: Sequence[bytes]) -> Future[np.ndarray]:
        """`load(digests)` off the calling thread."""

    def timed_out(self, digests: Sequence[bytes]) -> None:
        """The caller gave up waiting for a `load_async(digests)` (counted)."""


class TierRead(NamedTuple):
    """A read the scheduler asks for on admission: sequence `seq_id`'s blocks `block_ids`
    (allocated, not yet written) are to get the bytes the tiers hold under `digests`."""

    seq_id: int
    block_ids: tuple[int, ...]
    digests: tuple[bytes, ...]


class BlockLoad(NamedTuple):
    """Bytes from the tiers for pool blocks `block_ids`, written before the step runs."""

    block_ids: tuple[int, ...]
    payloads: np.ndarray  # [len(block_ids), payload bytes] uint8: row i is block_ids[i]'s
    digests: tuple[bytes, ...]  # their prefix digests (already in the tiers: not offered back)
