"""What the worker runtime needs from a node (prefill, decode or colocated), and what
a node reports back: its registration and its load."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from pdserve.common import protocol as p
from pdserve.common.roles import Role
from pdserve.engine.core.block_events import BlockEventLog


class NodeRegistration(NamedTuple):
    kv_address: str
    kv_shm: str
    compat_hash: str
    total_blocks: int
    block_size: int
    quantization: str = "none"
    kv_cache_dtype: str = ""
    lm_head_quantization: str = "none"
    kv_tiers: tuple[p.KvTierInfo, ...] = ()  # the KV tiers below its pool (the router's view)


class NodeLoad(NamedTuple):
    queued_prefill_tokens: int
    free_blocks: int
    total_blocks: int
    running_seqs: int
    waiting_seqs: int  # queued, awaiting KV, or waiting for a grammar to compile
    steps: int = 0  # engine steps so far: the gateway's progress check (Heartbeat.steps)
    tokens: int = 0  # tokens computed so far (prompt + generated): a step's size is the difference
    loras: tuple[str, ...] = ()  # fingerprints of the LoRA adapters held (Heartbeat.loras)


class CoreDemand(NamedTuple):
    """What a node asks of the cores now (pdserve/worker/core_sharing.py)."""

    keep: bool  # its own cores stay its own: it computes, or its work is on the way in or out
    borrow: bool  # it may run on an idle neighbour's cores: it computes, none of its work on the way there


class Node(Protocol):
    role: Role

    def registration(self) -> NodeRegistration: ...

    def handle(self, msg: p.Message) -> None: ...

    def step(self) -> bool:
        """Do one unit of work; False when there was nothing to do."""
        ...

    def load(self) -> NodeLoad:
        """Called by the main loop after every tick; never from another thread."""
        ...

    def busy(self) -> bool:
        """True while the node holds requests (draining waits for False)."""
        ...

    def core_demand(self) -> CoreDemand:
        """Whether a step now would compute, for the core hand-over between workers."""
        ...

    def cached_keys(self) -> list[int]:
        """Every prefix-cache block's key (pdserve/common/block_hash.py), for a snapshot."""
        ...

    def block_event_log(self) -> BlockEventLog:
        """The pool's ordered block events (pdserve/engine/core/block_events.py): the main
        loop drains the log after every tick and gives the batch to both feeds, the
        gateways' KV index and the vLLM-format KV events."""
        ...

    def close(self) -> None: ...


class NodeWrapper:
    """A node that passes every call to the node it wraps; a wrapper (core sharing,
    the thread governor) overrides only what it adds."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.role = node.role

    def registration(self) -> NodeRegistration:
        return self.node.registration()

    def handle(self, msg: p.Message) -> None:
        self.node.handle(msg)

    def step(self) -> bool:
        return self.node.step()

    def load(self) -> NodeLoad:
        return self.node.load()

    def busy(self) -> bool:
        return self.node.busy()

    def core_demand(self) -> CoreDemand:
        return self.node.core_demand()

    def cached_keys(self) -> list[int]:
        return self.node.cached_keys()

    def block_event_log(self) -> BlockEventLog:
        return self.node.block_event_log()

    def close(self) -> None:
        self.node.close()


Sender = Callable[[p.Message], None]
