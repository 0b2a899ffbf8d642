"""The draft model's identity and engine config, shared by the decode-side proposer and,
with `draft_kv=prefill`, the prefill worker that runs the draft too.

With `draft_kv=prefill` the target pool's `KVLayout.draft` carries the draft's own
layout hash, so the compatibility hash the gateway and the KV handshake compare covers
the draft: a prefill worker and a decode worker with different drafts never pair. The
number of speculative tokens stays out of it: it changes nothing in the draft's KV.
"""

from __future__ import annotations

from dataclasses import replace

from pdserve.engine.core.config import CacheConfig, EngineConfig


def draft_engine_config(target: EngineConfig, draft_dir: str, num_blocks: int) -> EngineConfig:
    """The draft's runner config: the target's dtype, device and block size, its own pool
    of `num_blocks` blocks, no prefix caching, no speculation of its own."""
    return EngineConfig(model_dir=draft_dir, dtype=target.dtype, device=target.device,
                        cache=CacheConfig(block_size=target.cache.block_size, num_blocks=num_blocks,
                                          enable_prefix_caching=False),
                        scheduler=replace(target.scheduler, max_model_len=None))
