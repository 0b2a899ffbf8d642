"""Short prompts first, within a bounded wait, when prefills are chunked.

With `long_prefill_token_threshold` N > 0 a prompt of more than N uncomputed tokens is
*long*: it is prefilled N tokens a step. A prompt of at most N is *short*: it fits in
one step. On a device where a step's time grows with its tokens (a CPU thread), a
short prompt that shares a step with a long prompt's chunk waits for that chunk too:
its time to first token is the whole chunk, on top of the step it arrived during.

So while a short prompt is waiting (and there is room to admit one more sequence),
a step holds back every long prefill, running or waiting: the short prompts get a
step of their own, and the long ones continue the step after. Decode tokens are never
held back (a decode step's tokens are never more than N). The wait is bounded: a long
prompt held back `max_held_steps` steps in a row runs in the next step whatever
waits, so a stream of short prompts slows a long one by at most that many steps per
chunk, never starves it. With N = 0 (no chunking) nothing is held back.

Plain Python over `Sequence` progress counters, no torch: the scheduler asks
`held_back` once per step.
"""

from __future__ import annotations

from collections.abc import Iterable
from collections.abc import Sequence as Seq

from pdserve.engine.core.sequence import Sequence

MAX_HELD_STEPS = 4


class ShortFirst:
    """The scheduler reports every WAITING entry and exit (`queued`, `dequeued`), so a
    step learns whether a short prompt waits, and which long ones do, without walking
    the queue: with nothing held back a step costs O(running), whatever WAITING holds."""

    def __init__(self, long_prefill_tokens: int, max_held_steps: int = MAX_HELD_STEPS) -> None:
        self.long_prefill_tokens = long_prefill_tokens  # 0: off
        self.max_held_steps = max_held_steps
        self._held: dict[int, int] = {}  # seq id -> steps held back in a row
        # A WAITING sequence's progress does not move until it leaves the queue, so its
        # class is fixed on entry.
        self._num_short_waiting = 0
        self._long_waiting: dict[int, Sequence] = {}

    def is_short(self, seq: Sequence) -> bool:
        return seq.num_uncomputed_tokens <= self.long_prefill_tokens

    def queued(self, seq: Sequence) -> None:
        """`seq` entered WAITING."""
        if self.long_prefill_tokens <= 0:
            return
        if self.is_short(seq):
            self._num_short_waiting += 1
        else:
            self._long_waiting[seq.seq_id] = seq

    def dequeued(self, seq: Sequence) -> None:
        """`seq` left WAITING (admitted or ended)."""
        if self.long_prefill_tokens <= 0:
            return
        if self._long_waiting.pop(seq.seq_id, None) is None:
            self._num_short_waiting -= 1

    def held_back(self, running: Seq[Sequence], room: bool) -> set[int]:
        """Ids of the long prefills this step leaves out (see the module docstring);
        `room`: one more sequence can be admitted now (else no short one could run)."""
        if self.long_prefill_tokens <= 0 or not room or not self._num_short_waiting:
            if self._held:
                self._held.clear()
            return set()
        held: set[int] = set()
        for seq in [*running, *self._long_waiting.values()]:
            if self.is_short(seq):
                continue
            n = self._held.get(seq.seq_id, 0)
            if n < self.max_held_steps:
                self._held[seq.seq_id] = n + 1
                held.add(seq.seq_id)
            else:
                self._held.pop(seq.seq_id, None)  # its turn: runs this step
        return held

    def forget(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def tracks(self, waiting: Iterable[Sequence]) -> bool:
        """Integrity check (tests): the short count and long set match `waiting` exactly."""
        if self.long_prefill_tokens <= 0:
            return not self._num_short_waiting and not self._long_waiting
        seqs = list(waiting)
        longs = {s.seq_id for s in seqs if not self.is_short(s)}
        return longs == set(self._long_waiting) and self._num_short_waiting == len(seqs) - len(longs)
