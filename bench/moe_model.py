"""A tiny Mixtral trained on the story corpus, for `bench/quality.py --moe`.

    python -m bench.moe_model        # trains it if it is not cached, prints the directory

The weight-quantization quality table wants every supported family on a model that has
learned something; the shipped models are dense Llamas. This trains a Mixtral (the
`pdserve/engine/models/moe.py` family with float32 routers, Hugging Face layout) of
`MOE_SHAPE` with the built-in tokenizer on the same training split, with the same
loop, seeds and schedule as the built-in models (`pdserve.builtin.train.train`; its
training time is in bench/README.md). Never shipped: the directory is keyed by the
shape's and the schedule's fingerprint under `$PDSERVE_BENCH_MODELS` (default: the
temp dir) and reused, like `bench/models.py`'s random shapes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.builtin.train import TrainConfig, fit, token_stream

VERSION = 1
MOE_SHAPE: dict[str, Any] = {  # ~1.6M weights besides the embeddings: 4 experts, top 2
    "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "intermediate_size": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "sliding_window": None, "tie_word_embeddings": False, "initializer_range": 0.02,
}
SCHEDULE = TrainConfig(steps=200, batch=4, seq_len=128, lr=5e-3)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


class _Logits(nn.Module):
    """ids -> logits of a Hugging Face causal LM, the interface `train` drives."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hf(input_ids=ids).logits


def fingerprint(schedule: TrainConfig = SCHEDULE) -> str:
    key = json.dumps([VERSION, MOE_SHAPE, dataclasses.asdict(schedule)], sort_keys=True)
    return hashlib.sha256(key.encode()).hexdigest()[:12]


def train_moe(out_dir: Path, schedule: TrainConfig = SCHEDULE, threads: int = 1,
              log: bool = False, split: str = "train") -> dict[str, float]:
    """Train the Mixtral into `out_dir` (a Hugging Face directory with the built-in
    tokenizer) on the corpus split `split` (a quick check may take the small held-out
    one); returns its training record (losses per token, seconds)."""
    from tokenizers import Tokenizer
    from transformers import MixtralConfig, MixtralForCausalLM

    from pdserve.builtin.default_model import write_builtin_model

    write_builtin_model(out_dir / "tok")  # the trained built-in's tokenizer files
    for f in TOKENIZER_FILES:
        shutil.copyfile(out_dir / "tok" / f, out_dir / f)
    shutil.rmtree(out_dir / "tok")
    tok_path = out_dir / "tokenizer.json"
    held_ids = token_stream("heldout", tok_path)
    train_ids = held_ids if split == "heldout" else token_stream(split, tok_path)
    vocab = Tokenizer.from_file(str(tok_path)).get_vocab_size(with_added_tokens=True)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(schedule.seed)
        hf = MixtralForCausalLM(MixtralConfig(vocab_size=vocab, **MOE_SHAPE))
        # Held-out loss over the first 64 rows only: the quality table scores the rest.
        result = fit(_Logits(hf), schedule, train_ids, held_ids[: 64 * schedule.seq_len + 1], log)
    finally:
        torch.set_num_threads(prev)
    hf.save_pretrained(out_dir, safe_serialization=True)
    record = {"steps": schedule.steps, "train_loss": round(result.train_loss, 4),
              "heldout_loss": round(result.heldout_loss, 4), "seconds": round(result.seconds, 1)}
    (out_dir / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def trained_moe_dir(root: str | None = None) -> Path:
    """The trained Mixtral's directory, trained on first use (a few minutes), then reused."""
    base = Path(root or os.environ.get("PDSERVE_BENCH_MODELS") or tempfile.gettempdir())
    out = base / f"pdserve-bench-moe-{fingerprint()}"
    if not (out / "model.safetensors").is_file():
        tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=base))
        train_moe(tmp)
        tmp.chmod(0o755)
        try:
            tmp.rename(out)  # atomic: a concurrent trainer's copy is as good as ours
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (out / "model.safetensors").is_file():
                raise
    return out


if __name__ == "__main__":
    path = trained_moe_dir()
    print(path, (path / "training.json").read_text(), sep="\n")
