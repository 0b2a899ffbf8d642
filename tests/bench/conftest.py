from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.bench.fake_openai import FakeOpenAIServer


@pytest.fixture(scope="module")
def _server() -> Iterator[FakeOpenAIServer]:
    server = FakeOpenAIServer().start()
    yield server
    server.stop()


@pytest.fixture
def fake_server(_server: FakeOpenAIServer) -> FakeOpenAIServer:
    """The module's fake server with default behaviour and no recorded requests."""
    _server.reset()
    return _server
