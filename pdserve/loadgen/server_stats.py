"""What the server says about a run: speculative decoding counters scraped from the
gateway's `/metrics` (the decode workers' `llm_spec_decode_*` counts, re-exported
from their heartbeats) before and after it.

A server without them (speculation off, another OpenAI server) reports nothing and
the bench prints nothing about it.
"""

from __future__ import annotations

import asyncio
from typing import Any, NamedTuple

import aiohttp

from pdserve.loadgen.client import auth_headers
from pdserve.loadgen.config import EndpointConfig

DRAFTS = "llm_spec_decode_num_drafts_count"
DRAFT_TOKENS = "llm_spec_decode_num_draft_tokens_count"
ACCEPTED = "llm_spec_decode_num_accepted_tokens_count"
# Workers heartbeat their counters every 0.5 s by default: wait two beats after a run.
SETTLE_S = 1.0


class SpecCounters(NamedTuple):
    drafts: float
    draft_tokens: float
    accepted_tokens: float


def parse_counters(text: str) -> SpecCounters | None:
    """The fleet's summed counters in a Prometheus exposition (None: not reported)."""
    from prometheus_client.parser import text_string_to_metric_families

    sums = {DRAFTS: 0.0, DRAFT_TOKENS: 0.0, ACCEPTED: 0.0}
    seen = False
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in sums:
                    sums[sample.name] += float(sample.value)
                    seen = True
    except ValueError:  # not a Prometheus exposition
        return None
    return SpecCounters(sums[DRAFTS], sums[DRAFT_TOKENS], sums[ACCEPTED]) if seen else None


async def scrape(session: aiohttp.ClientSession, cfg: EndpointConfig) -> SpecCounters | None:
    """The counters now, or None when the server has none (or no /metrics)."""
    url = cfg.base_url.rstrip("/").removesuffix("/v1") + "/metrics"
    try:
        async with session.get(url, headers=auth_headers(cfg), timeout=aiohttp.ClientTimeout(total=10)) as r:
            if r.status != 200:
                return None
            return parse_counters(await r.text())
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return None


def spec_summary(before: SpecCounters | None, after: SpecCounters | None) -> dict[str, Any] | None:
    """Acceptance over the run: mean acceptance length (tokens per verifying forward,
    vLLM's definition: 1 + accepted / drafts) and the accepted fraction of draft tokens."""
    if after is None:
        return None
    b = before or SpecCounters(0.0, 0.0, 0.0)
    drafts, tokens, accepted = (after.drafts - b.drafts, after.draft_tokens - b.draft_tokens,
                                after.accepted_tokens - b.accepted_tokens)
    if drafts <= 0:
        return None
    return {"drafts": drafts, "draft_tokens": tokens, "accepted_tokens": accepted,
            "mean_acceptance_length": 1.0 + accepted / drafts,
            "acceptance_rate": accepted / tokens if tokens else 0.0}
