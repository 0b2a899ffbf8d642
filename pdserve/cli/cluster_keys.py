"""CURVE key pairs for one cluster: the gateway's and the workers', in one private
directory, as `pdserve up` creates them for its own processes and `pdserve keygen`
writes them for a deployment (a Kubernetes Secret, docs/security.md).

Layout of the directory (mode 0700; every file 0600, secret or not, so nothing in
it is readable by another user):

    gateway.key            the gateway's public certificate (workers: --curve-server-key)
    gateway.key_secret     the gateway's secret certificate (gateway: --curve-secret-key)
    worker.key             the workers' public certificate
    worker.key_secret      the workers' secret certificate (workers: --curve-key)
    authorized/worker.key  the certificates allowed as workers (--curve-authorized-keys)

All of a cluster's workers share one key pair: they are one trust domain (any of
them may send KV to any other), and a shared pair lets a pool scale without
re-keying the gateway. The gateway's secret is never given to a worker, so no
worker can pose as the control plane. Files are written in the format
`zmq.auth.load_certificate` reads, but created with `O_EXCL` and mode 0600 from
the first byte (pyzmq's own writer leaves the mode to the umask).
"""

from __future__ import annotations

import datetime
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq

from pdserve.common.pids import pid_alive

GATEWAY = "gateway"
WORKER = "worker"
AUTHORIZED = "authorized"


@dataclass(frozen=True)
class ClusterKeys:
    """Paths of one cluster's certificates (see the module docstring)."""

    directory: str

    @property
    def gateway_public(self) -> str:
        return os.path.join(self.directory, f"{GATEWAY}.key")

    @property
    def gateway_secret(self) -> str:
        return os.path.join(self.directory, f"{GATEWAY}.key_secret")

    @property
    def worker_public(self) -> str:
        return os.path.join(self.directory, f"{WORKER}.key")

    @property
    def worker_secret(self) -> str:
        return os.path.join(self.directory, f"{WORKER}.key_secret")

    @property
    def authorized(self) -> str:
        return os.path.join(self.directory, AUTHORIZED)

    def gateway_flags(self) -> list[str]:
        """`pdserve gateway` flags: paths only, never a key."""
        return ["--curve-secret-key", self.gateway_secret, "--curve-authorized-keys", self.authorized]

    def worker_flags(self) -> list[str]:
        """`pdserve prefill|decode|worker` flags: control plane and KV plane both."""
        return ["--curve-key", self.worker_secret, "--curve-server-key", self.gateway_public,
                "--curve-authorized-keys", self.authorized]


def create(directory: str) -> ClusterKeys:
    """Write a fresh gateway and worker key pair into `directory` (created 0700; it
    must not exist yet or be empty, so no old key is ever mixed in)."""
    path = Path(directory)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    if any(path.iterdir()):
        raise FileExistsError(f"{directory} is not empty")
    os.chmod(path, 0o700)
    (path / AUTHORIZED).mkdir(mode=0o700)
    keys = ClusterKeys(str(path))
    for name in (GATEWAY, WORKER):
        public, secret = zmq.curve_keypair()
        _write(path / f"{name}.key", public, None)
        _write(path / f"{name}.key_secret", public, secret)
    _write(Path(keys.authorized) / f"{WORKER}.key", _public_of(keys.worker_secret), None)
    return keys


PRIVATE_PREFIX = "pdserve-keys-"


def create_private(tmp_dir: str | None = None) -> ClusterKeys:
    """A fresh key set in a new private temporary directory (remove it with `remove`).
    Directories an earlier `up` left behind (it was killed) are removed first."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    sweep_stale(tmp_dir)
    return create(tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{os.getpid()}-", dir=tmp_dir))


def sweep_stale(tmp_dir: str) -> list[str]:
    """Remove this user's `pdserve-keys-<pid>-*` directories whose process is gone."""
    removed = []
    for entry in os.scandir(tmp_dir):
        pid_text = entry.name.removeprefix(PRIVATE_PREFIX).partition("-")[0]
        if not entry.name.startswith(PRIVATE_PREFIX) or not pid_text.isdigit():
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid() or not entry.is_dir(follow_symlinks=False):
                continue
        except OSError:
            continue
        if not pid_alive(int(pid_text)):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
    return removed


def remove(keys: ClusterKeys) -> None:
    shutil.rmtree(keys.directory, ignore_errors=True)


def _public_of(secret_file: str) -> bytes:
    from zmq.auth import load_certificate

    public, _ = load_certificate(secret_file)
    return public


def _write(path: Path, public: bytes, secret: bytes | None) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    kind = "secret" if secret is not None else "public"
    lines = [f"#   ****  Generated by pdserve on {now}  ****",
             f"#   ZeroMQ CURVE {kind} certificate", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret is not None:
        lines.append(f'    secret-key = "{secret.decode()}"')
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
