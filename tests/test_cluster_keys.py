"""`pdserve up`'s key sets: private from the first byte, and a set left behind by an
`up` that was killed is removed by the next one (never another live process's)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import zmq.auth

from pdserve.cli import cluster_keys


def test_a_killed_ups_keys_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = cluster_keys.create(str(tmp_path / f"pdserve-keys-{dead.pid}-abc"))
    live = cluster_keys.create(str(tmp_path / f"pdserve-keys-{os.getpid()}-def"))
    other = tmp_path / "pdserve-keys-notapid"
    other.mkdir()
    fresh = cluster_keys.create_private(str(tmp_path))
    assert not os.path.exists(stale.directory)
    assert os.path.isdir(live.directory) and other.is_dir()
    assert stat.S_IMODE(os.stat(fresh.directory).st_mode) == 0o700
    public, secret = zmq.auth.load_certificate(fresh.worker_secret)
    assert secret is not None and zmq.auth.load_certificates(fresh.authorized) == {public: True}
    cluster_keys.remove(fresh)
    assert not os.path.exists(fresh.directory)
