"""The worker's CUDA device made explicit (pdserve.engine.runner.cuda_device), checked on CPU with torch.cuda's
entry points replaced: which device becomes current, and which device's stream an event marks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pdserve.engine.runner import cuda_device


class _FakeEvent:
    def __init__(self) -> None:
        self.streams: list[Any] = []

    def record(self, stream: Any = None) -> None:
        self.streams.append(stream)


def test_bind_device_makes_an_indexed_cuda_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    made_current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    cuda_device.bind_device(torch.device("cuda:1"))
    cuda_device.bind_device(torch.device("cuda"))  # no index: the current device already
    cuda_device.bind_device(torch.device("cpu"))
    assert made_current == [torch.device("cuda:1")]


def test_stream_event_marks_the_given_devices_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: ("stream of", None if device is None else str(device)))
    event = cuda_device.stream_event(torch.device("cuda:1"))
    assert isinstance(event, _FakeEvent)
    assert event.streams == [("stream of", "cuda:1")]  # not the current device's: None


def test_the_runner_binds_its_device_before_loading_weights(
        monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Any) -> None:
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.runner import model_runner

    calls: list[str] = []
    load = model_runner.load_model_with
    monkeypatch.setattr(model_runner, "bind_device", lambda d: calls.append(f"bind {d}"))
    monkeypatch.setattr(model_runner, "load_model_with",
                        lambda *a, **k: calls.append("load") or load(*a, **k))
    model_runner.ModelRunner(EngineConfig(model_dir=str(tiny_model_dir("llama")), device="cpu",
                                          cache=CacheConfig(num_blocks=8)))
    assert calls == ["bind cpu", "load"]
