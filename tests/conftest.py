"""Session-wide fixtures shared by all test packages."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.tiny_models import make_tiny_model


def pytest_configure(config: pytest.Config) -> None:
    # The plumbing tests (e2e, observability, multihost, CLI) serve the random-weight
    # built-in model, which never ends a stream early; every process they start
    # inherits this. Tests of the trained model set PDSERVE_BUILTIN_WEIGHTS=trained or
    # assemble it themselves. Set it to `trained` to run the suite on the trained model.
    os.environ.setdefault("PDSERVE_BUILTIN_WEIGHTS", "random")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory `tiny_model_dir(family="llama", **overrides) -> Path`, built once per session.

    The returned directory is shared by every test in the session: do not modify it
    (copy it first if a test needs to corrupt a checkpoint).
    """
    cache: dict[tuple[str, tuple[tuple[str, Any], ...]], Path] = {}

    def factory(family: str = "llama", **overrides: Any) -> Path:
        key = (family, tuple(sorted((k, repr(v)) for k, v in overrides.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{family}")
            cache[key] = make_tiny_model(out, family, **overrides)
        return cache[key]

    return factory


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run the test with one torch thread (deterministic and no oversubscription)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def lora_model(tiny_model_dir: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
               ) -> tuple[Path, dict[str, Path]]:
    """(the tiny llama, {name: PEFT adapter dir}) for `tests.helpers.lora_adapters.THREE_ADAPTERS`,
    made once per session by the real `peft` (do not modify the directories)."""
    from tests.helpers.lora_adapters import THREE_ADAPTERS, make_peft_adapter

    base = tiny_model_dir("llama")
    root = tmp_path_factory.mktemp("lora")
    return base, {s.name: make_peft_adapter(base, root / s.name, s) for s in THREE_ADAPTERS}
