"""CURVE on the KV plane: the decode worker's receiver is a CURVE server, prefill
senders are CURVE clients, and each side authenticates the other against one
directory of worker public certificates (the gateway's `--curve-authorized-keys`).

Which public key a sender needs, and how it gets it: the *receiver's*. Every
decode worker serves with its own certificate (its `--curve-key`) and puts the
public half in the KV address it registers, `tcp://10.0.0.5:41234?curve=<64 hex>`.
That address reaches prefill workers only from the gateway, over the CURVE
control plane, and the gateway admitted the decode worker by the same key; the
sender still checks the key against its own authorized directory, so not even a
misbehaving gateway can point KV at a key that is not a worker's. Reusing the
gateway's key pair for receivers was rejected: every worker would then hold the
gateway's secret key and could pose as its control plane. A public-key file per
receiver on every prefill host was rejected too: adding a decode worker would
mean reconfiguring the whole prefill pool.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import zmq
from zmq.utils import z85

from pdserve.common.transport import ZapLog

log = logging.getLogger(__name__)

KEY_MARK = "?curve="
KEY_HEX_LEN = 64  # a Curve25519 public key, 32 bytes


@dataclass(frozen=True)
class KVCurve:
    """CURVE for a worker's KV sockets (the same files as its control-plane CURVE)."""

    secret_key_file: str  # this worker's certificate, as `zmq.auth.create_certificates` writes it
    authorized_keys_dir: str  # public certificates of the workers allowed as KV peers


@dataclass(frozen=True)
class CurveKeys:
    """Loaded `KVCurve`: z85 keys, as zmq socket options take them."""

    public: bytes
    secret: bytes
    authorized: frozenset[bytes]
    authorized_keys_dir: str


def load_keys(curve: KVCurve) -> CurveKeys:
    """Read the certificate and the authorized directory; ValueError names what is wrong."""
    from zmq.auth import load_certificate, load_certificates

    if not os.path.isdir(curve.authorized_keys_dir):
        raise ValueError(f"CURVE authorized keys: {curve.authorized_keys_dir} is not a directory")
    try:
        public, secret = load_certificate(curve.secret_key_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"CURVE key {curve.secret_key_file}: {e}") from None
    if secret is None:
        raise ValueError(f"{curve.secret_key_file} holds no secret key")
    authorized = frozenset(load_certificates(curve.authorized_keys_dir))
    return CurveKeys(public, secret, authorized, curve.authorized_keys_dir)


def advertise(address: str, public: bytes) -> str:
    """The receiver address senders get: the endpoint plus the server's public key."""
    return f"{address}{KEY_MARK}{z85.decode(public).hex()}"


def split_address(address: str) -> tuple[str, bytes | None]:
    """(endpoint, the receiver's z85 public key or None); ValueError if the key part is malformed."""
    endpoint, mark, key = address.partition(KEY_MARK)
    if not mark:
        return address, None
    try:
        raw = bytes.fromhex(key)
    except ValueError:
        raw = b""
    if len(key) != KEY_HEX_LEN or len(raw) != KEY_HEX_LEN // 2:
        raise ValueError(f"malformed CURVE key in KV address {address!r:.120}")
    return endpoint, z85.encode(raw)


def serve(ctx: zmq.Context[Any], sock: zmq.Socket[Any], keys: CurveKeys) -> Any:
    """Make `sock` a CURVE server that admits only authorized clients; returns the
    authenticator (stop it before terminating `ctx`). A refused client is logged."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx, log=ZapLog(logging.getLogger("pdserve.kv"), {"plane": "KV receiver"}))
    auth.start()
    auth.configure_curve(domain="*", location=keys.authorized_keys_dir)
    sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
    sock.curve_server = True
    return auth


def connect_options(keys: CurveKeys | None, address: str) -> tuple[str, bytes | None]:
    """(endpoint, server key) for a sender connecting to `address`: CURVE exactly when the
    receiver advertises a key, and only to an authorized one; ValueError says why not."""
    endpoint, server = split_address(address)
    if keys is None and server is not None:
        raise ValueError("the receiver requires CURVE and this worker has no --curve-key")
    if keys is not None and server is None:
        raise ValueError("the receiver offers no CURVE key; KV is never sent unauthenticated "
                         "by a worker with --curve-key")
    if keys is not None and server not in keys.authorized:
        raise ValueError(f"the receiver's key is not in {keys.authorized_keys_dir}")
    return endpoint, server


def apply_client(sock: zmq.Socket[Any], keys: CurveKeys, server: bytes) -> None:
    sock.curve_publickey, sock.curve_secretkey, sock.curve_serverkey = keys.public, keys.secret, server
