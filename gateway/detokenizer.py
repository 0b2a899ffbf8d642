"""Incremental detokenization: token ids in, UTF-8-safe text deltas out, with stop strings.

Two stages per `push`:

1. **Decode** only a small window of recent tokens (vLLM/TGI style): the window
   starts at `prefix_offset`, and the text of `ids[prefix_offset:read_offset]`
   was already released. Decoding the window with that prefix keeps decoders
   that look at neighbours (leading-space stripping, byte merging) consistent
   with a full decode. Text ending in U+FFFD is an incomplete multi-byte
   character: it is held back until a later token completes it (or `flush`).
   When the window's text is complete, the window slides forward, so each push
   costs O(new tokens), not O(all text). (While the text keeps ending in an
   incomplete character the window cannot slide: a stream that never completes
   one, e.g. a random model looping on a partial-byte token, re-decodes the
   tokens since the last complete character.)
2. **Stop strings**: released text passes through a buffer that holds back the
   longest suffix that could still become a stop string; when a stop string
   appears, text is truncated there (the stop string itself kept only with
   `include_stop_str`) and nothing more is ever emitted.

Invariant: with no stop string firing, the concatenation of every delta's text
and `flush()` equals `tokenizer.decode(all_ids)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class DetokDelta(NamedTuple):
    text: str  # new text to send (may be empty)
    stopped: bool  # a stop string fired; this or an earlier push ended the text
    stop_reason: str | None  # the stop string that fired, else None


class IncrementalDetokenizer:
    """Turn a stream of token ids into text deltas for one output sequence."""

    def __init__(
        self,
        tokenizer: Decoder,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop_str
        self._ids: list[int] = []
        # Window start; ids[prefix_offset:read_offset] are fully released already.
        self._prefix_offset = 0
        self._read_offset = 0
        # Characters of decode(ids[prefix_offset:]) already passed to stage 2.
        self._released = 0
        self._pending = ""  # released by stage 1, held back by stage 2 (stop prefix)
        self.stopped = False
        self.stop_reason: str | None = None

    @property
    def token_ids(self) -> list[int]:
        return self._ids

    def push(self, token_ids: Sequence[int]) -> DetokDelta:
        """Add newly generated tokens; return the text that is now safe to send."""
        if self.stopped:
            return DetokDelta("", True, self.stop_reason)
        self._ids.extend(token_ids)
        return self._stop_stage(self._decode_stage(), final=False)

    def flush(self) -> str:
        """End of stream: release everything held back (an incomplete character
        decodes to U+FFFD, exactly as a full decode would show it)."""
        if self.stopped:
            return ""
        text = self._window_text()[self._released :]
        self._released += len(text)
        return self._stop_stage(text, final=True).text

    def _window_text(self) -> str:
        return self._tok.decode(self._ids[self._prefix_offset :], self._skip_special)

    def _decode_stage(self) -> str:
        text = self._window_text()
        stable = text.rstrip(REPLACEMENT_CHAR)
        new = stable[self._released :] if len(stable) > self._released else ""
        self._released += len(new)
        if len(stable) == len(text):
            # Complete text: slide the window so it spans only the latest tokens.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._released = len(
                self._tok.decode(
                    self._ids[self._prefix_offset : self._read_offset], self._skip_special
                )
            )
        return new

    def _stop_stage(self, text: str, final: bool) -> DetokDelta:
        buf = self._pending + text
        hit = self._find_stop(buf)
        if hit is not None:
            idx, stop = hit
            self.stopped, self.stop_reason, self._pending = True, stop, ""
            end = idx + len(stop) if self._include_stop else idx
            return DetokDelta(buf[:end], True, stop)
        hold = 0 if final else self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :] if hold else ""
        return DetokDelta(buf[: len(buf) - hold], False, None)

    def _find_stop(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = buf.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        return best

    def _held_suffix_len(self, buf: str) -> int:
        """Length of the longest suffix of `buf` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:k]):
                    longest = k
                    break
        return longest
