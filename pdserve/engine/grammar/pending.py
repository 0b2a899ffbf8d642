"""Requests whose grammar is still compiling, held off the scheduler (WAITING_FOR_GRAMMAR).

The engine puts a structured-output request here when its grammar is not in the
compiler's cache; `poll` (once per engine step, never blocking) hands back the ones
whose grammar landed, to be queued, and the ones whose compile failed or outlived
the compile timeout, counted from their arrival, to be refused. A held request holds
no KV block and no scheduler slot, so other requests keep stepping meanwhile.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from pdserve.engine.core.outputs import FailedRequest
from pdserve.engine.core.sequence import Sequence, SequenceStatus
from pdserve.engine.grammar.compiler import GrammarCompileError, GrammarCompiler


class Landed(NamedTuple):
    """What one `poll` found: sequences to queue now (their `compiled_grammar` set) and
    requests given up on (already forgotten here)."""

    ready: list[Sequence]
    failed: list[FailedRequest]


class CompilingRequests:
    def __init__(self) -> None:
        self._held: dict[str, tuple[Sequence, float]] = {}  # request id -> (sequence, arrival)

    def hold(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING_FOR_GRAMMAR
        self._held[seq.request_id] = (seq, time.monotonic())

    def drop(self, request_id: str) -> bool:
        """Forget an aborted request (it never reached the scheduler); False if not held."""
        seq_since = self._held.pop(request_id, None)
        if seq_since is None:
            return False
        seq_since[0].status = SequenceStatus.FINISHED_ABORTED
        return True

    def poll(self, compiler: GrammarCompiler) -> Landed:
        landed = Landed([], [])
        for rid, (seq, since) in list(self._held.items()):
            assert seq.params.structured is not None
            try:
                compiled = compiler.poll(seq.params.structured, since)
            except GrammarCompileError as e:  # invalid, failed, or out of time
                del self._held[rid]
                seq.status = SequenceStatus.FINISHED_ABORTED
                landed.failed.append(FailedRequest(rid, str(e), e.param))
                continue
            if compiled is not None:
                del self._held[rid]
                seq.compiled_grammar = compiled
                landed.ready.append(seq)
        return landed

    def __len__(self) -> int:
        return len(self._held)
