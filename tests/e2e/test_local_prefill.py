"""Per-request disaggregation and suffix-only handoff through real processes.

With `--local-prefill-threshold`, a request whose uncached part on the decode worker
is within the threshold is prefilled there (no KV shipped), a long one is prefilled
on the prefill worker and its KV shipped, and a follow-up that extends the long one
(the decode worker holds its prefix) runs locally again. Without it, that follow-up
ships only the blocks the decode worker does not hold. Every output equals the
single-process engine's."""

from __future__ import annotations

from pathlib import Path

from tests.e2e.cluster import Cluster, worker_metrics
from tests.e2e.conftest import Reference
from tests.e2e.test_kv_routing import BLOCK, MAX_TOKENS, TEXT, complete, gateway_metrics
from tests.observability.obs import value

THRESHOLD = 24


def test_short_or_mostly_cached_prompts_are_prefilled_on_the_decode_worker(
    log_dir: Path, reference: Reference
) -> None:
    long_ids = reference.completion_ids(TEXT)
    short_ids = reference.completion_ids("The capital of France is")
    assert len(short_ids) <= THRESHOLD < len(long_ids) - THRESHOLD
    # The long prompt's first full blocks, then new tokens: uncached part within the threshold.
    kept = (len(long_ids) // BLOCK - 1) * BLOCK
    follow_ids = long_ids[:kept] + short_ids[1:]
    assert len(follow_ids) - kept <= THRESHOLD < len(follow_ids)

    c = Cluster(log_dir)
    try:
        c.start_gateway("--local-prefill-threshold", str(THRESHOLD))
        c.add_worker("prefill")
        c.add_worker("decode")
        workers = {w["role"]: w for w in c.wait_roles(prefill=1, decode=1)}

        def shipped() -> float:
            return value(worker_metrics(workers["decode"]), "llm_kv_transfer_bytes_total")

        def local() -> float:
            return value(worker_metrics(workers["decode"]), "llm_decode_local_prefills_total")

        for ids, is_local in ((short_ids, True), (long_ids, False), (follow_ids, True)):
            before = shipped()
            out = complete(c, reference.model_name, ids)
            want = reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0]
            assert out["choices"][0]["text"] == reference.text(want)
            assert (shipped() == before) == is_local, (len(ids), before, shipped())
        assert local() == 2
        text = gateway_metrics(c)
        assert value(text, "llm_routing_decisions", reason="local_prefill") == 2
        # The follow-up's prefix came from the decode worker's own cache.
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == kept
        c.wait_idle()
    finally:
        c.stop()


def test_a_prompt_extending_one_the_decode_worker_holds_ships_only_its_suffix(
    log_dir: Path, reference: Reference
) -> None:
    first = reference.completion_ids(TEXT)
    extended = first + reference.completion_ids("The capital of France is")[1:]
    held = len(first) // BLOCK  # the decode worker cached the first prompt's full blocks
    c = Cluster(log_dir)
    try:
        c.start_gateway()
        c.add_worker("prefill")
        c.add_worker("decode")
        decode = next(w for w in c.wait_roles(prefill=1, decode=1) if w["role"] == "decode")

        def shipped() -> float:
            return value(worker_metrics(decode), "llm_kv_transfer_bytes_total")

        sent = []
        for ids in (first, extended):
            out = complete(c, reference.model_name, ids)
            want = reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0]
            assert out["choices"][0]["text"] == reference.text(want)
            sent.append(shipped() - sum(sent))
        block_bytes = sent[0] / -(-len(first) // BLOCK)  # the first prompt shipped every block
        assert sent[1] == block_bytes * (-(-len(extended) // BLOCK) - held) > 0
        assert value(worker_metrics(decode), "llm_kv_blocks_reused_total") == held
        c.wait_idle()
    finally:
        c.stop()
