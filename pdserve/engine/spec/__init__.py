"""Speculative decoding: draft proposers, the per-step regime switch and acceptance.

Drafting and acceptance live here; the scheduler, the runner and the engine only
carry a sequence's draft tokens (`Sequence.spec_token_ids`,
`SeqChunk.num_draft_tokens`) through one step.
"""
