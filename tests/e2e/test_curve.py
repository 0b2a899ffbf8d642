"""CURVE on the control plane: authorized workers register and serve; a worker
with an unknown key is refused (and the refusal is logged)."""

from __future__ import annotations

from pathlib import Path

import zmq.auth

from tests.e2e.cluster import Cluster, http, wait_for
from tests.e2e.conftest import Reference


def test_curve_authorized_worker_serves_and_unknown_key_is_refused(log_dir: Path, reference: Reference) -> None:
    keys = log_dir / "keys"
    allowed = log_dir / "authorized"
    keys.mkdir()
    allowed.mkdir()
    _, gw_secret = zmq.auth.create_certificates(str(keys), "gateway")
    worker_public, worker_secret = zmq.auth.create_certificates(str(keys), "worker")
    _, rogue_secret = zmq.auth.create_certificates(str(keys), "rogue")
    (allowed / "worker.key").write_bytes(Path(worker_public).read_bytes())
    gw_public = str(keys / "gateway.key")

    c = Cluster(log_dir)
    try:
        c.start_gateway("--curve-secret-key", gw_secret, "--curve-authorized-keys", str(allowed))
        c.add_worker("worker", "--curve-key", worker_secret, "--curve-server-key", gw_public)
        c.add_worker("decode", "--curve-key", rogue_secret, "--curve-server-key", gw_public,
                     "--curve-authorized-keys", str(allowed))
        c.add_worker("decode")  # no CURVE at all
        c.wait_roles(colocated=1)
        want = reference.text(reference.generate(reference.completion_ids("secure"), max_tokens=6, temperature=0.0)[0])
        status, out = http("POST", f"{c.url}/v1/completions",
                           {"model": reference.model_name, "prompt": "secure", "max_tokens": 6, "temperature": 0})
        assert status == 200 and out["choices"][0]["text"] == want
        gateway = c.gateway
        assert gateway is not None
        wait_for(lambda: "control plane refused a peer" in gateway.log(), gateway.log, 30, 0.2)
        assert [w["role"] for w in c.worker_list()] == ["colocated"]  # neither decode got in
    finally:
        c.stop()
