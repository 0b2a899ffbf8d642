"""A decode engine's suffix-only handoff takes its reused prefix from the KV tiers too
(`LLMEngine.reserve_remote`, reuse_prefix): the blocks its pool lacks but a tier holds
are held at once and read off the loop while the prefill engine computes the rest
(pdserve/engine/tier_fill.py), the transfer brings only the rest, and the decoded
tokens equal the single-engine reference exactly (float32, tiny Llama). A block gone
bad between the reservation and the read fails the fill, never the KV."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kv_transfer.tiers.cache import TieredKVCache
from kv_transfer.tiers.files import FileTier
from pdserve.common.block_hash import ROOT_DIGEST, block_hash
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.tier_fill import FillState
from tests.engine.test_kv_tiers_engine import (
    BS,
    GREEDY,
    assert_idle,
    make_engine,
    prompts,
    with_tiers,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[..., Path]) -> Path:
    return tiny_model_dir("llama")


def reference_tokens(model_dir: Path, prompt: list[int]) -> tuple[int, ...]:
    engine = make_engine(model_dir)
    engine.block_manager.enable_prefix_caching = False
    return engine.generate([prompt], GREEDY)[0].choices[0].token_ids


def hand_off(decode: LLMEngine, rid: str, prompt: list[int]) -> tuple[tuple[int, ...], int]:
    """A prefill engine (no tiers) computes `prompt`; `decode` reserves it with prefix
    reuse and receives only the blocks past the ones it holds. (tokens, blocks held)."""
    prefill = make_engine(Path(decode.config.model_dir))
    prefill.add_request(rid, prompt, GREEDY, prefill_only=True)
    reservation = decode.reserve_remote(rid, prompt, GREEDY, reuse_prefix=True)
    assert reservation.ok
    first: list[int] = []
    while prefill.has_unfinished():
        for out in prefill.step():
            first = [out.outputs[0].token_ids[0]]
    held = prefill.held_blocks(rid)
    shipped = held[reservation.cached_blocks:]  # what the prefill worker sends
    assert len(shipped) == len(reservation.block_ids)
    src, dst = prefill.runner.pool.kv, decode.runner.pool.kv
    dst[:, :, torch.tensor(reservation.block_ids)] = src[:, :, torch.tensor(shipped)]
    prefill.release(rid)
    if decode.tier_fills is not None:  # as the decode node polls `tier_fill` before admitting
        assert decode.tier_fills.wait(rid) in (FillState.DONE, FillState.NONE)
    decode.start_remote(rid, first)
    got = list(first)
    while decode.has_unfinished():
        for out in decode.step():
            got += out.outputs[0].token_ids
    assert_idle(prefill)
    return tuple(got), reservation.cached_blocks


def chain(tokens: list[int], bs: int) -> list[bytes]:
    """The prefix digests of every full block of `tokens`."""
    out, parent = [], ROOT_DIGEST
    for i in range(len(tokens) // bs):
        parent = block_hash(parent, tokens[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def written_tier(model_dir: Path, root: Path, ps: list[list[int]]) -> None:
    """A colocated engine serves `ps`, writing their blocks to the host tier at `root`."""
    writer = make_engine(model_dir)
    cache = with_tiers(writer, FileTier("host", root, 1 << 26))
    for p in ps:
        writer.generate([p], GREEDY)
    cache.close()


def test_the_reused_prefix_comes_from_the_pool_then_the_tier_and_decodes_exactly(
        model_dir: Path, tmp_path: Path) -> None:
    base = prompts(1, 5 * BS + 3, seed=11)[0]
    written_tier(model_dir, tmp_path / "host", [base])
    turn = base + prompts(1, 2 * BS + 5, seed=12)[0]  # the conversation comes back, longer
    decode = make_engine(model_dir, num_blocks=48)
    # Its pool already holds base's first two blocks (an earlier, shorter request) ...
    assert hand_off(decode, "short", base[:2 * BS + 1])[1] == 0
    cache: TieredKVCache = with_tiers(decode, FileTier("host", tmp_path / "host", 1 << 26))
    # ... the tier the next three, the transfer brings the rest.
    got, held = hand_off(decode, "turn", turn)
    assert held == 5
    assert got == reference_tokens(model_dir, turn)
    snap = cache.snapshot()
    assert snap.tiers[0].hits == 3 and snap.loaded_blocks == 3
    # What it registered is written down too: the received suffix and the block its own
    # tokens filled (the next turn's prompt), never the blocks it loaded.
    assert cache.flush()
    tier = cache.tiers[0]
    digests = chain([*turn, *got], BS)
    assert all(tier.contains(cache.key(d)) for d in digests)
    assert tier.stats.writes == len(digests) - 5  # its 5 held blocks were there already
    assert_idle(decode)
    cache.close()


def test_a_reservation_aborted_while_its_tier_blocks_are_read_leaks_nothing(
        model_dir: Path, tmp_path: Path) -> None:
    base = prompts(1, 4 * BS + 2, seed=13)[0]
    written_tier(model_dir, tmp_path / "host", [base])
    decode = make_engine(model_dir, num_blocks=32)
    cache = with_tiers(decode, FileTier("host", tmp_path / "host", 1 << 26))
    first = decode.reserve_remote("a", base, GREEDY, reuse_prefix=True)
    assert first.cached_blocks == 4 and len(first.block_ids) == 1
    with pytest.raises(ValueError, match="not in yet"):
        decode.start_remote("a", [1])  # never admitted before its tier blocks are in
    assert decode.abort("a")
    assert decode.tier_fill("a") is FillState.NONE
    assert_idle(decode)
    got, held = hand_off(decode, "b", base)  # nothing of the aborted read reached the pool
    assert held == 4
    assert got == reference_tokens(model_dir, base)
    assert_idle(decode)
    cache.close()


def test_a_block_gone_bad_before_it_is_read_fails_the_fill_not_the_kv(
        model_dir: Path, tmp_path: Path) -> None:
    base = prompts(1, 4 * BS + 2, seed=15)[0]
    written_tier(model_dir, tmp_path / "host", [base])
    decode = make_engine(model_dir, num_blocks=32)
    tier = FileTier("host", tmp_path / "host", 1 << 26)
    cache = with_tiers(decode, tier)
    # Block 2 is damaged after the check that it exists: the read finds it corrupt.
    real_present = cache.present

    def present_then_damage(digests: list[bytes]) -> int:
        n = real_present(digests)
        path = tier.path(cache.key(digests[2]))
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        return n

    cache.present = present_then_damage  # type: ignore[method-assign]
    assert decode.reserve_remote("a", base, GREEDY, reuse_prefix=True).cached_blocks == 4
    assert decode.tier_fills is not None and decode.tier_fills.wait("a") is FillState.FAILED
    assert cache.snapshot().tiers[0].misses == {"corrupt": 1}
    assert decode.abort("a")  # the node aborts it and the gateway retries the request
    assert_idle(decode)
    cache.present = real_present  # type: ignore[method-assign]
    got, held = hand_off(decode, "b", base)  # the retry: the bad block was discarded
    assert held == 2
    assert got == reference_tokens(model_dir, base)
    assert_idle(decode)
    cache.close()


def test_without_prefix_reuse_the_tiers_are_not_asked(model_dir: Path, tmp_path: Path) -> None:
    base = prompts(1, 3 * BS + 1, seed=14)[0]
    written_tier(model_dir, tmp_path / "host", [base])
    decode = make_engine(model_dir, num_blocks=32)
    cache = with_tiers(decode, FileTier("host", tmp_path / "host", 1 << 26))
    whole = decode.reserve_remote("a", base, GREEDY)  # recovery re-prefills: every block ships
    assert whole.cached_blocks == 0 and len(whole.block_ids) == 4
    assert cache.snapshot().tiers[0].hits == 0
    assert decode.abort("a")
    assert_idle(decode)
    cache.close()
