"""The KV-aware router knows the workers' KV tiers (gateway/kv_tiers.py): fed the
messages workers send (registrations naming their tiers, heartbeats, KV events), each
through the wire codec into the gateway's control plane, it routes by the cost of
getting a prefix: own pool < host tier (any worker of the host) < disk < remote <
recompute, and corrects itself from what the workers report back."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack
import pytest

from gateway.control_plane import ClusterConfig, ControlPlane
from gateway.kv_router import KvRouter, RouterConfig
from gateway.kv_tiers import PrefixReach
from gateway.registry import WorkerInfo
from pdserve.common import protocol as p
from pdserve.common.block_hash import prefix_block_keys
from pdserve.common.sampling_params import SamplingParams

BS = 4
PROMPT = list(range(1, 42))  # 10 cacheable blocks
KEYS = prefix_block_keys(PROMPT, BS)
SHM = "/dev/shm/pdserve-kv-test"


class _Events:
    def deliver(self, sender: str, wid: str, event: Any) -> None:
        pass

    def lost(self, w: WorkerInfo | None) -> None:
        pass


class Gateway:
    """A control plane without a socket (its replies go nowhere) and a router over it."""

    def __init__(self) -> None:
        self.control = ControlPlane(ClusterConfig(), _Events())
        self.router = KvRouter(RouterConfig("kv-aware"), self.control.kv_index)
        self._seq: dict[str, int] = {}

    def receive(self, sender: str, msg: p.Message) -> None:
        self.control._handle(sender, p.decode(p.encode(msg)))  # as it crosses the wire

    def worker(self, wid: str, host: str, *tiers: p.KvTierInfo, role: str = "colocated", queued: int = 0,
               free: int = 256) -> None:
        self.receive(wid, p.RegisterWorker(wid, role, host, "", "", "compat", 256, BS, 0, 1,
                                           kv_tiers=list(tiers) or None))
        self.receive(wid, p.KvEvents(wid, 0, [], snapshot=True))
        self.receive(wid, p.Heartbeat(wid, queued, free, 256, 0, 0, seq=1))
        self._seq[wid] = 0

    def events(self, wid: str, stored: Sequence[int] = (), evicted: Sequence[int] = ()) -> None:
        self._seq[wid] += 1
        self.receive(wid, p.KvEvents(wid, self._seq[wid], list(stored), list(evicted)))

    def computed_then_evicted(self, wid: str, keys: list[int]) -> None:
        """`wid` computed a prompt (stored, hence written down) and its pool evicted it."""
        self.events(wid, stored=keys)
        self.events(wid, evicted=keys)

    def pool(self, role: str = "colocated", *only: str) -> list[WorkerInfo]:
        ws = self.control.registry.pool(p.Role(role))
        return [w for w in ws if not only or w.worker_id in only]

    def pick(self, *only: str, tokens: list[int] = PROMPT) -> tuple[str, int, str]:
        pick = self.router.pick(self.pool("colocated", *only), p.RequestPayload(list(tokens), SamplingParams()))
        assert pick is not None
        return pick.worker.worker_id, pick.route.predicted_blocks, pick.route.reason


def host(capacity: int = 1000, location: str = SHM) -> p.KvTierInfo:
    return p.KvTierInfo("host", location, capacity)


def test_a_prefix_in_a_hosts_tier_counts_for_every_worker_of_that_host() -> None:
    gw = Gateway()
    gw.worker("a1", "hostA", host())
    gw.worker("a2", "hostA", host())
    gw.worker("b", "hostB", host())  # the same directory name on another host: another tier
    gw.computed_then_evicted("a1", KEYS)
    gw.events("b", stored=KEYS[:3])  # b's own pool holds a short prefix of it
    # Cache-blind of tiers, b's 3 pooled blocks would win; a host-tier load beats recomputing 7.
    assert gw.pick() == ("a1", 10, "tier_hit")
    assert gw.pick("a2", "b") == ("a2", 10, "tier_hit")  # a2 never saw it: same host, same tier
    gw.receive("a1", p.Deregister("a1", final=True))
    assert gw.pick() == ("a2", 10, "tier_hit")  # the tier outlives the worker that wrote it
    gw.worker("a3", "hostA", host())  # a worker that joins the host later is credited too
    assert gw.pick("a3", "b") == ("a3", 10, "tier_hit")
    assert gw.router.decisions == {"tier_hit": 4}


def test_the_cost_of_a_prefix_orders_pool_host_disk_remote_recompute() -> None:
    gw = Gateway()
    disk, remote = p.KvTierInfo("disk", "/var/cache/kv", 1000), p.KvTierInfo("remote", "redis://r:6379/0")
    gw.worker("pool", "h1")
    gw.worker("host", "h2", host())
    gw.worker("disk", "h3", disk)
    gw.worker("remote", "h4", remote)
    gw.worker("none", "h5")
    gw.events("pool", stored=KEYS)
    for writer, tier, on in (("w-host", host(), "h2"), ("w-disk", disk, "h3"), ("w-remote", remote, "h9")):
        gw.worker(writer, on, tier)
        gw.computed_then_evicted(writer, KEYS)
        gw.receive(writer, p.Deregister(writer, final=True))
    order = ["pool", "host", "disk", "remote", "none"]
    for i, expected in enumerate(order):
        assert gw.pick(*order[i:])[0] == expected
    reach = gw.router._reach(KEYS, gw.pool(), len(PROMPT))
    assert reach == {"pool": PrefixReach(10), "host": PrefixReach(0, host=10), "disk": PrefixReach(0, disk=10),
                     "remote": PrefixReach(0, remote=10), "none": PrefixReach(0)}
    costs = [gw.router.cost(w, len(PROMPT), reach[w.worker_id].total * BS, reach[w.worker_id].fetch_blocks() * BS)
             for w in sorted(gw.pool(), key=lambda w: order.index(w.worker_id))]
    assert costs == sorted(costs) and len(set(costs)) == 5 and costs[-1] == len(PROMPT)


def test_queued_load_outweighs_a_tier_hit_as_it_does_a_pool_hit() -> None:
    gw = Gateway()
    gw.worker("busy", "h", host(), queued=100)  # 100 queued tokens > the 40 a tier hit saves
    gw.worker("idle", "h2")
    gw.computed_then_evicted("busy", KEYS)
    assert gw.pick() == ("idle", 0, "load")
    assert gw.pick("busy") == ("busy", 10, "tier_hit")


def test_blocks_come_from_the_first_tier_holding_each_and_the_chain_stops_at_a_gap() -> None:
    gw = Gateway()
    disk = p.KvTierInfo("disk", "/kv", 1000)
    gw.worker("both", "h", disk, host())  # registered in any order: asked host first
    gw.worker("host-only", "h", host())
    gw.worker("disk-only", "h", disk)
    gw.computed_then_evicted("host-only", KEYS[:4])
    gw.computed_then_evicted("disk-only", KEYS)
    reach = gw.router._reach(KEYS, gw.pool(), len(PROMPT))
    assert reach["both"] == PrefixReach(0, host=4, disk=6)
    assert reach["host-only"] == PrefixReach(0, host=4)
    assert gw.control.kv_index.tiers.tiers_of("both") == ["host", "disk"]
    gw.events("disk-only", stored=KEYS[:2])  # in its pool now: then its tiers from block 2 on
    assert gw.router._reach(KEYS, gw.pool(), len(PROMPT))["disk-only"] == PrefixReach(2, disk=8)


def test_a_tier_keeps_what_its_size_holds_least_recently_stored_first_out() -> None:
    gw = Gateway()
    gw.worker("a", "h", host(capacity=12))
    gw.worker("b", "h2")
    other = prefix_block_keys([500, *PROMPT[1:]], BS)
    gw.computed_then_evicted("a", KEYS)
    gw.computed_then_evicted("a", other[:4])  # 14 blocks into 12: KEYS[0], KEYS[1] are gone
    assert gw.router._reach(KEYS, gw.pool(), len(PROMPT))["a"] == PrefixReach(0)
    assert gw.router._reach(other, gw.pool(), len(PROMPT))["a"] == PrefixReach(0, host=4)


def test_a_tier_hit_that_falls_short_corrects_the_tier_not_the_pool() -> None:
    gw = Gateway()
    gw.worker("a", "h", host())
    gw.events("a", stored=KEYS[:2])
    gw.computed_then_evicted("a", KEYS[2:])
    pick = gw.router.pick(gw.pool(), p.RequestPayload(PROMPT, SamplingParams()))
    assert pick is not None and (pick.route.predicted_blocks, pick.route.pool_blocks) == (10, 2)
    gw.router.observe(pick.route, 6 * BS)  # the tier had lost blocks 6.. (its own eviction)
    assert gw.router._reach(KEYS, gw.pool(), len(PROMPT))["a"] == PrefixReach(2, host=4)
    assert gw.control.kv_index.overlaps(KEYS, ["a"]) == {"a": 2}  # the pool's part stands
    pick = gw.router.pick(gw.pool(), p.RequestPayload(PROMPT, SamplingParams()))
    assert pick is not None
    gw.router.observe(pick.route, 1 * BS)  # the pool fell short: the pool is corrected
    assert gw.control.kv_index.overlaps(KEYS, ["a"]) == {"a": 1}


def test_decode_workers_reuse_a_prefix_from_their_hosts_tier() -> None:
    gw = Gateway()
    gw.worker("d-tier", "h", host(), role="decode")
    gw.worker("d-none", "h2", role="decode")
    gw.worker("d-pool", "h3", role="decode")
    gw.computed_then_evicted("d-tier", KEYS)
    payload = p.RequestPayload(PROMPT, SamplingParams(max_tokens=4))
    pick = gw.router.pick_decode(gw.pool("decode", "d-tier", "d-none"), payload)
    assert pick is not None and pick.worker_id == "d-tier"
    gw.events("d-pool", stored=KEYS)  # pinned in the pool beats loaded from a tier
    pick = gw.router.pick_decode(gw.pool("decode"), payload)
    assert pick is not None and pick.worker_id == "d-pool"
    assert gw.router.decisions == {"decode_tier_hit": 1, "decode_prefix_hit": 1}
    # Tier blocks land in free blocks: a decode worker without room for them is passed over.
    gw.worker("d-full", "h", host(), role="decode", free=5)
    pick = gw.router.pick_decode(gw.pool("decode", "d-full", "d-none"), payload)
    assert pick is not None and pick.worker_id == "d-none"


def test_local_prefill_counts_the_decode_workers_tier_blocks_as_not_computed() -> None:
    gw = Gateway()
    gw.router = KvRouter(RouterConfig("kv-aware", local_prefill_threshold=8), gw.control.kv_index)
    gw.worker("d", "h", host(), role="decode")
    decode = gw.pool("decode")[0]
    payload = p.RequestPayload(PROMPT, SamplingParams(max_tokens=4))
    assert gw.router.local_prefill(decode, payload) is None  # 41 tokens to compute
    gw.computed_then_evicted("d", KEYS)
    route = gw.router.local_prefill(decode, payload)
    assert route is not None and (route.predicted_blocks, route.pool_blocks, route.reason) == (10, 0, "local_prefill")


def test_the_registration_carries_its_tiers_and_a_malformed_one_is_refused() -> None:
    reg = p.RegisterWorker("w", "prefill", "h", "", "", "c", 1, BS, 0, 1, kv_tiers=[host(7)])
    got = p.decode(p.encode(reg))
    assert isinstance(got, p.RegisterWorker) and got.kv_tiers == [p.KvTierInfo("host", SHM, 7)]
    plain = p.decode(p.encode(p.RegisterWorker("w", "prefill", "h", "", "", "c", 1, BS, 0, 1)))
    assert isinstance(plain, p.RegisterWorker) and plain.kv_tiers is None
    fields = p.encode_fields(reg)
    fields["kv_tiers"] = [{"kind": "host", "location": SHM, "capacity_blocks": "lots"}]
    with pytest.raises(p.ProtocolError):
        p.decode(msgpack.packb([p.MAGIC, p.VERSION, reg.TAG, fields]))
