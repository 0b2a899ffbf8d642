"""pdserve: disaggregated prefill/decode LLM serving (shared CLI, config and protocol)."""

from __future__ import annotations

__version__ = "0.1.0"
