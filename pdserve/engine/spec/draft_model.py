"""Draft-model proposing: a small model with the target's tokenizer guesses K tokens.

Where the draft's KV lives: on the worker that decodes, in a pool of its own. Where
the draft's KV for the prompt is made (`draft_kv` in `--speculative-config`):
- "decode" (the default): the decode worker prefills the draft over a sequence's
  prompt (and any output so far) the first time it drafts for it, in the same
  forward that drafts its first token. Nothing of the draft crosses the handoff, the
  compatibility hash stays the target's, and a recovered stream rebuilds its draft
  state the same way. The price: one draft prefill inside a decode step per arriving
  sequence, which stalls the other streams of that step.
- "prefill": the prefill worker loads the draft too, prefills it right after the
  target (`prefill`), and ships its KV as a second transfer (pdserve/worker/draft_kv.py);
  the decode worker reserves draft blocks next to the target's (`reserve`) and
  `adopt`s them, so its first speculative step prefills no draft. The layout hash
  covers the draft (pdserve/engine/spec/draft_kv.py). Decode never waits for the draft's KV:
  a sequence whose draft KV is still arriving decodes without drafts (`await_kv`) for
  a few steps. A draft transfer that fails or does not land by then (`give_up`), a
  full draft pool or a forked choice (n > 1) falls back to the local prefill.
Why "decode" stays the default: what shipping costs is certain -- more KV bytes per
prompt token (the draft's KV ships whole prompts), more prefill-worker CPU per prompt,
the draft prefill on the prefill worker's path ahead of the next prompt -- while what it
saves, the draft prefill inside a decode step, did not show above the noise on CPU
(bench/README.md, "Draft KV placement", has the figures and the command). Where decode
runs on its own accelerator with ITL of a few ms, that stall may matter more: measure
there with bench/draft_kv_placement.py before switching.

Per step, for the sequences that draft (greedy drafts; acceptance is the target's
own draw, `pdserve.engine.spec.decoder`, so output is exact whatever the draft proposes):
1. each sequence's draft KV is cut back to the longest prefix of its tokens the
   draft has computed (rejected drafts fall off), then caught up to its last token
   in one batched forward whose logits give draft token 1;
2. K - 1 more batched single-token forwards give tokens 2..K.
Draft blocks of sequences that no longer draft are freed at the next step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import EngineConfig
from pdserve.engine.core.runner_types import SeqChunk
from pdserve.engine.runner.model_runner import ModelRunner
from pdserve.engine.spec.decoder import BatchProposer, DraftInput
from pdserve.engine.spec.draft_kv import draft_engine_config


@dataclass
class _DraftState:
    computed: list[int] = field(default_factory=list)  # tokens whose KV the draft pool holds


class DraftModelProposer:
    """Greedy drafts from a second `ModelRunner` over its own KV pool."""

    def __init__(self, target: EngineConfig, draft_dir: str, num_blocks: int, vocab_size: int,
                 max_model_len: int) -> None:
        self.runner = ModelRunner(draft_engine_config(target, draft_dir, num_blocks))
        if self.runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"draft model {draft_dir} has a vocabulary of {self.runner.model_config.vocab_size}, "
                             f"the target {vocab_size}: a draft must share the target's tokenizer")
        self.max_model_len = min(max_model_len, self.runner.max_model_len)
        self.blocks = BlockManager(self.runner.num_blocks, self.runner.block_size, enable_prefix_caching=False)
        self._states: dict[int, _DraftState] = {}
        # Decoding, their draft KV still arriving into reserved blocks: no drafts yet.
        self._awaiting: set[int] = set()
        # Tokens the draft computed for sequences whose draft KV it did not hold (local
        # draft prefill); with draft_kv=prefill only recovered or forked sequences add here.
        self.prefill_tokens = 0

    # --- draft KV made elsewhere (draft_kv=prefill) ---------------------------

    def reserve(self, seq_id: int, num_tokens: int) -> list[int] | None:
        """Blocks for `num_tokens` tokens of draft KV to arrive in; None: no room (the
        sequence then prefills its draft here). Held until `adopt` or `drop`."""
        if num_tokens > self.max_model_len or self.blocks.allocate_slots(seq_id, num_tokens, 0) is None:
            return None
        return self.blocks.block_table(seq_id)

    def await_kv(self, seq_id: int) -> None:
        """`seq_id` decodes while its draft KV is still arriving into its reserved blocks:
        it drafts nothing (and its blocks are left alone) until `adopt` or `give_up`."""
        self._awaiting.add(seq_id)

    def adopt(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """The reserved blocks hold the draft KV of `token_ids`: count them computed (the
        tokens decoded since are caught up at its next draft)."""
        self._awaiting.discard(seq_id)
        self._states[seq_id] = _DraftState(list(token_ids))

    def give_up(self, seq_id: int, key: int) -> None:
        """`seq_id`'s reserved blocks move to owner `key` (to be dropped once no transfer
        writes into them); the sequence prefills its draft here from its next draft on."""
        self._awaiting.discard(seq_id)
        self.blocks.fork(seq_id, key)
        self.blocks.free(seq_id)

    def drop(self, seq_id: int) -> None:
        """Free `seq_id`'s draft blocks, reserved or adopted."""
        self._awaiting.discard(seq_id)
        self._states.pop(seq_id, None)
        self.blocks.free(seq_id)

    @torch.inference_mode()
    def prefill(self, seq_id: int, token_ids: Sequence[int]) -> list[int] | None:
        """Prefill worker: compute the draft KV of `token_ids` into fresh blocks and return
        them (None: no room); the caller ships them, then `drop`s them."""
        blocks = self.reserve(seq_id, len(token_ids))
        if blocks is not None:
            self.runner.execute([SeqChunk(list(token_ids), 0, blocks, need_logits=True)])
        return blocks

    def retain(self, live: set[int]) -> None:
        """Free the draft KV of every sequence not in `live`."""
        for seq_id in [s for s in self._states if s not in live]:
            del self._states[seq_id]
            self.blocks.free(seq_id)

    @torch.inference_mode()
    def propose_batch(self, inputs: Sequence[DraftInput]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in inputs]
        active = [i for i, x in enumerate(inputs) if self._catch_up_plan(x)]
        if not active:
            return drafts
        chunks = [self._chunk(inputs[i].seq_id, inputs[i].token_ids) for i in active]
        while active:
            tokens = torch.argmax(self.runner.execute(chunks), dim=-1).tolist()  # one row per chunk
            for i, tok in zip(active, tokens, strict=True):
                drafts[i].append(int(tok))
            active = [i for i in active if len(drafts[i]) < inputs[i].num_tokens]
            chunks = [self._chunk(inputs[i].seq_id, [*inputs[i].token_ids, *drafts[i]]) for i in active]
        return drafts

    def _catch_up_plan(self, x: DraftInput) -> bool:
        """Cut the draft KV of `x` back to the prefix it shares with `x.token_ids` and
        reserve slots for the catch-up and every draft; False: no room (or its shipped
        draft KV is still arriving), no drafts."""
        if x.seq_id in self._awaiting:
            return False
        state = self._states.setdefault(x.seq_id, _DraftState())
        tokens = x.token_ids
        keep = 0
        limit = min(len(state.computed), len(tokens) - 1)  # the last token is always recomputed
        while keep < limit and state.computed[keep] == tokens[keep]:
            keep += 1
        del state.computed[keep:]
        self.blocks.trim(x.seq_id, keep)
        end = len(tokens) + x.num_tokens - 1
        if x.num_tokens <= 0 or end > self.max_model_len or \
                self.blocks.allocate_slots(x.seq_id, end, keep) is None:
            self._states.pop(x.seq_id)
            self.blocks.free(x.seq_id)
            return False
        return True

    def _chunk(self, seq_id: int, tokens: Sequence[int]) -> SeqChunk:
        state = self._states[seq_id]
        start = len(state.computed)
        new = list(tokens[start:])
        if start == 0:
            self.prefill_tokens += len(new)
        state.computed.extend(new)
        return SeqChunk(new, start, self.blocks.block_table(seq_id), need_logits=True)


def draft_proposer(config: EngineConfig, runner: ModelRunner) -> BatchProposer | None:
    """The draft-model proposer `config` asks for (None: the default n-gram one)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model" or spec.model is None:
        return None
    return DraftModelProposer(config, spec.model, runner.num_blocks, runner.model_config.vocab_size,
                              runner.max_model_len)
