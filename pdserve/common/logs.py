"""Structured logging for every pdserve process: one JSON object per line on stderr.

Stdlib only, so the gateway and the workers share it without either importing
the other. A record whose message is already a JSON object (the gateway's
request log line) is merged as it is, with time and level added; other records
are wrapped as `{"time", "level", "logger", "message"}`. Fields passed with
`extra=` under `LOG_FIELDS` (e.g. `request_id`) become top-level keys, so a
request can be followed through every process by its id.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

# Attributes of a LogRecord (set with `extra=`) copied into the JSON object.
LOG_FIELDS = ("request_id", "attempt", "worker", "role", "event")


def request_fields(worker_request_id: str) -> dict[str, Any]:
    """`extra=` fields for a worker-side request id `<gateway id>#<attempt>`."""
    rid, _, attempt = worker_request_id.partition("#")
    fields: dict[str, Any] = {"request_id": rid}
    if attempt.isdigit():
        fields["attempt"] = int(attempt)
    return fields


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        for name in LOG_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                base[name] = value
        message = record.getMessage()
        payload: object = None
        if message.startswith("{"):
            try:
                payload = json.loads(message)
            except ValueError:
                payload = None
        if isinstance(payload, dict):
            base.update(payload)
        else:
            base["message"] = message
        if record.exc_info:
            base["exc"] = self.formatException(record.exc_info)
        return json.dumps(base, separators=(",", ":"), ensure_ascii=False, default=str)


def configure_logging(level: int | str = logging.INFO) -> None:
    """Install the JSON handler on the root logger (process entry points only)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
