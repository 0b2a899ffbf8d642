"""Incremental detokenizer: UTF-8 safety, stop strings, equality with a full decode."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.detokenizer import DetokDelta, IncrementalDetokenizer
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model

# Text whose characters are 1, 2, 3 and 4 UTF-8 bytes long, plus a ZWJ sequence and a flag.
MIXED = "Hi é 中文 🚀 👨‍👩‍👧‍👦 🇯🇵 ok"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_model(tmp_path_factory.mktemp("dm"))


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(model_dir)


def _stream(
    det: IncrementalDetokenizer, ids: Sequence[int], sizes: Sequence[int] = (1,)
) -> list[str]:
    """Push ids in chunks of the given sizes (cycled); return every delta, then flush()."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)]
        out.append(det.push(list(ids[i : i + n])).text)
        i, k = i + n, k + 1
    out.append(det.flush())
    return out


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the single character that stands for it."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte: every multi-byte character is split across tokens."""
    table = _bytes_to_unicode()
    ids = [tok.token_to_id(table[b]) for b in text.encode()]
    assert None not in ids
    return [i for i in ids if i is not None]


def test_byte_tokens_really_split_characters(tok: Tokenizer) -> None:
    ids = _byte_tokens(tok, "中")
    assert len(ids) == 3 and tok.decode(ids) == "中"
    assert tok.decode(ids[:1]).endswith("\ufffd")


@pytest.mark.parametrize("sizes", [(1,), (2,), (3, 1), (5,)])
def test_never_emits_broken_utf8(tok: Tokenizer, sizes: tuple[int, ...]) -> None:
    ids = _byte_tokens(tok, MIXED)
    deltas = _stream(IncrementalDetokenizer(tok), ids, sizes)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MIXED
    # Multi-byte characters arrive whole: some pushes emitted nothing (held back).
    if sizes == (1,):
        assert "" in deltas[:-1]
        assert "🚀" in deltas and "中" in deltas


