"""Weight quantization speed on a mixture-of-experts model: bf16 vs int8 vs int4 experts.

    python -m bench.moe_quant [--quick] [--model DIR] [--reps 3] [--threads N]

`bench.quant`'s measurement (c=1 decode ITL, c=16 output tok/s, prefill tok/s, schemes
interleaved, ratios against bf16 in the same run) over a random-weight Mixtral of a
~170M shape (6 layers, hidden 768, 8 experts of 1,024, top-2: the experts are two
thirds of the weights) unless `--model` names a checkpoint. Each expert's matmul sees only the
tokens routed to it (at c=16, ~4 rows), the small-M regime of the int8/int4 kernels.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from bench import quant

MIXTRAL_170M: dict[str, Any] = {
    "hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12, "num_key_value_heads": 4,
    "intermediate_size": 1024, "num_local_experts": 8, "num_experts_per_tok": 2, "vocab_size": 32000,
    "max_position_embeddings": 2048, "sliding_window": None,
}


def build_moe(out_dir: Path) -> Path:
    """A random-weight Mixtral of the shape above, saved in the Hugging Face layout."""
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    MixtralForCausalLM(MixtralConfig(**MIXTRAL_170M)).save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def main(argv: list[str] | None = None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--model" in args:
        return quant.main(args)
    with tempfile.TemporaryDirectory() as tmp:
        return quant.main([*args, "--model", str(build_moe(Path(tmp) / "moe-170m"))])


if __name__ == "__main__":
    main()
