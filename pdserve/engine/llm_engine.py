"""LLMEngine: requests in, tokens out, one scheduler step at a time.

    engine = LLMEngine(EngineConfig(model_dir=...))
    engine.add_request("r1", prompt_ids, SamplingParams(max_tokens=8))
    while engine.has_unfinished():
        for out in engine.step(): ...

The same engine serves three roles:
- single process / colocated: `add_request` + `step` (or `generate`);
- prefill node: `add_request(..., prefill_only=True)` finishes once the first
  token(s) are sampled (FINISHED_PREFILLED) and keeps the KV blocks until
  `release`; `held_blocks` names them for the transfer. Stepping in two halves
  (`schedule`, then `execute`) lets the node see `completing_prefills` first
  and push each layer's KV from `layer_hook` while the next layer computes;
- decode node: `reserve_remote` allocates blocks the prefill KV is written into,
  `start_remote` marks the prompt computed elsewhere and decodes from token 1.

A structured-output request whose grammar is not compiled yet never waits on the
step loop: `add_request` starts the compile (pdserve/engine/grammar/compiler.py) and
holds the request WAITING_FOR_GRAMMAR, outside the scheduler and holding no block;
each `schedule` queues the ones whose grammar landed and gives up on those whose
compile failed or outlived `grammar_compile_timeout_s` (`take_failed` hands them to
the caller). `reserve_remote` takes only requests whose grammar is ready
(`grammar_ready`): a decode node holds the reservation until it is.

With KV tiers attached, nothing reads a tier on the step loop: a prompt whose
blocks after its pool hit a tier holds is parked by the scheduler while the tiers'
loader thread reads them (`tier_reads`, pdserve/engine/core/tier_reads.py); each
`schedule` first hands the scheduler the reads that landed and, after it, starts
the reads it asked for. A decode reservation's tier blocks are read the same way
(`tier_fills`, `tier_fill`).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from pdserve.common.logprobs import Logprob
from pdserve.common.lora import LoraError, LoraRef
from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import NO_HIT, BlockManager, PrefixHit
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.outputs import (
    EngineStats,
    FailedRequest,
    GenerationResult,
    RequestOutput,
    StepDeltas,
    build_outputs,
    engine_stats,
    generation_result,
)
from pdserve.engine.core.request_checks import check_request
from pdserve.engine.core.reservation import Reservation
from pdserve.engine.core.scheduler import Scheduler, SchedulerOutput
from pdserve.engine.core.sequence import Request, SequenceStatus, finish_status
from pdserve.engine.core.sequence import Sequence as Seq
from pdserve.engine.grammar.compiler import (
    CompiledGrammar,
    GrammarCompileError,
    GrammarCompiler,
    load_tokenizer,
)
from pdserve.engine.grammar.masking import any_constrained, constrain, cut_drafts
from pdserve.engine.grammar.pending import CompilingRequests
from pdserve.engine.lora.checkpoint import LoraWeights
from pdserve.engine.lora.registry import LoraRegistry, lora_stats, register_lora
from pdserve.engine.pool_blocks import PrefixTiers, TierLink, copy_blocks
from pdserve.engine.prompt_logprobs import collect_prompt_logprobs
from pdserve.engine.sampler import Sampler, SampleRow, request_seed
from pdserve.engine.spec.decoder import SpecDecoder, accepted_prefix
from pdserve.engine.spec.draft_model import draft_proposer
from pdserve.engine.tier_fill import READ_TIMEOUT_S, FillState, TierFills

if TYPE_CHECKING:
    from pdserve.engine.runner.model_runner import ModelRunner


class PrefillDone(NamedTuple):
    """A prefill-only request whose prompt the scheduled batch completes."""

    request_id: str
    block_ids: list[int]


class GrammarNotReady(RuntimeError):
    """`reserve_remote` of a request whose grammar still compiles (ask `grammar_ready` first)."""


class LLMEngine:
    """Continuous-batching engine over one model runner."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        if runner is None:
            from pdserve.engine.parallel.runner import make_runner

            runner = make_runner(config)
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(runner.model_config.eos_token_ids)
        self.vocab_size = runner.model_config.vocab_size
        self.max_model_len = runner.max_model_len
        self.block_manager = BlockManager(
            runner.num_blocks, runner.layout.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   config.lora.max_loras if config.lora else 0)
        self.sampler = Sampler()
        eos = sorted(self.eos_token_ids)
        self.grammar = GrammarCompiler(lambda: load_tokenizer(config.model_dir, self.vocab_size, eos), eos,
                                       config.grammar_compile_timeout_s)
        self.spec = (SpecDecoder(config.speculative, self.block_manager, self.max_model_len,
                                 draft_proposer(config, runner))
                     if config.speculative is not None else None)
        self._requests: dict[str, Request] = {}
        self._compiling = CompilingRequests()  # WAITING_FOR_GRAMMAR: off the scheduler
        self._failed: list[FailedRequest] = []
        self._seq_ids = itertools.count()
        self._request_counter = itertools.count()
        self._num_generated = 0
        self._num_steps = 0
        self.tier_link: TierLink | None = None
        self.tier_fills: TierFills[str] | None = None  # decode reservations' blocks, by request id
        self.tier_reads: TierFills[int] | None = None  # parked admissions' blocks, by seq id

    def attach_tiers(self, tiers: PrefixTiers, read_timeout_s: float = READ_TIMEOUT_S,
                     on_read_done: Callable[[], None] | None = None) -> None:
        """Read the KV tiers below the pool on admission (off the loop) and write computed
        blocks down; a read not landed within `read_timeout_s` is given up (recomputed).
        `on_read_done` is called on the loader thread as each read ends (a worker's loop
        wakes from its idle wait)."""
        self.tier_link = TierLink(tiers, self.runner.pool, self.block_manager)
        self.tier_fills = TierFills(self.tier_link, read_timeout_s, on_done=on_read_done)
        self.tier_reads = TierFills(self.tier_link, read_timeout_s, on_done=on_read_done)
        self.scheduler.tiers = tiers

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        *,
        prefill_only: bool = False,
        output_token_ids: Sequence[int] = (),
        choice_index: int = 0, lora: LoraRef | None = None,
    ) -> None:
        """Queue a request; ValueError if it can never fit (length, KV capacity, budget),
        LoraError if its adapter `lora` (None: the base model) cannot be served.

        `output_token_ids` resumes a sequence (n=1) that already generated these tokens
        elsewhere (recovery): they are prefilled with the prompt, count toward
        max_tokens and penalties, and the next draw is output token index len(...).
        `choice_index` (n=1 only) continues choice c of an n>1 request: its seeds are
        drawn from (seed, c, index) and its outputs carry index c.
        """
        req = self._new_request(request_id, prompt_token_ids, params, prefill_only, output_token_ids,
                                choice_index, lora)
        seq = req.seqs[0]
        if params.structured is not None and seq.compiled_grammar is None:
            self._compiling.hold(seq)  # queued by `schedule` once compiled
        else:
            self.scheduler.add(seq)

    def step(self, layer_hook: Callable[[int], None] | None = None) -> list[RequestOutput]:
        """Run one scheduler step; return what each touched request gained."""
        return self.execute(self.schedule(), layer_hook)

    def schedule(self) -> SchedulerOutput:
        """First half of `step`: pick this step's batch (blocks are allocated now).

        Pass it to `execute` before anything else touches the engine."""
        if self._compiling:
            self._admit_compiled()
        self._num_steps += 1
        if self.spec is not None:
            self.spec.propose(self.scheduler.running, len(self.scheduler.running))
            cut_drafts(self.scheduler.running, self.grammar)  # at the first token a grammar rejects
        if self.tier_reads is not None and self.scheduler.tier_reads:
            self._land_tier_reads(self.tier_reads)
        batch = self.scheduler.schedule()
        if batch.tier_reads:
            assert self.tier_reads is not None
            for read in batch.tier_reads:  # read while this step (and the next ones) run
                self.tier_reads.start(read.seq_id, read.block_ids, read.digests)
        return batch

    def execute(
        self, batch: SchedulerOutput, layer_hook: Callable[[int], None] | None = None
    ) -> list[RequestOutput]:
        """Second half of `step`: run the model on `batch`, sample, and report."""
        if batch.is_empty:
            return []
        logits = self._execute(batch, layer_hook)
        self.scheduler.mark_computed(batch)
        if self.tier_link is not None:
            self.tier_link.write_down()
        outputs = self._postprocess(batch, logits)
        if self.spec is not None:
            self.spec.retain(self.scheduler.running)  # a draft model's KV of ended sequences
        if self.loras is not None and self.loras.over_bound():  # adapters kept for requests now ended
            self.loras.trim(self.live_loras())
        return outputs

    def completing_prefills(self, batch: SchedulerOutput) -> list[PrefillDone]:
        """Prefill-only requests whose prompt `batch` finishes, with their blocks.

        Once `execute`'s `layer_hook(i)` runs, layer i of *every* listed block is final:
        blocks of earlier chunks and prefix-cache hits were complete before this step.
        The blocks are the ones `held_blocks` names after the step."""
        done = []
        for chunk, seq in zip(batch.chunks, batch.seqs, strict=True):
            if seq.prefill_only and chunk.need_logits:
                done.append(PrefillDone(seq.request_id, self.block_manager.block_table(seq.seq_id)))
        return done

    def abort(self, request_id: str) -> bool:
        """End a request in any state and free its blocks; False if unknown."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        if self.tier_fills is not None:
            self.tier_fills.drop(request_id)
        if self._compiling.drop(request_id):  # never queued, holds nothing
            return True
        for seq in req.seqs:
            if self.tier_reads is not None:
                self.tier_reads.drop(seq.seq_id)  # a read still running never reaches the pool
            if seq.status is SequenceStatus.FINISHED_PREFILLED:
                self.scheduler.release(seq)
                seq.status = SequenceStatus.FINISHED_ABORTED
            elif not seq.is_finished:
                self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        if self.spec is not None:
            self.spec.retain(self.scheduler.running)
        return True

    def has_unfinished(self) -> bool:
        """Anything queued, running, awaiting KV, or waiting for its grammar."""
        return self.scheduler.num_unfinished > 0 or bool(self._compiling)

    @property
    def num_compiling(self) -> int:
        """Requests WAITING_FOR_GRAMMAR: held off the scheduler until their grammar compiles."""
        return len(self._compiling)

    def take_failed(self) -> list[FailedRequest]:
        """The requests given up on since the last call (their grammar did not compile, or
        not within the compile timeout); the engine no longer knows them."""
        failed, self._failed = self._failed, []
        return failed

    def grammar_ready(self, params: SamplingParams, since: float) -> bool:
        """Whether `params`' grammar is compiled (True without one); False while it
        compiles (the first call starts it) and `since` is within the compile timeout;
        GrammarCompileError (a ValueError) when it failed or ran out of time."""
        return params.structured is None or self.grammar.poll(params.structured, since) is not None

    def generate(
        self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[GenerationResult]:
        """Run `prompts` to completion together; the single-process reference."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"generate-{next(self._request_counter)}-{i}" for i in range(len(prompts))]
        for rid, prompt, p in zip(ids, prompts, plist, strict=True):
            self.add_request(rid, prompt, p)
        reqs = {rid: self._requests[rid] for rid in ids}
        while any(not r.finished for r in reqs.values()):
            batch = self.schedule()
            if batch.is_empty and self._compiling:
                self.grammar.wait(0.05)  # nothing else to run until a grammar lands
            elif batch.is_empty and self.tier_reads is not None and self.scheduler.tier_reads:
                self.tier_reads.wait_any(0.05)  # nothing else to run until a tier read lands
            self.execute(batch)
            for failed in self.take_failed():
                if failed.request_id in reqs:
                    for rid in ids:
                        self.abort(rid)
                    raise GrammarCompileError(failed.param, failed.reason)
        return [generation_result(reqs[rid]) for rid in ids]

    def seq_id(self, request_id: str) -> int:
        """The id of the request's first sequence (what keys its draft-model KV)."""
        return self._requests[request_id].seqs[0].seq_id

    # -------------------------------------------------------------- prefill node
    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks holding a FINISHED_PREFILLED request's prompt KV ([] if none held)."""
        req = self._requests.get(request_id)
        if req is None:
            return []
        for seq in req.seqs:
            if seq.status is SequenceStatus.FINISHED_PREFILLED:
                return self.block_manager.block_table(seq.seq_id)
        return []

    def release(self, request_id: str) -> None:
        """The KV transfer was acked: free a prefill-only request's held blocks."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if seq.status is SequenceStatus.FINISHED_PREFILLED:
                self.scheduler.release(seq)

    # --------------------------------------------------------------- decode node
    def reserve_remote(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        output_token_ids: Sequence[int] = (),
        choice_index: int = 0,
        reuse_prefix: bool = False, lora: LoraRef | None = None,
    ) -> Reservation:
        """Allocate blocks for the prompt's KV (WAITING_FOR_KV) if decode admission
        (`Scheduler.check_reserve`) grants it; a refusal reserves nothing.

        `output_token_ids`, `choice_index`: a resumed sequence (recovery); its KV arrives
        with the prompt's, as in `add_request`. `reuse_prefix`: leading blocks this
        engine's prefix cache already holds are pinned instead (`cached_blocks`), and
        only the rest are reserved for the transfer (suffix-only handoff).
        A structured-output request whose grammar is not compiled yet is refused with
        GrammarNotReady, reserving nothing: call once `grammar_ready` says it is.
        """
        req = self._new_request(request_id, prompt_token_ids, params, False, output_token_ids,
                                choice_index, lora)
        seq = req.seqs[0]
        if params.structured is not None and seq.compiled_grammar is None:
            del self._requests[request_id]
            raise GrammarNotReady(f"request {request_id!r}: its grammar is still compiling")
        check = self.scheduler.check_reserve(seq)
        hit = self.block_manager.match_prefix(seq.token_ids, seq.prefix_root) if reuse_prefix else NO_HIT
        if not check.ok or self.block_manager.allocate_slots(seq.seq_id, seq.num_tokens, hit.num_tokens, hit) is None:
            del self._requests[request_id]
            return Reservation([], check)
        self.scheduler.add_waiting_for_kv(seq)
        cached = len(hit.block_ids) + (self._fill_reserved(request_id, seq, hit) if reuse_prefix else 0)
        return Reservation(self.block_manager.block_table(seq.seq_id)[cached:], check, cached)

    def _fill_reserved(self, request_id: str, seq: Seq, hit: PrefixHit) -> int:
        """How many reserved blocks right after the pool hit `hit` the KV tiers hold; they
        are held like the pool hit (the transfer brings only the blocks after them) and
        read off the loop meanwhile (pdserve/engine/tier_fill.py: `tier_fill`)."""
        if self.tier_fills is None:
            return 0
        digests = self.scheduler.tier_digests(seq, hit)
        n = self.tier_fills.present(digests) if digests else 0
        if n:
            at = len(hit.block_ids)
            self.tier_fills.start(request_id, self.block_manager.block_table(seq.seq_id)[at:at + n], digests[:n])
        return n

    def tier_fill(self, request_id: str) -> FillState:
        """Whether a reservation's blocks from the KV tiers are in (poll until not PENDING
        before `start_remote`; FAILED: abort it and retry the request)."""
        return self.tier_fills.state(request_id) if self.tier_fills is not None else FillState.NONE

    def start_remote(
        self,
        request_id: str,
        first_token_ids: Sequence[int],
        first_logprobs: Sequence[Logprob | None] | None = None,
    ) -> RequestOutput:
        """The prompt KV is in the reserved blocks: append each choice's first token, run.

        Returns finish reasons of choices the first token already ends (no new tokens).
        """
        req = self._requests[request_id]
        parent = req.seqs[0]
        if parent.status is not SequenceStatus.WAITING_FOR_KV:
            raise ValueError(f"request {request_id!r} is not waiting for KV")
        if self.tier_fills is not None and self.tier_fills.pending(request_id):
            raise ValueError(f"request {request_id!r}: its blocks from the KV tiers are not in yet")
        if len(first_token_ids) != req.params.n:
            raise ValueError(f"need {req.params.n} first tokens, got {len(first_token_ids)}")
        parent.num_computed_tokens = parent.num_tokens
        self.block_manager.cache_full_blocks(parent.seq_id, parent.token_ids, parent.num_computed_tokens,
                                             parent.prefix_root)
        self._fork_choices(parent)
        lps = list(first_logprobs) if first_logprobs is not None else [None] * len(req.seqs)
        live = []
        for seq, tok, lp in zip(req.seqs, first_token_ids, lps, strict=True):
            seq.append_token(int(tok), lp)
            status = finish_status(seq, self.eos_token_ids, self.max_model_len)
            if status is None:
                live.append(seq)
            else:
                self.scheduler.finish(seq, status)
        self.scheduler.admit(live)
        out = build_outputs([req], {}, {}, include_finished=True)[0]
        if req.finished:
            del self._requests[request_id]
        return out

    # ---------------------------------------------------------------------- LoRA
    @property
    def loras(self) -> LoraRegistry | None:
        """The runner's adapters (None: no LoRA, or a parallel runner, which serves none)."""
        return getattr(self.runner, "loras", None)

    def live_loras(self) -> set[str]:
        """Fingerprints of the adapters of every sequence queued or running."""
        s = self.scheduler
        return {q.lora_id for q in (*s.running, *s.waiting, *s.waiting_for_kv.values()) if q.lora_id}

    def install_lora(self, ref: LoraRef, weights: LoraWeights) -> None:
        """Keep an adapter read off the loop (`LoraRegistry.read`), between two steps."""
        if self.loras is None:
            raise LoraError(f"LoRA adapter {ref.name!r}: LoRA is not enabled (--enable-lora)")
        self.loras.install(ref, weights, self.live_loras())

    # --------------------------------------------------------------------- stats
    def stats(self) -> EngineStats:
        loras = self.loras
        s = self.scheduler
        return engine_stats(s, self.block_manager, self._num_generated, self._num_steps,
                            self.spec.stats() if self.spec is not None else None,
                            lora_stats(loras, s.running, [*s.waiting, *s.waiting_for_kv.values()]) if loras else None,
                            self.num_compiling)

    # ----------------------------------------------------------------- internals
    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        prefill_only: bool,
        output_token_ids: Sequence[int] = (), choice_index: int = 0, lora: LoraRef | None = None,
    ) -> Request:
        params.validate()
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_token_ids]
        outputs = [int(t) for t in output_token_ids]
        check_request(prompt, outputs, params, choice_index, vocab_size=self.vocab_size,
                      max_model_len=self.max_model_len, blocks=self.block_manager,
                      scheduler=self.config.scheduler)
        # Compiled before it is queued: now if cached, else `add_request` holds it until it is.
        compiled: CompiledGrammar | None = None
        if params.structured is not None:
            compiled = self.grammar.poll(params.structured, time.monotonic())
        if lora is not None:  # read and checked (or refused) before it is queued
            register_lora(self.loras, lora, self.live_loras())
        counter = next(self._request_counter)
        seed = params.seed if params.seed is not None else request_seed(self.config.seed, counter)
        seq = Seq(
            seq_id=next(self._seq_ids),
            request_id=request_id,
            choice_index=choice_index,
            prompt_token_ids=prompt,
            params=params,
            sampling_seed=seed,
            output_token_ids=outputs,
            pending_forks=params.n - 1,
            prefill_only=prefill_only,
            compiled_grammar=compiled,
            lora=lora,
        )
        req = Request(request_id, prompt, params, prefill_only, [seq])
        self._requests[request_id] = req
        return req

    def _land_tier_reads(self, fills: TierFills[int]) -> None:
        """Hand the scheduler the parked sequences whose tier read ended: the blocks read
        and checked (all, or the leading run before one that failed or timed out)."""
        landed = []
        for seq in self.scheduler.tier_reads.seqs:
            got = fills.take(seq.seq_id)
            if got.state is not FillState.PENDING:
                landed.append((seq.seq_id, got.load))
        if landed:
            self.scheduler.land_tier_reads(landed)

    def _admit_compiled(self) -> None:
        """Queue the held requests whose grammar landed; give up on those it failed."""
        landed = self._compiling.poll(self.grammar)
        for seq in landed.ready:
            self.scheduler.add(seq)
        for failed in landed.failed:
            del self._requests[failed.request_id]
        self._failed += landed.failed

    def _execute(
        self, batch: SchedulerOutput, layer_hook: Callable[[int], None] | None
    ) -> torch.Tensor:
        copy_blocks(self.runner.pool, batch.block_copies)
        if batch.block_loads and self.tier_link is not None:
            self.tier_link.load(batch.block_loads)
        return self.runner.execute(batch.chunks, layer_hook)

    def _postprocess(self, batch: SchedulerOutput, logits: torch.Tensor) -> list[RequestOutput]:
        collect_prompt_logprobs(batch.chunks, batch.seqs, logits, self._requests)
        rows, seqs = self._sample_rows(batch)
        if any_constrained(seqs):  # masks along drafts too (pdserve.engine.grammar.masking)
            constrain(logits, rows, seqs, self.grammar)
        samples = self.sampler(logits, rows)
        deltas = StepDeltas()
        touched: dict[str, Request] = {}
        at = 0
        for seq in seqs:
            drafts, seq.spec_token_ids = seq.spec_token_ids, []
            group = samples[at:at + 1 + len(drafts)]
            at += len(group)
            kept = accepted_prefix(drafts, [s.token_id for s in group])
            for sample in group[:kept]:
                seq.append_token(sample.token_id, sample.logprob)
                self._num_generated += 1
                deltas.add(seq, sample.token_id, sample.logprob)
                status = finish_status(seq, self.eos_token_ids, self.max_model_len)
                if status is not None:
                    self.scheduler.finish(seq, status)
                    break
            if drafts and self.spec is not None:
                self.spec.settle(seq, drafts, kept)
            touched[seq.request_id] = self._requests[seq.request_id]
        outputs = build_outputs(list(touched.values()), deltas.tokens, deltas.logprobs)
        for req in touched.values():
            if req.finished and not req.holds_blocks:
                del self._requests[req.request_id]
        return outputs

    def _sample_rows(self, batch: SchedulerOutput) -> tuple[list[SampleRow], list[Seq]]:
        """One row per choice whose chunk reached its end, plus one per draft token of
        it (row j as if drafts[:j] had been generated one by one: pdserve.engine.spec); the n>1
        fork happens here (a forking chunk carries no drafts)."""
        rows: list[SampleRow] = []
        seqs: list[Seq] = []
        logits_index = 0
        for chunk, seq in zip(batch.chunks, batch.seqs, strict=True):
            base, logits_index = logits_index + chunk.first_sampled_row, logits_index + chunk.num_logits
            if not chunk.need_logits:
                continue
            for s in [seq, *self._fork_choices(seq)]:
                out = s.output_token_ids
                for j in range(1 + len(s.spec_token_ids)):
                    rows.append(SampleRow(base + j, s.params, s.sampling_seed, s.choice_index,
                                          len(out) + j, s.prompt_token_ids,
                                          out + s.spec_token_ids[:j] if j else out))
                seqs.append(s)
        return rows, seqs

    def _fork_choices(self, parent: Seq) -> list[Seq]:
        """Create the parent's pending sibling choices, sharing its blocks copy-on-write."""
        children = []
        req = self._requests[parent.request_id]
        for _ in range(parent.pending_forks):
            child = parent.fork(next(self._seq_ids), len(req.seqs))
            self.scheduler.fork(parent, child)
            req.seqs.append(child)
            children.append(child)
        parent.pending_forks = 0
        return children