def test_bpe_tokens_with_partial_characters(tok: Tokenizer) -> None:
    ids = tok.encode(MIXED, add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "the default tokenizer should split some emoji across tokens"
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MIXED


def test_flush_releases_incomplete_tail(tok: Tokenizer) -> None:
    ids = _byte_tokens(tok, "ab🚀")[:-1]  # the emoji's last byte never arrives
    det = IncrementalDetokenizer(tok)
    assert "".join(det.push([i]).text for i in ids) == "ab"
    assert det.flush() == tok.decode(ids)[2:] == "\ufffd"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [0, *tok.encode("Hi", add_special_tokens=False), 4]
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "Hi"
    kept = "".join(_stream(IncrementalDetokenizer(tok, skip_special_tokens=False), ids))
    assert kept == "<|begin_of_text|>Hi<|eot_id|>"


def test_stop_string_spanning_tokens_is_cut(tok: Tokenizer) -> None:
    text = "Hello there. STOP and more text"
    ids = _byte_tokens(tok, text)  # "STOP" arrives one byte at a time
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    deltas: list[DetokDelta] = [det.push([i]) for i in ids]
    emitted = "".join(d.text for d in deltas)
    assert emitted == "Hello there. "
    fired = [k for k, d in enumerate(deltas) if d.stopped]
    assert fired[0] == len("Hello there. STOP") - 1  # fires on the token completing it
    assert all(d.stop_reason == "STOP" for d in deltas[fired[0] :])
    assert all(d.text == "" for d in deltas[fired[0] + 1 :])  # nothing after a stop
    assert det.flush() == "" and det.stopped


def test_include_stop_str(tok: Tokenizer) -> None:
    ids = tok.encode("one, two; three", add_special_tokens=False)
    det = IncrementalDetokenizer(tok, stop=["two;"], include_stop_str=True)
    assert "".join(_stream(det, ids)) == "one, two;"
    assert det.stop_reason == "two;"


def test_held_prefix_released_when_stop_does_not_complete(tok: Tokenizer) -> None:
    ids = _byte_tokens(tok, "a ST b STO")
    det = IncrementalDetokenizer(tok, stop=["STOP"])
    texts = [det.push([i]).text for i in ids]
    assert "".join(texts) == "a ST b "  # "STO" may still become "STOP": held
    assert det.flush() == "STO"  # end of stream: it never did
    assert not det.stopped


def test_earliest_stop_wins_and_multibyte_stop(tok: Tokenizer) -> None:
    ids = _byte_tokens(tok, "x 🚀 y END z")
    det = IncrementalDetokenizer(tok, stop=["END", "🚀"])
    assert "".join(_stream(det, ids)) == "x "
    assert det.stop_reason == "🚀"


def test_stop_inside_one_push(tok: Tokenizer) -> None:
    det = IncrementalDetokenizer(tok, stop=["\n\n"])
    d = det.push(tok.encode("para one\n\npara two", add_special_tokens=False))
    assert d == DetokDelta("para one", True, "\n\n")


def test_work_per_push_is_bounded(tok: Tokenizer) -> None:
    """Each push decodes only a window, not the whole text so far."""
    calls: list[int] = []

    class Counting:
        def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
            calls.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(
        ("The quick brown fox jumps over the lazy dog. 你好 🚀 " * 40), add_special_tokens=False
    )
    det = IncrementalDetokenizer(Counting())
    out = _stream(det, ids)
    assert "".join(out) == tok.decode(ids)
    assert len(ids) > 400 and max(calls) <= 8


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_deltas_concatenate_to_full_decode(tok: Tokenizer, data: st.DataObject) -> None:
    # Bias towards ids that hold partial characters, so splits happen often.
    partial = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    any_id = st.integers(0, tok.vocab_size - 1)
    ids = data.draw(st.lists(st.one_of(any_id, st.sampled_from(partial)), max_size=40))
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
    skip = data.draw(st.booleans())
    det = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    deltas = _stream(det, ids, sizes)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)
    # Only the final flush may end in an incomplete character.
    assert all(not d.endswith("\ufffd") for d in deltas[:-1])


@settings(
    max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    text=st.text(alphabet="ab🚀中 \n", max_size=30),
    stop=st.text(alphabet="ab🚀中 ", min_size=1, max_size=3),
    include=st.booleans(),
)
def test_stop_matches_reference(tok: Tokenizer, text: str, stop: str, include: bool) -> None:
    ids = _byte_tokens(tok, text)
    det = IncrementalDetokenizer(tok, stop=[stop], include_stop_str=include)
    out = "".join(_stream(det, ids))
    idx = text.find(stop)
    expected = text if idx < 0 else text[: idx + (len(stop) if include else 0)]
    assert out == expected
    assert det.stopped == (idx >= 0)


@pytest.mark.parametrize("size", [2, 3, 5])
def test_a_multi_token_delta_stops_at_the_same_token_as_single_tokens(tok: Tokenizer, size: int) -> None:
    from gateway.generation import push_until_stop

    ids = list(tok.encode("alpha beta gamma delta epsilon zeta eta theta", add_special_tokens=False))
    stop = "delta"
    one = IncrementalDetokenizer(tok, stop=[stop])
    texts, stopped_at = [], None
    for i, t in enumerate(ids):  # what one-token deltas (speculation off) produce
        out = one.push([t])
        texts.append(out.text)
        if out.stopped:
            stopped_at = i + 1
            break
    assert stopped_at is not None and stopped_at < len(ids)
    many = IncrementalDetokenizer(tok, stop=[stop])
    got, used_total = [], 0
    for start in range(0, len(ids), size):  # speculation's deltas of several tokens
        out, used = push_until_stop(many, ids[start:start + size])
        got.append(out.text)
        used_total += used
        if out.stopped:
            break
    assert "".join(got) == "".join(texts) and used_total == stopped_at
