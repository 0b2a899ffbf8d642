"""Worker roles are one enum (pdserve/common/roles.py), turned back into it where a message arrives."""

from __future__ import annotations

import json

import pytest

from pdserve.common import protocol as p
from pdserve.common.codec import WireError, from_wire, to_wire
from pdserve.common.roles import FLIP_ROLES, Role


def _register(role: str) -> p.RegisterWorker:
    return p.RegisterWorker("w1", role, "h", "", "", "c", 8, 16, 0, 1)  # type: ignore[arg-type]


def test_a_role_travels_as_its_name_and_arrives_as_the_enum() -> None:
    frame = p.encode(_register("decode"))
    msg = p.decode(frame)
    assert isinstance(msg, p.RegisterWorker) and msg.role is Role.DECODE
    assert to_wire(msg)["role"] == "decode" and type(to_wire(msg)["role"]) is str
    switch = p.decode(p.encode(p.SwitchRole("w1", Role.PREFILL)))
    assert isinstance(switch, p.SwitchRole) and switch.role is Role.PREFILL


def test_a_name_that_is_no_role_is_refused_at_the_edge() -> None:
    with pytest.raises(WireError, match="one of prefill, decode, colocated"):
        from_wire(p.RegisterWorker, {**to_wire(_register("prefill")), "role": "attacker"})
    with pytest.raises(ValueError):
        _register("attacker")
    with pytest.raises(p.ProtocolError, match="cannot switch to role 'colocated'"):
        p.decode(p.encode(p.SwitchRole("w1", Role.COLOCATED)))
    assert Role.COLOCATED not in FLIP_ROLES


def test_a_role_reads_as_its_name_in_text() -> None:
    assert f"a {Role.COLOCATED} worker" == "a colocated worker" and str(Role.PREFILL) == "prefill"
    assert json.dumps({"role": Role.DECODE}) == '{"role": "decode"}'
    assert Role("decode") is Role.DECODE and Role.DECODE == "decode"
