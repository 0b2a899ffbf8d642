"""Random-weight Llamas of named shapes for the benchmarks, written once per shape.

    .venv/bin/python -m bench.models 125m        # prints the directory

A bench script's `--model shape:NAME` (e.g. `shape:125m`) stands for the directory
`model_for` writes: a Llama of the shape `SHAPES[NAME]`, random weights (float32, the
built-in model's seed and init: lm_head drawn wide so greedy answers are decisive) and
the built-in tokenizer, so the bench prompts tokenize as they do on the built-in
model; tokens that decode to no text alone never win a greedy pick (`text_tokens_only`). `125m` is the ~125M shape of `bench/engine.py` (`LLAMA_125M`: hidden 768, 12
layers, 12 heads, 4 KV heads, intermediate 2048) with the built-in vocabulary; `mid`
is a ~25M step between it and the built-in 4-layer model. Both take 4,096 positions: a
random model's answer can re-tokenize longer than it was generated, and a conversation
that grows past 2,048 tokens must not end a run. The directory is keyed by
the shape's fingerprint under `$PDSERVE_BENCH_MODELS` (default: the temp dir), so a
changed shape is rebuilt and an unchanged one reused.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from pdserve.builtin.random_model import DefaultModelSpec, fingerprint, write_random_model

PREFIX = "shape:"
VERSION = 2  # in the directory name: 2 keeps byte pieces from winning greedy picks
SHAPES: dict[str, DefaultModelSpec] = {
    "125m": DefaultModelSpec(hidden_size=768, num_layers=12, num_heads=12, num_kv_heads=4,
                             intermediate_size=2048, max_position_embeddings=4096),
    "mid": DefaultModelSpec(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                            intermediate_size=1376, max_position_embeddings=4096),
}


def is_named(model: str | None) -> bool:
    return model is not None and model.startswith(PREFIX)


def model_for(name: str, root: str | None = None) -> Path:
    """The directory of shape `name`'s model, written if it is not there yet."""
    if name not in SHAPES:
        raise ValueError(f"model shape must be one of {', '.join(SHAPES)}, not {name!r}")
    spec = SHAPES[name]
    base = Path(root or os.environ.get("PDSERVE_BENCH_MODELS") or tempfile.gettempdir())
    out = base / f"pdserve-bench-{name}-{fingerprint(spec)}-v{VERSION}"
    if not (out / "model.safetensors").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=base))
        write_random_model(tmp, spec)
        text_tokens_only(tmp)
        tmp.chmod(0o755)  # mkdtemp's 0700: the model is shared data
        try:
            tmp.rename(out)  # atomic: a concurrent writer's copy is as good as ours
        except OSError:
            if not (out / "model.safetensors").is_file():
                raise
    return out


def text_tokens_only(model_dir: Path) -> list[int]:
    """Zero the lm_head rows of the tokens that decode to no text of their own (byte
    pieces of a character, specials, bare whitespace) and return their ids. A random
    model's greedy pick is otherwise often a byte piece, whose text the server holds
    back until the character completes: a client timing the first text (the load
    generator) would count decode steps into TTFT. A zero row's logit is 0, below the
    best of the other rows' (drawn wide) at every step."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    path = model_dir / "model.safetensors"
    weights = load_file(str(path))
    head = weights["lm_head.weight"]
    silent = [i for i in range(head.shape[0]) if not tok.decode([i]).strip() or "\ufffd" in tok.decode([i])]
    head[silent] = 0
    save_file(weights, str(path), metadata={"format": "pt"})
    return silent


def resolve(model: str | None) -> str | None:
    """`model` itself, or the directory a `shape:NAME` stands for."""
    if model is None or not is_named(model):
        return model
    return str(model_for(model[len(PREFIX):]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("shape", choices=sorted(SHAPES))
    ap.add_argument("--root", default=None, help="parent directory (default: $PDSERVE_BENCH_MODELS or the temp dir)")
    args = ap.parse_args(argv)
    print(model_for(args.shape, args.root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
