"""What a new request must satisfy before the engine queues it: anything failing
here could never be served, so it is refused at once with a one-line ValueError
(the worker passes the message on to the client).
"""

from __future__ import annotations

from pdserve.common.sampling_params import SamplingParams
from pdserve.engine.core.block_manager import BlockManager
from pdserve.engine.core.config import SchedulerConfig


def check_request(prompt: list[int], outputs: list[int], params: SamplingParams,
                  choice_index: int, *, vocab_size: int, max_model_len: int,
                  blocks: BlockManager, scheduler: SchedulerConfig) -> None:
    """Resume rules (`outputs`, `choice_index`), then whether prompt + max_tokens fits
    the vocabulary, the context length, the whole KV cache and the step budget."""
    if outputs and (params.n != 1 or len(outputs) >= params.max_tokens):
        raise ValueError("resumed output tokens need n=1 and fewer than max_tokens of them")
    if choice_index and (params.n != 1 or choice_index < 0):
        raise ValueError("choice_index needs n=1 and is never negative")
    prompt_len = len(prompt)
    if not prompt_len:
        raise ValueError("the prompt is empty")
    bad = [t for t in prompt + outputs if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    total = prompt_len + params.max_tokens
    if total > max_model_len:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) = {total} "
            f"exceeds max_model_len {max_model_len}"
        )
    if blocks.blocks_for(total) > blocks.num_allocatable:
        raise ValueError(
            f"prompt + max_tokens = {total} tokens needs {blocks.blocks_for(total)} KV blocks; "
            f"the cache has {blocks.num_allocatable}"
        )
    if not scheduler.enable_chunked_prefill and total > scheduler.max_num_batched_tokens:
        raise ValueError(
            f"{total} tokens exceed max_num_batched_tokens {scheduler.max_num_batched_tokens} "
            "and chunked prefill is off"
        )
