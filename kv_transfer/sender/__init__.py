"""Prefill side of the KV handoff."""
