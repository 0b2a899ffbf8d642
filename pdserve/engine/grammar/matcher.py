"""The grammar state of one sequence (torch-free).

A `GrammarMatcher` has consumed the first `num_consumed` output tokens of its sequence.
`sync(output)` consumes the rest, so the state is always rebuilt from the tokens the
sequence holds: a decode worker replays the prefill's first token, a recovered request
replays everything streamed before the failure, and no token is ever consumed twice.

`accepted_prefix(tokens)` checks a continuation without committing it: speculative
decoding cuts a draft at the first token it rejects.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from pdserve.engine.grammar.compiler import CompiledGrammar

log = logging.getLogger(__name__)


class GrammarMatcher:
    def __init__(self, compiled: CompiledGrammar) -> None:
        self._m = compiled.new_matcher()
        self._eos = compiled.eos_token_ids
        self._first_mask = compiled.first_mask  # the mask before any token, from compile time
        self.num_consumed = 0
        self._in_matcher = 0  # tokens the llguidance matcher holds (synced + a draft's, for now)

    def sync(self, output_token_ids: Sequence[int]) -> bool:
        """Consume the output tokens not consumed yet; False if the grammar rejected one
        (the matcher then stays in its error state)."""
        new = output_token_ids[self.num_consumed:]
        self.num_consumed = len(output_token_ids)
        self._in_matcher += len(new)
        if new and not self._m.is_error() and not self._m.consume_tokens([int(t) for t in new]):
            log.warning("grammar rejected an output token: %s", self._m.get_error()[:200])
        return not self._m.is_error()

    def accepted_prefix(self, tokens: Sequence[int]) -> int:
        """How many leading `tokens` (continuing the consumed output) the grammar accepts;
        nothing is committed."""
        if self._m.is_error():
            return 0
        return int(self._m.validate_tokens([int(t) for t in tokens]))

    def allowed_along(self, tokens: Sequence[int], vocab_size: int) -> list[np.ndarray]:
        """The masks at each position of a draft continuing the consumed output: before
        tokens[0], after tokens[0], ... up to the first token the grammar rejects, so
        `len(result) - 1` tokens are accepted. Nothing is committed: the matcher is
        rolled back to where it was."""
        take = self.accepted_prefix(tokens)
        masks = [self.allowed(vocab_size)]
        for t in tokens[:take]:
            self._m.consume_token(int(t))
            self._in_matcher += 1
            masks.append(self.allowed(vocab_size))
        if take:
            self._m.rollback(take)
            self._in_matcher -= take
        return masks

    def allowed(self, vocab_size: int) -> np.ndarray:
        """Boolean mask of the tokens allowed next. A matcher in its error state (which
        a correct run never reaches) allows only EOS, so the sequence ends."""
        if self._m.is_error():
            mask = np.zeros(vocab_size, dtype=bool)
            mask[[t for t in self._eos if t < vocab_size]] = True
            return mask
        raw = self._first_mask if self._in_matcher == 0 else None
        if raw is None:
            raw = bytes(self._m.compute_bitmask())
        bits = np.frombuffer(raw, dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little").astype(bool)
        if mask.size < vocab_size:
            mask = np.concatenate([mask, np.zeros(vocab_size - mask.size, dtype=bool)])
        return mask[:vocab_size]

    @property
    def is_accepting(self) -> bool:
        """The output consumed so far is a complete match."""
        return bool(self._m.is_accepting())

    @property
    def is_error(self) -> bool:
        return bool(self._m.is_error())
