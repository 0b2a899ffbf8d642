"""Fixtures for the observability acceptance tests (issue 5, issue 7).

One disaggregated cluster (gateway + 1 prefill + 1 decode, `--threads 1`) is shared
by the tests that only send traffic and read metrics, timings and logs; tests that
stop processes start their own. Every process runs in its own process group and is
killed on teardown (tests/e2e/cluster.py). Its logs are at DEBUG so that per-request
worker log lines, if a worker writes any, end up in the log files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster


@pytest.fixture(scope="session", autouse=True)
def default_model() -> Path:
    """The built-in model, built once here rather than by several processes racing at startup."""
    from pdserve.builtin.default_model import default_model_dir

    return Path(default_model_dir())


@pytest.fixture(scope="session")
def pd_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("obs-pd"))
    try:
        with pytest.MonkeyPatch.context() as mp:  # only the children see it
            mp.setenv("PDSERVE_LOG_LEVEL", "DEBUG")
            c.start_gateway(wait=False)
            c.add_worker("prefill")
            c.add_worker("decode")
        c.wait_roles(prefill=1, decode=1)
        yield c
    finally:
        c.stop()
