"""Structured logging for the gateway process: one JSON object per line on stderr.

Request records of the `pdserve.gateway` logger are already JSON (see
gateway/openai_api.py) and pass through unchanged, with time and level added;
other records are wrapped as `{"time", "level", "logger", "message"}`.
"""

from __future__ import annotations

import json
import logging
import sys
import time


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
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
        return json.dumps(base, separators=(",", ":"), ensure_ascii=False)


def configure_logging(level: int | str = logging.INFO) -> None:
    """Install the JSON handler on the root logger (the gateway process entry point only)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
