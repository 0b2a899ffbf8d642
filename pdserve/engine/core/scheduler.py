"""The step scheduler shared by the prefill node, the decode node and a colocated worker.

Life of a request (one `Sequence` per choice):

1. `add` queues it WAITING (decode node: `add_waiting_for_kv` holds it in
   WAITING_FOR_KV with reserved blocks; it is never scheduled until `admit`).
   A decode reservation is granted only when `check_reserve` says the pool
   keeps room for every live stream's growth, so admitting it never forces a
   running stream into preemption (see `ReserveCheck`).
2. A step first gives each RUNNING sequence its uncomputed tokens (one decode
   token, or the next chunk of a prefill), then admits WAITING sequences FCFS
   into the leftover token budget, a prefill split into chunks when it does not
   fit (chunked prefill). Admission looks up the prefix cache first, then asks
   the KV tiers below it (`tiers`) which of the blocks that follow they hold, an
   existence check: such a sequence takes its blocks and is parked WAITING_FOR_KV
   while the engine reads them off the loop (a `TierRead`), the others stepping on;
   when the read lands it is back at the front of WAITING, and the step that admits
   it carries the bytes as a `BlockLoad` the engine copies in before the chunks run
   (pdserve/engine/core/tier_reads.py). With chunks capped
   (`long_prefill_token_threshold`), a waiting prompt that fits in one chunk
   gets a step without the longer prompts' chunks, within a bounded wait
   (pdserve/engine/core/prefill_order.py).
3. Blocks are allocated as tokens are scheduled. When none are left the
   latest-admitted RUNNING sequence is preempted by recompute: its blocks are
   freed, its progress reset, and it goes back to the front of WAITING.
   A decode sequence's draft tokens (`spec_token_ids`, pdserve.engine.spec) ride in its
   chunk behind its last token, within the budget; they are dropped, never a
   sequence preempted, when their slots do not fit.
4. After the model runs, `mark_computed` advances `num_computed_tokens` (drafts
   excluded: `SpecDecoder.settle` counts the accepted ones) and registers newly
   full blocks in the prefix cache; the engine samples and appends a token to
   every sequence whose chunk reached its end (more when drafts are accepted).
5. `finish` ends a sequence (stopped, length, aborted) and frees its blocks, or,
   for a prefill-only request (FINISHED_PREFILLED), keeps them until `release`.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from pdserve.common.block_hash import block_hash, cacheable_blocks
from pdserve.engine.core.block_manager import NO_HIT, BlockCopy, BlockManager, PrefixHit
from pdserve.engine.core.config import SchedulerConfig
from pdserve.engine.core.prefill_order import ShortFirst
from pdserve.engine.core.reservation import ReserveCheck
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.core.tier_reads import TierReads
from pdserve.engine.tier_api import BlockLoad, PrefixTiers, TierRead


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_new_tokens: int


class SchedulerOutput(NamedTuple):
    """One step: chunks for the runner, their sequences (same order), and side effects."""

    chunks: list[SeqChunk]
    seqs: list[Sequence]
    preempted: list[Sequence]
    # Copy-on-write pairs the runner must copy before executing the chunks.
    block_copies: list[BlockCopy]
    # Blocks from the KV tiers, written into the pool before the chunks run.
    block_loads: tuple[BlockLoad, ...] = ()
    # Reads of the KV tiers for the sequences this step parked, for the engine to start.
    tier_reads: tuple[TierRead, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.chunks

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching at token granularity over one block manager."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 max_loras: int = 0):
        self.config = config
        # Distinct LoRA adapters among running sequences (they are all in every step).
        self.max_loras = max_loras
        self.block_manager = block_manager
        # Admission (the engine) rejects requests that could outgrow it and ends a
        # sequence that reaches it, so no chunk ever crosses it.
        self.max_model_len = max_model_len
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.waiting_for_kv: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0
        self.num_cached_tokens_hit = 0
        self.num_tier_tokens_hit = 0  # of those, loaded from the KV tiers
        # The KV tiers below the pool (pdserve/engine/pool_blocks.py); None: only the pool.
        self.tiers: PrefixTiers | None = None
        # Sequences parked (in `waiting_for_kv`) while their tier blocks are read.
        self.tier_reads = TierReads(block_manager.block_size)
        # Most prefill tokens one sequence may get in a step.
        cap = config.long_prefill_token_threshold
        self._prefill_cap = (cap if cap > 0 and config.enable_chunked_prefill
                             else config.max_num_batched_tokens)
        self.short_first = ShortFirst(cap if cap > 0 and config.enable_chunked_prefill else 0)

    # ------------------------------------------------------------ queue entry
    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self._enqueue(seq)

    def add_waiting_for_kv(self, seq: Sequence) -> None:
        """Blocks are already allocated to `seq.seq_id`; hold it until `admit`."""
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv[seq.seq_id] = seq

    def admit(self, seqs: list[Sequence]) -> None:
        """KV arrived for these (now computed) sequences: run them, or queue if full."""
        for seq in seqs:
            self.waiting_for_kv.pop(seq.seq_id, None)
            if len(self.running) < self.config.max_num_seqs:
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
            else:
                seq.status = SequenceStatus.WAITING
                self._enqueue(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` shares `parent`'s blocks (copy-on-write) and runs beside it."""
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.status = parent.status
        if parent.status is SequenceStatus.RUNNING:
            self.running.append(child)

    def check_reserve(self, seq: Sequence) -> ReserveCheck:
        """Decode admission of `seq` (no blocks yet, not queued): see `ReserveCheck`."""
        bm = self.block_manager
        prompt = bm.blocks_for(seq.num_tokens)
        live = [*self.running, *self.waiting, *self.waiting_for_kv.values()]
        growth = sum(self._growth_blocks(s) for s in live) + self._growth_blocks(seq) - prompt
        watermark = int(self.config.watermark * bm.num_allocatable)
        return ReserveCheck(prompt, bm.num_free_blocks, growth, watermark, idle=not live)

    def _growth_blocks(self, seq: Sequence) -> int:
        """Blocks `seq` (and its choices still to fork) may still need to hold the KV of
        its next `reserve_decode_tokens` tokens, capped by max_tokens and max_model_len."""
        bm = self.block_manager
        left = max(0, seq.params.max_tokens - len(seq.output_token_ids))
        goal = bm.blocks_for(min(seq.num_tokens + min(self.config.reserve_decode_tokens, left),
                                 self.max_model_len))
        table = bm.block_table(seq.seq_id)
        need = max(0, goal - len(table))
        if table and bm.ref_count(table[-1]) > 1:
            need += 1  # a shared last block is copied before it is written (at most once too many)
        # A choice still to fork shares the full blocks only: its partial block is its own.
        return need + seq.pending_forks * (goal - seq.num_tokens // bm.block_size)

    # --------------------------------------------------------------- stepping
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        copies: list[BlockCopy] = []
        loads: list[BlockLoad] = []
        reads: list[TierRead] = []
        held = self.short_first.held_back(self.running,
                                          room=len(self.running) < self.config.max_num_seqs)
        budget = self._schedule_running(budget, scheduled, preempted, copies, held)
        # After a preemption there is no room to admit anything new this step.
        if not preempted:
            self._schedule_waiting(budget, scheduled, copies, held, loads, reads)
        chunks = [self._chunk(s.seq, s.num_new_tokens) for s in scheduled]
        for chunk, s in zip(chunks, scheduled, strict=True):
            prompt_end = s.seq.num_prompt_tokens
            self.num_prompt_tokens_computed += max(0, min(chunk.end_pos, prompt_end) - chunk.start_pos)
        return SchedulerOutput(chunks, [s.seq for s in scheduled], preempted, copies, tuple(loads),
                               tuple(reads))

    def land_tier_reads(self, landed: list[tuple[int, BlockLoad]]) -> None:
        """The engine's reads for these parked sequences ended, each `(seq id, load)`
        with the leading blocks that arrived whole (fewer than asked: the rest is
        recomputed). They go back to the front of WAITING, in the order they came."""
        back = [r for seq_id, load in landed if (r := self.tier_reads.land(seq_id, load)) is not None]
        for r in back:
            self.waiting_for_kv.pop(r.seq.seq_id, None)
            r.seq.num_computed_tokens = r.hit_tokens
            self._count_hit(r.seq, r.hit_tokens, r.tier_tokens)
            r.seq.status = SequenceStatus.WAITING
            self.short_first.queued(r.seq)
        self.waiting.extendleft(reversed([r.seq for r in back]))

    def mark_computed(self, output: SchedulerOutput) -> None:
        """The runner computed `output`: advance progress and cache full blocks."""
        for chunk, seq in zip(output.chunks, output.seqs, strict=True):
            seq.num_computed_tokens = chunk.end_pos - chunk.num_draft_tokens
            self.block_manager.cache_full_blocks(seq.seq_id, seq.token_ids, seq.num_computed_tokens,
                                                 seq.prefix_root)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End `seq` wherever it is; free its blocks unless it is FINISHED_PREFILLED."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.short_first.dequeued(seq)
        else:
            self.waiting_for_kv.pop(seq.seq_id, None)
        self.tier_reads.forget(seq.seq_id)
        if status is not SequenceStatus.FINISHED_PREFILLED:
            self.block_manager.free(seq.seq_id)
        self.short_first.forget(seq.seq_id)
        seq.status = status

    def release(self, seq: Sequence) -> None:
        """Free the blocks a FINISHED_PREFILLED sequence held for its KV transfer."""
        self.block_manager.free(seq.seq_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    # -------------------------------------------------------------- internals
    def _enqueue(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.short_first.queued(seq)

    def _schedule_running(
        self,
        budget: int,
        scheduled: list[ScheduledSeq],
        preempted: list[Sequence],
        copies: list[BlockCopy],
        held: set[int],
    ) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.seq_id in held:  # a long prefill's chunk waits a step for a short prompt
                i += 1
                continue
            num_new = self._fit_drafts(seq, min(seq.num_uncomputed_tokens + len(seq.spec_token_ids),
                                                budget, self._prefill_cap))
            if num_new <= 0:
                i += 1
                continue
            alloc = None
            while alloc is None:
                end = seq.num_computed_tokens + num_new
                alloc = self.block_manager.allocate_slots(seq.seq_id, end, seq.num_computed_tokens)
                if alloc is None and seq.spec_token_ids:
                    num_new = self._fit_drafts(seq, num_new - len(seq.spec_token_ids))
                    continue
                if alloc is None:
                    # Victims come from the tail (latest admitted); never from already
                    # scheduled sequences, which all sit before index i.
                    victim = self.running.pop()
                    self._preempt(victim)
                    preempted.append(victim)
                    if victim is seq:
                        return budget
            copies.extend(alloc.copies)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(
        self, budget: int, scheduled: list[ScheduledSeq], copies: list[BlockCopy], held: set[int],
        loads: list[BlockLoad], reads: list[TierRead],
    ) -> None:
        """Admit WAITING sequences FCFS from the head. A held-back one is set aside and
        put back at the front in its place, so the queue's order never changes and a
        step costs O(admitted + held), not O(len(waiting)). One whose next blocks the
        KV tiers hold is parked instead (`_park`): it takes no budget this step."""
        bm = self.block_manager
        skipped: list[Sequence] = []
        while self.waiting and budget > 0:
            seq = self.waiting[0]
            if seq.seq_id in held or not self._adapter_fits(seq):
                skipped.append(self.waiting.popleft())
                continue
            width = seq.num_choices_when_running
            live = len(self.running) + len(self.tier_reads)  # a parked sequence runs next
            if live and live + width > self.config.max_num_seqs:
                break
            first_admission = seq.num_computed_tokens == 0 and not bm.has_owner(seq.seq_id)
            # prompt_logprobs needs the logits of every prompt position: computed, not cached.
            reads_cache = first_admission and seq.params.prompt_logprobs is None
            prefix = bm.match_prefix(seq.token_ids, seq.prefix_root) if reads_cache else NO_HIT
            in_tiers = self._in_tiers(seq, prefix) if reads_cache else []
            if in_tiers:
                if not self._park(seq, prefix, in_tiers, reads):
                    break
                continue
            computed = max(seq.num_computed_tokens, prefix.num_tokens)
            num_new = seq.num_tokens - computed
            if num_new > min(budget, self._prefill_cap):
                if not self.config.enable_chunked_prefill:
                    break
                num_new = min(budget, self._prefill_cap)
            alloc = bm.allocate_slots(seq.seq_id, computed + num_new, computed, prefix)
            if alloc is None:
                break
            copies.extend(alloc.copies)
            load = self.tier_reads.take_load(seq.seq_id)  # a landed tier read's bytes
            if load is not None:
                loads.append(load)
            if prefix.num_tokens:
                self._count_hit(seq, prefix.num_tokens, 0)
            seq.num_computed_tokens = computed
            self.short_first.dequeued(self.waiting.popleft())
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))

    def _park(self, seq: Sequence, prefix: PrefixHit, digests: list[bytes], reads: list[TierRead]) -> bool:
        """Take the blocks of `seq`'s pool hit and of the `digests` the tiers hold, and
        park it WAITING_FOR_KV until the engine's read of them lands (`land_tier_reads`);
        False (nothing changed) if the pool has no room for them."""
        bm = self.block_manager
        end = prefix.num_tokens + len(digests) * bm.block_size
        if bm.allocate_slots(seq.seq_id, end, prefix.num_tokens, prefix) is None:
            return False
        read = TierRead(seq.seq_id, tuple(bm.block_table(seq.seq_id)[len(prefix.block_ids):]), tuple(digests))
        seq.num_computed_tokens = prefix.num_tokens
        self.short_first.dequeued(self.waiting.popleft())
        seq.status = SequenceStatus.WAITING_FOR_KV
        self.waiting_for_kv[seq.seq_id] = seq
        self.tier_reads.park(seq, read, prefix.num_tokens)
        reads.append(read)
        return True

    def _count_hit(self, seq: Sequence, hit_tokens: int, tier_tokens: int) -> None:
        """Prefix-cache accounting of an admission whose first `hit_tokens` were not
        computed here, `tier_tokens` of them read from the KV tiers."""
        if not hit_tokens:
            return
        self.num_cached_tokens_hit += hit_tokens
        self.num_tier_tokens_hit += tier_tokens
        if seq.num_cached_tokens == 0:
            seq.num_cached_tokens = min(hit_tokens, seq.num_prompt_tokens)

    def _in_tiers(self, seq: Sequence, prefix: PrefixHit) -> list[bytes]:
        """The digests of the blocks after the pool hit that some tier holds (an existence
        check, no read), as far as a hit may reach (never the last token)."""
        digests = self.tier_digests(seq, prefix) if self.tiers is not None else []
        if not digests:
            return []
        assert self.tiers is not None
        return digests[:self.tiers.present(digests)]

    def tier_digests(self, seq: Sequence, prefix: PrefixHit) -> list[bytes]:
        """The digests of the blocks after the pool hit a tier hit may cover (admission and
        a decode reservation, `LLMEngine.reserve_remote`, read them off the loop)."""
        bs = self.block_manager.block_size
        limit = cacheable_blocks(seq.num_tokens, bs) if self.block_manager.enable_prefix_caching else 0
        start = len(prefix.block_ids)
        digests: list[bytes] = []
        parent = prefix.block_hashes[-1] if prefix.block_hashes else seq.prefix_root
        for i in range(start, limit):
            parent = block_hash(parent, seq.token_ids[i * bs:(i + 1) * bs])
            digests.append(parent)
        return digests

    def _adapter_fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps the running adapters within `max_loras` (a sequence
        whose adapter does not fit waits for a running adapter's sequences to end)."""
        if not seq.lora_id:
            return True
        active = {s.lora_id for s in self.running if s.lora_id}
        return seq.lora_id in active or len(active) < self.max_loras

    @staticmethod
    def _fit_drafts(seq: Sequence, num_new: int) -> int:
        """Cut `seq`'s drafts to what `num_new` scheduled tokens leave room for."""
        room = max(0, num_new - seq.num_uncomputed_tokens)
        if len(seq.spec_token_ids) > room:
            seq.spec_token_ids = seq.spec_token_ids[:room]
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq.seq_id)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        self.short_first.queued(seq)
        self.num_preemptions += 1

    def _chunk(self, seq: Sequence, num_new: int) -> SeqChunk:
        start = seq.num_computed_tokens
        drafts = seq.spec_token_ids  # scheduled whole (`_fit_drafts`), behind the last token
        end = start + num_new - len(drafts)
        return SeqChunk(
            token_ids=seq.token_ids[start:end] + drafts,
            start_pos=start,
            block_table=self.block_manager.block_table(seq.seq_id),
            need_logits=end == seq.num_tokens,
            num_draft_tokens=len(drafts),
            # Prompt logprobs: every row of a chunk that reaches into the prompt.
            prompt_logits=seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens and not drafts,
            lora_id=seq.lora_id,
        )
