"""Structured logging for the gateway process: the shared JSON formatter.

The formatter lives in `pdserve/logs.py` (stdlib only) so the workers use the
same one without importing the gateway; this module re-exports it. Request
records of the `pdserve.gateway` logger are already JSON (see
gateway/openai_api.py) and pass through unchanged, with time and level added.
"""

from __future__ import annotations

from pdserve.common.logs import JsonFormatter, configure_logging

__all__ = ["JsonFormatter", "configure_logging"]
