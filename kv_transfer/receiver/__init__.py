"""Decode side of the KV handoff."""
