"""The wire codec: nested dataclasses round-trip, and every leaf is checked with a
message that says where it failed."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.codec import WireError, converter, from_wire, to_wire


@dataclass(frozen=True)
class Leaf:
    a: int
    b: float = 0.0


@dataclass(frozen=True)
class Tree:
    name: str
    leaves: list[Leaf]
    pair: tuple[int, ...] = ()
    maybe: Leaf | None = None
    scores: dict[str, float] = field(default_factory=dict)
    flags: list[bool | None] = field(default_factory=list)


TREE = Tree("t", [Leaf(1, 2.5), Leaf(3)], (4, 5), Leaf(6), {"x": 1.0}, [True, None])


def test_round_trip_builds_the_nested_types() -> None:
    wire = to_wire(TREE)
    assert wire["leaves"][0] == {"a": 1, "b": 2.5} and wire["pair"] == [4, 5]
    back = from_wire(Tree, wire)
    assert back == TREE and isinstance(back.pair, tuple) and isinstance(back.maybe, Leaf)


def test_int_is_accepted_as_float_but_never_bool_as_int() -> None:
    assert from_wire(Leaf, {"a": 1, "b": 2}) == Leaf(1, 2.0)
    with pytest.raises(WireError, match=r"Leaf\.a is not int"):
        from_wire(Leaf, {"a": True})


@pytest.mark.parametrize(("change", "where"), [
    ({"leaves": [{"a": 1}, {"a": "x"}]}, r"Tree\.leaves\[1\]\.a is not int"),
    ({"leaves": [{"a": 1, "c": 2}]}, r"Tree\.leaves\[0\]: unknown field 'c'"),
    ({"leaves": [{}]}, r"Tree\.leaves\[0\]: missing field 'a'"),
    ({"pair": [1, None]}, r"Tree\.pair\[1\] is not int"),
    ({"maybe": 3}, r"Tree\.maybe is not a Leaf map"),
    ({"scores": {"x": "1"}}, r"Tree\.scores\['x'\] is not float"),
    ({"scores": {1: 1.0}}, r"Tree\.scores key is not str"),
    ({"flags": [1]}, r"Tree\.flags\[0\] is not bool"),
    ({"leaves": {"a": 1}}, r"Tree\.leaves is not a list"),
])
def test_a_bad_leaf_names_its_path(change: dict, where: str) -> None:
    with pytest.raises(WireError, match=where):
        from_wire(Tree, {**to_wire(TREE), **change})


def test_only_types_with_a_wire_form_are_accepted() -> None:
    for bad in (object, dict[int, str], tuple[int, str], int | str):
        with pytest.raises(TypeError):
            converter(bad)


_any = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=4),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["name", "leaves", "pair", "maybe", "scores", "flags", "zz"]), _any))
def test_arbitrary_data_either_decodes_or_raises_wire_error(body: dict) -> None:
    try:
        tree = from_wire(Tree, body)
    except WireError:
        return
    assert from_wire(Tree, to_wire(tree)) == tree


@dataclass(frozen=True)
class Ids:
    ids: frozenset[int] = frozenset()


def test_a_frozenset_travels_as_a_sorted_list_and_comes_back_a_set() -> None:
    wire = to_wire(Ids(frozenset({9, 3, 7})))
    assert wire == {"ids": [3, 7, 9]}
    back = from_wire(Ids, wire)
    assert isinstance(back.ids, frozenset) and back.ids == {3, 7, 9}
    with pytest.raises(WireError, match=r"Ids.ids\[1\] is not int"):
        from_wire(Ids, {"ids": [1, "x"]})


def test_stop_token_ids_are_a_set_on_every_side() -> None:
    """The engine checks each sampled token against them: a set, however they were given."""
    from pdserve.common import protocol as p
    from pdserve.common.sampling_params import SamplingParams

    params = SamplingParams(stop_token_ids=[9, 3, 9])  # type: ignore[arg-type]
    assert isinstance(params.stop_token_ids, frozenset) and params.stop_token_ids == {3, 9}
    assert params.to_dict()["stop_token_ids"] == [3, 9]
    assert SamplingParams.from_dict(params.to_dict()).stop_token_ids == frozenset({3, 9})
    msg = p.RunRequest("r", p.RequestPayload([1], params))
    back = p.decode(p.encode(msg))
    assert isinstance(back, p.RunRequest) and isinstance(back.payload.params.stop_token_ids, frozenset)
    assert back.payload.params == params
