"""`pdserve generate "prompt"`: run the engine in this one process and print the text.

The single-process reference: end-to-end tests compare the disaggregated system
against its `--json` output (`prompt_token_ids`, `token_ids`, `text`).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pdserve.cli.args import (
    add_model_arg,
    check_model,
    check_speculative,
    positive_int,
)
from pdserve.cli.worker_args import ENGINE_FLAGS, WorkerArgs
from pdserve.common.sampling_params import SamplingParams, SamplingParamsError


def register(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text in one process", description=__doc__.splitlines()[0]
    )
    p.add_argument("prompts", nargs="+", help="one or more prompts (run together in one batch)")
    add_model_arg(p)
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--n", type=int, default=1, help="choices per prompt")
    p.add_argument("--ignore-eos", action="store_true")
    WorkerArgs.add_to(p, only=("device", *ENGINE_FLAGS, "block_size", "speculative_config"))
    p.add_argument("--num-threads", type=positive_int, default=None, help="torch intra-op threads")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.set_defaults(func=run)


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        n=args.n,
        ignore_eos=args.ignore_eos,
    ).validate()


def _encode(tokenizer: Any, args: argparse.Namespace, prompt: str) -> list[int]:
    if not args.chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": args.system}] if args.system else []
    messages.append({"role": "user", "content": prompt})
    return list(tokenizer.encode_chat(messages))


def run(args: argparse.Namespace) -> int:
    from gateway.chat_template import ChatTemplateError
    from gateway.tokenizer import Tokenizer
    from pdserve.builtin.default_model import default_model_dir

    try:
        params = _sampling_params(args)
    except SamplingParamsError as e:
        print(f"pdserve generate: --{e.param.replace('_', '-')}: {e}", file=sys.stderr)
        return 2
    check_model(args.model)
    check_speculative(args.speculative_config)
    model_dir = args.model or default_model_dir()
    tokenizer = Tokenizer.from_model_dir(model_dir)
    try:
        prompts = [_encode(tokenizer, args, p) for p in args.prompts]
    except ChatTemplateError as e:
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2

    from pdserve.engine.core.config import CacheConfig, EngineConfig
    from pdserve.engine.llm_engine import LLMEngine

    # Exactly the blocks this batch can use (plus the null block), not a default budget.
    bs = args.block_size
    # Drafts never reach past prompt + max_tokens (pdserve/engine/spec/decoder.py caps them).
    blocks = sum(-(-(len(p) + params.max_tokens) // bs) * params.n for p in prompts) + 1
    config = EngineConfig(
        model_dir=str(model_dir),
        dtype=args.dtype,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        device=args.device,
        num_threads=args.num_threads,
        kv_cache_dtype=args.kv_cache_dtype,
        cache=CacheConfig(block_size=bs, num_blocks=blocks),
        speculative=args.speculative_config,
    )
    try:
        results = LLMEngine(config).generate(prompts, params)
    except ValueError as e:  # e.g. a prompt longer than the model's context
        print(f"pdserve generate: {e}", file=sys.stderr)
        return 2
    for result in results:
        for choice in result.choices:
            text = tokenizer.decode(choice.token_ids)
            if args.json:
                record = {
                    "prompt_token_ids": list(result.prompt_token_ids),
                    "token_ids": list(choice.token_ids),
                    "text": text,
                    "finish_reason": choice.finish_reason,
                    "index": choice.index,
                }
                print(json.dumps(record, ensure_ascii=False))
            else:
                print(text)
    return 0
