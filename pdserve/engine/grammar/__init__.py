"""Structured outputs on the worker: constraints compiled into grammars (cached by
hash, under a compile timeout) and per-sequence matchers that mask the sampler's
logits. Torch appears only in `masking.py`."""
