"""Optional API-key authentication: `Authorization: Bearer <key>` on protected routes.

Keys are compared with `hmac.compare_digest` against every configured key (no early
exit), so the time taken reveals neither which key nor how much of one matched.
`/health` and `/ready` are always open; `/metrics` is open unless configured protected;
`/admin/...` and `GET /v1/workers` (it names every worker, its addresses and the
compatibility hash a worker registers with) check the admin token instead
(gateway/admin_roles.py).
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from gateway.errors import APIError

ALWAYS_OPEN = frozenset({"/health", "/ready"})
ADMIN_PREFIX = "/admin/"  # its own bearer token (gateway/admin_roles.py), never an API key
ADMIN_PATHS = frozenset({"/v1/workers"})  # the admin token too


def is_protected(path: str, metrics_protected: bool) -> bool:
    if path in ALWAYS_OPEN or path in ADMIN_PATHS or path.startswith(ADMIN_PREFIX):
        return False
    return not (path == "/metrics" and not metrics_protected)


def key_matches(presented: str, keys: Sequence[str]) -> bool:
    ok = False
    candidate = presented.encode()
    for key in keys:
        ok |= hmac.compare_digest(candidate, key.encode())
    return ok


def check_authorization(header: str | None, keys: Sequence[str]) -> None:
    """Raise a 401 in OpenAI's shape unless `header` carries one of `keys`."""
    scheme, _, token = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise APIError(
            401,
            "Missing API key: send 'Authorization: Bearer <key>'.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
            reason="unauthorized",
        )
    if not key_matches(token.strip(), keys):
        raise APIError(
            401, "Incorrect API key provided.", code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"}, reason="unauthorized",
        )
