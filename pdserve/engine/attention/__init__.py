"""Paged attention backends (gather + SDPA, native CPU, Triton, FlashInfer) and their choice."""
