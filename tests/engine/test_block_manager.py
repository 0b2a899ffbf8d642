"""Block manager: exact block ids, CoW, prefix cache, LRU, plus a hypothesis state machine
that also models block *contents* to prove cached/shared blocks hold the right tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.engine.core.block_manager import NO_HIT, BlockCopy, BlockManager


def test_bookkeeping_modules_import_no_torch() -> None:
    code = (
        "import sys, pdserve.engine.core.block_manager, pdserve.engine.core.scheduler, pdserve.engine.core.sequence;"
        "print('torch' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def _ok(bm: BlockManager) -> None:
    assert bm.check_integrity(), bm.integrity_errors()


def test_allocate_on_growth_exact_ids_and_usage() -> None:
    bm = BlockManager(num_blocks=9, block_size=4)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    alloc = bm.allocate_slots(1, 5, 0)
    assert alloc is not None and alloc.new_block_ids == (1, 2) and alloc.copies == ()
    assert bm.allocate_slots(1, 8, 5) == ((), ())  # still inside block 2
    assert bm.allocate_slots(1, 9, 8) == ((3,), ())
    assert bm.block_table(1) == [1, 2, 3]
    assert bm.usage == pytest.approx(3 / 8)
    _ok(bm)
    bm.free(1)
    assert bm.num_free_blocks == 8 and bm.usage == 0.0
    _ok(bm)


def test_no_room_returns_none_and_changes_nothing() -> None:
    bm = BlockManager(num_blocks=4, block_size=4)  # 3 allocatable
    assert bm.allocate_slots(1, 8, 0) is not None
    assert bm.allocate_slots(2, 8, 0) is None
    assert not bm.has_owner(2) or bm.block_table(2) == []
    assert bm.num_free_blocks == 1
    _ok(bm)


def test_prefix_cache_hit_shares_full_blocks_but_never_the_last_token() -> None:
    bm = BlockManager(num_blocks=9, block_size=4)
    prompt = list(range(10))
    bm.allocate_slots(1, 10, 0)
    bm.cache_full_blocks(1, prompt, 10)
    assert bm.num_cached_blocks == 2  # blocks 1, 2 are full; block 3 is partial
    hit = bm.match_prefix(prompt + [99])
    assert hit.block_ids == (1, 2) and hit.num_tokens == 8
    # Exactly 8 tokens: the hit may not cover token 7, so only block 1 matches.
    assert bm.match_prefix(prompt[:8]).block_ids == (1,)
    assert bm.match_prefix([0, 1, 2, 4, 5]) == NO_HIT  # first block differs
    alloc = bm.allocate_slots(2, 11, 8, hit)
    assert alloc == ((4,), ())
    assert bm.block_table(2) == [1, 2, 4]
    assert bm.ref_count(1) == 2 and bm.ref_count(2) == 2
    _ok(bm)


def test_colliding_parent_hashes_never_share_a_child_block() -> None:
    # CPython hashes an int modulo 2**61 - 1: these two first blocks have the same
    # Python hash, so under a `hash((parent, tokens))` chain every block after them
    # would get the same key too. Their blocks' own tokens differ; the next ones agree.
    a, b = [5, 1, 2, 3], [5 + 2**61 - 1, 1, 2, 3]
    assert hash((0, tuple(a))) == hash((0, tuple(b)))  # the premise: a real collision
    tail, last = [6, 7, 8, 9], [42]
    bm = BlockManager(num_blocks=9, block_size=4)
    bm.allocate_slots(1, 5, 0)  # [1, 2]
    bm.cache_full_blocks(1, a + last, 5)  # block 1 holds `a`
    assert bm.match_prefix(b + tail + last) == NO_HIT
    bm.allocate_slots(2, 9, 0)  # [3, 4, 5]
    bm.cache_full_blocks(2, b + tail + last, 9)  # block 4: `tail`'s KV computed after `b`
    # `a + tail` may reuse block 1, never block 4 (its KV depends on `b`).
    hit = bm.match_prefix(a + tail + last)
    assert hit.block_ids == (1,) and hit.num_tokens == 4
    assert bm.match_prefix(b + tail + last).block_ids == (3, 4)
    _ok(bm)


def test_freed_cached_blocks_are_revived_then_evicted_lru() -> None:
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 allocatable
    a, b = [1, 2, 3, 4, 5], [7, 8, 9]
    bm.allocate_slots(1, 5, 0)  # blocks 1 2 3
    bm.cache_full_blocks(1, a, 5)
    bm.free(1)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2 and bm.usage == 0.0
    hit = bm.match_prefix(a)
    assert hit.block_ids == (1, 2)
    bm.allocate_slots(2, 5, 4, hit)
    assert bm.block_table(2) == [1, 2, 4]  # revived 1, 2; fresh 4 before evicting anything
    _ok(bm)
    bm.free(2)
    # Uncached free blocks (3, 4) go first; then the LRU evicts cached blocks in free
    # order, which is tail first (2 before 1), so a prompt's head survives longest.
    bm.allocate_slots(3, 6, 0)
    assert bm.block_table(3) == [3, 4, 2]
    assert bm.match_prefix(a).block_ids == (1,)  # block 2 was evicted, block 1 survives
    assert bm.match_prefix(b) == NO_HIT
    _ok(bm)


def test_fork_shares_blocks_and_copy_on_write_of_the_partial_block() -> None:
    bm = BlockManager(num_blocks=9, block_size=4)
    bm.allocate_slots(1, 6, 0)  # [1, 2], block 2 partial
    bm.fork(1, 2)
    bm.fork(1, 3)
    assert bm.ref_count(1) == 3 and bm.ref_count(2) == 3
    # Child 2 writes position 6 (inside shared block 2): it gets a private copy.
    assert bm.allocate_slots(2, 7, 6) == ((), (BlockCopy(2, 3),))
    assert bm.block_table(2) == [1, 3]
    assert bm.allocate_slots(3, 7, 6) == ((), (BlockCopy(2, 4),))
    # The parent is now the only owner of block 2: writes in place, no copy.
    assert bm.allocate_slots(1, 7, 6) == ((), ())
    assert [bm.ref_count(b) for b in (1, 2, 3, 4)] == [3, 1, 1, 1]
    _ok(bm)
    for owner in (1, 2, 3):
        bm.free(owner)
    assert bm.num_free_blocks == 8
    _ok(bm)


def test_reviving_a_cached_block_counts_against_room() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)  # 3 allocatable
    bm.allocate_slots(1, 3, 0)
    bm.cache_full_blocks(1, [5, 6, 7], 3)
    bm.free(1)
    hit = bm.match_prefix([5, 6, 7, 8, 9, 10, 11])
    assert hit.block_ids == (1,)
    # 7 tokens need 4 blocks: 1 revived + 3 new > 3 allocatable.
    assert bm.allocate_slots(2, 7, 2, hit) is None
    assert bm.allocate_slots(2, 6, 2, hit) is not None
    _ok(bm)


# ------------------------------------------------------------------ property test
BLOCK_SIZE = 2


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free (eviction happens inside allocation).

    Besides refcount integrity, it simulates what the runner would write: every
    computed position p of an owner must read back its own token from block
    table[p // bs], slot p % bs -- which fails if a cached or shared block were
    handed out or overwritten wrongly, or a CoW copy were missing.
    """

    @initialize(num_blocks=st.integers(3, 14), caching=st.booleans())
    def setup(self, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, caching)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.content: dict[int, list[int | None]] = {}
        self.next_owner = 0

    def _write(self, owner: int, start: int, end: int, copies: tuple[BlockCopy, ...]) -> None:
        for c in copies:
            self.content[c.dst] = list(self.content.get(c.src, [None] * BLOCK_SIZE))
        table = self.bm.block_table(owner)
        for p in range(start, end):
            block = self.content.setdefault(table[p // BLOCK_SIZE], [None] * BLOCK_SIZE)
            block[p % BLOCK_SIZE] = self.tokens[owner][p]
        self.computed[owner] = end
        self.bm.cache_full_blocks(owner, self.tokens[owner], end)

    @rule(tokens=st.lists(st.integers(0, 2), min_size=1, max_size=9))
    def new_sequence(self, tokens: list[int]) -> None:
        owner = self.next_owner
        self.next_owner += 1
        hit = self.bm.match_prefix(tokens)
        assert hit.num_tokens < len(tokens)
        self.tokens[owner] = tokens
        alloc = self.bm.allocate_slots(owner, len(tokens), hit.num_tokens, hit)
        if alloc is None:
            del self.tokens[owner]
            return
        self.computed[owner] = hit.num_tokens
        self._write(owner, hit.num_tokens, len(tokens), alloc.copies)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), new=st.lists(st.integers(0, 2), min_size=1, max_size=3))
    def append(self, data: st.DataObject, new: list[int]) -> None:
        owner = data.draw(st.sampled_from(sorted(self.tokens)))
        start = self.computed[owner]
        self.tokens[owner] = self.tokens[owner] + new
        end = len(self.tokens[owner])
        alloc = self.bm.allocate_slots(owner, end, start)
        if alloc is None:
            self.tokens[owner] = self.tokens[owner][: len(self.tokens[owner]) - len(new)]
            return
        self._write(owner, start, end, alloc.copies)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self.next_owner
        self.next_owner += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        owner = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(owner)
        del self.tokens[owner], self.computed[owner]

    @invariant()
    def integrity(self) -> None:
        _ok(self.bm)

    @invariant()
    def every_owner_reads_its_own_tokens(self) -> None:
        for owner, toks in self.tokens.items():
            table = self.bm.block_table(owner)
            for p in range(self.computed[owner]):
                assert self.content[table[p // BLOCK_SIZE]][p % BLOCK_SIZE] == toks[p]

    def teardown(self) -> None:
        for owner in list(self.tokens):
            self.bm.free(owner)
        assert self.bm.num_free_blocks == self.bm.num_allocatable
        assert self.bm.usage == 0.0
        _ok(self.bm)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
test_block_manager_state_machine = BlockManagerMachine.TestCase
