"""The admin route of live role flips (gateway/admin_roles.py) over a real socket: its own
token (an API key does not open it), 404 when off or without a worker cluster, and the
flip's bookkeeping on a cluster backend whose workers are registry entries only."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.cluster import ClusterBackend
from gateway.config import GatewayConfig
from gateway.tokenizer import Tokenizer
from pdserve.builtin.default_model import write_default_model
from pdserve.common import protocol as p
from tests.gateway.local_backend import GatewayThread, LocalBackend, raw

TOKEN = "admin-token-for-tests-0123"
KEY = "api-key-for-tests"
PATH = "/admin/workers/d1/role"


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    d: Path = write_default_model(tmp_path_factory.mktemp("admin-model"))
    return Tokenizer.from_model_dir(d)


@pytest.fixture
def cluster_gw(tok: Tokenizer) -> Iterator[GatewayThread]:
    config = GatewayConfig(max_model_len=256, api_keys=(KEY,), admin_token=TOKEN)
    with GatewayThread(config, ClusterBackend(), tok) as g:
        yield g


def _bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def _register(gw: GatewayThread, wid: str, role: str) -> None:
    reg = p.RegisterWorker(wid, role, "host", "", "", "hash", 100, 16, 0, 1)
    assert gw.call(lambda: gw.backend.registry.register(reg, 0.0).accepted)


def test_admin_api_is_off_without_a_token_or_a_cluster(tok: Tokenizer) -> None:
    with GatewayThread(GatewayConfig(max_model_len=256), ClusterBackend(), tok) as g:
        assert raw(g.url, "POST", PATH, json_body={"role": "prefill"}).status == 404
    with GatewayThread(GatewayConfig(max_model_len=256, admin_token=TOKEN), LocalBackend(tok), tok) as g:
        r = raw(g.url, "POST", PATH, json_body={"role": "prefill"}, headers=_bearer(TOKEN))
        assert r.status == 404


def test_only_the_admin_token_opens_it(cluster_gw: GatewayThread) -> None:
    url = cluster_gw.url
    assert raw(url, "POST", PATH, json_body={"role": "prefill"}).status == 401
    assert raw(url, "POST", PATH, json_body={"role": "prefill"}, headers=_bearer(KEY)).status == 401
    r = raw(url, "POST", PATH, json_body={"role": "prefill"}, headers=_bearer(TOKEN))
    assert r.status == 404 and "no such worker" in r.json()["error"]["message"]
    assert raw(url, "POST", PATH, data=b"{", headers=_bearer(TOKEN)).status == 400
    assert raw(url, "POST", PATH, data=b"x" * 5000, headers=_bearer(TOKEN)).status == 413


def test_a_flip_marks_the_worker_draining_and_is_counted_when_it_comes_back(cluster_gw: GatewayThread) -> None:
    gw = cluster_gw
    for wid, role in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode")):
        _register(gw, wid, role)
    r = raw(gw.url, "POST", PATH, json_body={"role": "prefill"}, headers=_bearer(TOKEN))
    assert r.status == 202 and r.json() == {"worker": "d1", "from": "decode", "to": "prefill",
                                            "status": "switching", "inflight": 0}
    assert gw.call(lambda: gw.backend.registry.get("d1").draining)
    again = raw(gw.url, "POST", PATH, json_body={"role": "prefill"}, headers=_bearer(TOKEN))
    assert again.status == 409  # already switching
    last = raw(gw.url, "POST", "/admin/workers/d2/role", json_body={"role": "prefill"}, headers=_bearer(TOKEN))
    assert last.status == 409 and "last decode" in last.json()["error"]["message"]

    # The worker registers again as prefill (what pdserve/worker/role_switch.py sends).
    reg = p.RegisterWorker("d1", "prefill", "host", "", "", "hash", 100, 16, 0, 1)
    gw.call(lambda: gw.backend.control._handle("d1", reg))
    assert gw.call(lambda: not gw.backend.registry.get("d1").draining)
    metrics = raw(gw.url, "GET", "/metrics").body.decode()
    assert 'llm_role_flips_total{from_role="decode",to_role="prefill"} 1.0' in metrics
