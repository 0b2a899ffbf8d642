"""Refused CURVE peers are logged as warnings, but a peer that reconnects every 100 ms
cannot flood the log: only the 1st, 2nd, 4th, 8th... refusal is written."""

from __future__ import annotations

import logging

import pytest

from pdserve.common.transport import ZapLog


def test_refusals_are_warned_at_powers_of_two(caplog: pytest.LogCaptureFixture) -> None:
    zap = ZapLog(logging.getLogger("pdserve.test.zap"), {"plane": "KV receiver"})
    with caplog.at_level(logging.DEBUG, logger="pdserve.test.zap"):
        for i in range(1000):
            zap.debug("DENIED (CURVE) domain=%s client_key=%s", "*", f"key{i}")
        zap.debug("ALLOWED (CURVE) domain=%s", "*")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 10  # 1, 2, 4, ..., 512
    assert warned[0].startswith("KV receiver refused a peer (1 so far): DENIED (CURVE)")
    assert "(512 so far)" in warned[-1] and zap.denied == 1000
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG] == ["ALLOWED (CURVE) domain=*"]
