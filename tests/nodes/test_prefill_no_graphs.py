"""A prefill worker never replays a decode step, so its runner captures no CUDA graphs."""

from __future__ import annotations

from typing import Any, cast

import pytest

from pdserve.engine.core.config import EngineConfig
from prefill_node.main import build_prefill, prefill_engine_config


class _Built(Exception):
    """Raised by the stand-in engine builder once it has seen the config."""


@pytest.mark.parametrize("asked", [None, True, False])
def test_the_prefill_builder_hands_its_runner_a_config_without_graphs(
        asked: bool | None, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EngineConfig(model_dir="m", device="cuda:1", cuda_graphs=asked, attention_backend="triton")
    assert prefill_engine_config(cfg) == EngineConfig(model_dir="m", device="cuda:1", cuda_graphs=False,
                                                      attention_backend="triton")
    seen: list[EngineConfig] = []

    def build_engine(config: EngineConfig, *args: Any, **kwargs: Any) -> Any:
        seen.append(config)
        raise _Built

    monkeypatch.setattr("pdserve.worker.engine_glue.build_engine", build_engine)
    with pytest.raises(_Built):
        build_prefill(cfg, cast(Any, None), cast(Any, None))
    assert [c.cuda_graphs for c in seen] == [False] and seen[0].device == "cuda:1"
