"""The KV handshake carries each side's rank layout (pdserve.common.parallel_layout) and a
receiver refuses, with a reason naming both layouts, a pair it cannot map."""

from __future__ import annotations

import pytest

from kv_transfer import wire
from kv_transfer.api import TransferState
from pdserve.common.parallel_layout import LayoutPairError, ParallelLayout, check_pair
from tests.kv_transfer.harness import CPU_TRANSPORTS, TINY, make_pair, same_bytes, wait_terminal

SIZES = [(tp, pp) for tp in (1, 2) for pp in (1, 2)]


def _of(tp: int, pp: int, kv_heads: int = TINY.num_kv_heads, layers: int = TINY.num_layers) -> ParallelLayout:
    return ParallelLayout(tp, pp, kv_heads, layers)


@pytest.mark.parametrize("src", SIZES)
@pytest.mark.parametrize("dst", SIZES)
def test_every_tp_pp_pair_of_one_model_maps(src: tuple[int, int], dst: tuple[int, int]) -> None:
    check_pair(_of(*src), _of(*dst))


@pytest.mark.parametrize(("sender", "receiver", "says"), [
    (_of(3, 1), _of(1, 1), "sender TP 3 and its 2 KV heads do not divide one another"),
    (_of(1, 1), _of(2, 4), "receiver PP 4 exceeds its 3 layers"),
    (_of(2, 2), _of(2, 1, layers=4), "different layer counts"),
    (_of(2, 1), _of(2, 1, kv_heads=4), "different KV head counts"),
])
def test_a_pair_that_cannot_map_is_refused_naming_both(sender: ParallelLayout, receiver: ParallelLayout,
                                                       says: str) -> None:
    with pytest.raises(LayoutPairError, match=says) as err:
        check_pair(sender, receiver)
    assert f"sender {sender}" in str(err.value) and f"receiver {receiver}" in str(err.value)


def test_hello_carries_the_layout_and_bad_fields_are_wire_errors() -> None:
    hello = wire.Hello("abc", "", _of(2, 2).encode())
    back = wire.decode(wire.encode(hello))
    assert back == hello and ParallelLayout.decode(back.parallel) == _of(2, 2)
    assert wire.decode(wire.encode(wire.Hello("abc"))) == wire.Hello("abc", "", ())
    for bad in ((2, 2), (0, 1, 2, 3)):
        with pytest.raises(wire.WireError, match="parallel"):
            wire.decode(wire.encode(wire.Hello("abc", "", bad)))


@pytest.mark.parametrize("transport", ["fake", "tcp"])
def test_the_receiver_refuses_an_unmappable_sender_in_the_handshake(transport: str) -> None:
    pair = make_pair(transport, sender_parallel=_of(2, 2), receiver_parallel=_of(1, 1, layers=4))
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.FAILED
        assert "cannot map KV layouts" in pair.sender.reason("t")
        assert "different layer counts" in pair.sender.reason("t")
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.FAILED
        assert not pair.dst.any()  # nothing was written
    finally:
        pair.close()


@pytest.mark.parametrize("transport", CPU_TRANSPORTS)
def test_a_mappable_pair_of_different_layouts_transfers(transport: str) -> None:
    pair = make_pair(transport, sender_parallel=_of(2, 2), receiver_parallel=_of(1, 1))
    try:
        pair.receiver.expect("t", "req", [3, 4], lease_s=20)
        pair.sender.begin("t", "req", pair.receiver.address, [1, 2], [3, 4], lease_s=20)
        pair.sender.send_all("t")
        assert wait_terminal(pair.sender.poll, "t") is TransferState.COMPLETE
        assert wait_terminal(pair.receiver.poll, "t") is TransferState.COMPLETE
        assert same_bytes(pair.dst[:, :, [3, 4]], pair.src[:, :, [1, 2]])
    finally:
        pair.close()
