"""Shared test helpers (tiny random-weight checkpoints, ...)."""
