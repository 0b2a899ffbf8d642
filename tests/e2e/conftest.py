"""Fixtures for end-to-end tests: the single-process reference engine and
real-process clusters (see tests/e2e/cluster.py)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdserve.common.sampling_params import SamplingParams


@dataclass
class Reference:
    """Greedy/seeded outputs of the single-process engine, and the gateway's tokenizer."""

    engine: Any
    tokenizer: Any
    model_name: str

    def generate(self, prompt_ids: list[int], **params: Any) -> list[list[int]]:
        sp = SamplingParams(**params)
        result = self.engine.generate([list(prompt_ids)], sp)[0]
        return [list(c.token_ids) for c in result.choices]

    def completion_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return list(self.tokenizer.encode_chat(messages))

    def text(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from pdserve.builtin.default_model import default_model_dir

    return Path(default_model_dir())


@pytest.fixture(scope="session")
def reference(model_dir: Path) -> Iterator[Reference]:
    from gateway.tokenizer import Tokenizer
    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from tests.e2e.cluster import DTYPE

    cfg = EngineConfig(model_dir=str(model_dir), dtype=DTYPE, num_threads=1, cache=CacheConfig(num_blocks=256))
    yield Reference(LLMEngine(cfg), Tokenizer.from_model_dir(model_dir), model_dir.name)


@pytest.fixture()
def log_dir(tmp_path: Path) -> Path:
    return tmp_path
