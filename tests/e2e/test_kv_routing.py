"""KV-aware routing through real processes: workers publish their prefix-cache events
to the gateway, which sends a prompt whose prefix a worker holds to that worker
(`usage.prompt_tokens_details.cached_tokens` > 0 from the second request on), while
round-robin alternates and misses; the output is the single-process engine's."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, http
from tests.e2e.conftest import Reference
from tests.observability.obs import value

BLOCK = 16  # the workers' default block size
MAX_TOKENS = 6
TEXT = ("The old lighthouse keeper climbed the spiral stairs every evening, counting each of the "
        "one hundred and twelve steps, and at the top he wound the great clockwork that turned the "
        "lamp, then sat by the window with his tea and watched the ships come home across the bay")


@contextlib.contextmanager
def cluster(log_dir: Path, router: str, roles: dict[str, int]) -> Iterator[Cluster]:
    c = Cluster(log_dir)
    try:
        c.start_gateway("--router", router)
        for role, n in roles.items():
            for _ in range(n):
                c.add_worker(role)
        c.wait_roles(**{("colocated" if r == "worker" else r): n for r, n in roles.items()})
        yield c
    finally:
        c.stop()


def complete(c: Cluster, model: str, prompt: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, out = http("POST", f"{c.url}/v1/completions", body, timeout=120)
    assert status == 200, out
    return dict(out)


def gateway_metrics(c: Cluster) -> str:
    with urllib.request.urlopen(f"{c.url}/metrics", timeout=5) as r:
        return str(r.read().decode())


# (router, pools, cached tokens expected > 0 for requests 1..4 of the same prompt)
CASES = [
    ("kv-aware", {"prefill": 2, "decode": 2}, [False, True, True, True]),
    ("round-robin", {"prefill": 2, "decode": 1}, [False, False, True, True]),
    ("kv-aware", {"worker": 2}, [False, True, True, True]),
]


@pytest.mark.parametrize(("router", "roles", "hits"), CASES, ids=["kv-aware-2p2d", "round-robin-2p1d",
                                                                  "kv-aware-colocated"])
def test_a_repeated_prefix_lands_on_the_worker_holding_it(
    log_dir: Path, reference: Reference, router: str, roles: dict[str, int], hits: list[bool]
) -> None:
    ids = reference.completion_ids(TEXT)
    assert len(ids) > 4 * BLOCK
    expected = reference.text(reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0])
    full_blocks = (len(ids) - 1) // BLOCK
    pools = ["colocated" if r == "worker" else r for r in roles]
    with cluster(log_dir, router, roles) as c:
        cached = []

        def indexed() -> bool:  # every pool has a worker the gateway knows holds the prompt
            workers = c.worker_list()
            return all(max(w["kv_index_blocks"] for w in workers if w["role"] == pool) >= full_blocks
                       for pool in pools)

        for _ in hits:
            out = complete(c, reference.model_name, TEXT)
            assert out["choices"][0]["text"] == expected
            cached.append(out["usage"]["prompt_tokens_details"]["cached_tokens"])
            # The workers' KV events reach the gateway on their next tick: the next request is
            # routed on what the gateway has heard, so wait for it (a user's next turn does too).
            c._wait(indexed, "the gateway to index the prompt's blocks")
        assert [n > 0 for n in cached] == hits, cached
        # A hit covers every full block of the prompt but the one holding its last token.
        assert all(n == (len(ids) - 1) // BLOCK * BLOCK for n in cached if n), cached
        text = gateway_metrics(c)
        reasons = {"kv-aware": ("prefix_hit", 3), "round-robin": ("round_robin", 4)}[router]
        assert value(text, "llm_routing_decisions", router=router, reason=reasons[0]) == reasons[1]
        assert value(text, "llm_routed_cached_tokens") == sum(cached)
        if roles.get("decode", 0) > 1:  # requests 2..4 reserve on the decode worker holding the prefix
            assert value(text, "llm_routing_decisions", router=router, reason="decode_prefix_hit") == 3
        c.wait_idle()
