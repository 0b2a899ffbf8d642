"""Serving overhead: end-to-end decode tokens/s through the gateway vs the engine alone.

    .venv/bin/python -m bench.serve [--model DIR] [--concurrency 1,16] [--prompt-len 64 --output-len 64]

For each concurrency C, in the same run: (1) the single-process `LLMEngine`
decodes C requests together and its decode tokens/s is measured once all C are
decoding; (2) `pdserve up` (1 prefill + 1 decode by default, or `--colocated`)
serves C concurrent streaming requests of the same shape and the client
measures decode tokens/s (tokens after the first, over the decode window).
Prints the ratio gateway / engine per C. The engine runs before the cluster
starts, so the two never compete for cores. Target (issue 4): >= 0.8 at C=16.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass

from bench import harness
from bench.client import served_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.loadgen.launch import pdserve_up


@dataclass(frozen=True)
class Shape:
    concurrency: int
    prompt_len: int
    output_len: int


def prompt_ids(i: int, n: int, salt: int = 0) -> list[int]:
    """Distinct per (i, salt) from the first token on, so no run hits the prefix cache
    filled by another."""
    return [(17 + i * 31 + salt * 7919 + k * 7) % 1000 + 5 if k else 1000 + (i + 64 * salt) % 1000 for k in range(n)]


def engine_decode_tps(model_dir: str, shape: Shape, threads: int) -> float:
    """Decode tokens/s of the engine with `concurrency` sequences decoding together."""
    engine = harness.reference_engine(model_dir, threads)
    params = SamplingParams(max_tokens=shape.output_len, temperature=0.0, ignore_eos=True)
    prompts = [prompt_ids(i, shape.prompt_len, shape.concurrency) for i in range(shape.concurrency)]
    w = harness.engine_wave(engine, prompts, params, warmup=prompt_ids(999, shape.prompt_len))
    return w.decode_tokens / w.decode_s


async def _stream(session: object, url: str, model: str, i: int, shape: Shape) -> tuple[float, float, int]:
    body = {"model": model, "prompt": prompt_ids(i, shape.prompt_len, shape.concurrency), "max_tokens": shape.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    first = last = 0.0
    chunks = usage = 0
    async with session.post(f"{url}/v1/completions", json=body) as r:  # type: ignore[attr-defined]
        async for line in r.content:
            if line.startswith(b"data: {"):
                ev = json.loads(line[6:])
                if ev.get("choices") and ev["choices"][0].get("text"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
                if ev.get("usage"):
                    usage = int(ev["usage"]["completion_tokens"])
    # A chunk may carry several tokens: count the server's usage, not chunks.
    return first, last, usage or chunks


async def gateway_decode_tps(url: str, model: str, shape: Shape) -> float:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        await _stream(s, url, model, 999, Shape(1, shape.prompt_len, 4))  # warm-up
        res = await asyncio.gather(*[_stream(s, url, model, i, shape) for i in range(shape.concurrency)])
    start = max(r[0] for r in res)  # all C streams decoding from here on
    end = max(r[1] for r in res)
    # Tokens each stream produced inside the window, assuming a steady per-stream rate.
    tokens = sum((r[2] - 1) * max(0.0, min(r[1], end) - start) / max(r[1] - r[0], 1e-9) for r in res)
    return tokens / max(end - start, 1e-9)


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser(__doc__, model_help="model dir (default: built-in); also passed to `pdserve up`")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--num-blocks", type=int, default=1024)
    ap.add_argument("--colocated", action="store_true")
    args = ap.parse_args(argv)
    model_dir = harness.model_dir(args.model)
    shapes = [Shape(int(c), args.prompt_len, args.output_len) for c in args.concurrency.split(",")]
    engine = {s.concurrency: engine_decode_tps(model_dir, s, args.threads) for s in shapes}
    up = ["--threads", str(args.threads), "--num-blocks", str(args.num_blocks), *(["--colocated"] if args.colocated else [])]
    rows = []
    with pdserve_up("serve", up + harness.up_args("", args.model)) as server:
        model = served_model(server.base_url)
        for s in shapes:
            tps = asyncio.run(gateway_decode_tps(server.base_url, model, s))
            rows.append({"concurrency": s.concurrency, "engine_decode_tps": round(engine[s.concurrency], 1),
                         "gateway_decode_tps": round(tps, 1), "ratio": round(tps / engine[s.concurrency], 3)})
    print(f"{harness.machine_line()}\n{'C':>4} {'engine tok/s':>13} {'gateway tok/s':>14} {'ratio':>6}")
    for r in rows:
        print(f"{r['concurrency']:>4} {r['engine_decode_tps']:>13} {r['gateway_decode_tps']:>14} {r['ratio']:>6}")
    result = {"topology": "colocated" if args.colocated else "1P+1D", "results": rows}
    print(json.dumps(result))
    harness.write_json(args.output_json, {"args": vars(args), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
