"""The LoRA demo: a small adapter for the built-in story model that makes it talk like a
pirate, trained here in a minute or two on the CPU with `peft` (a test extra).

    .venv/bin/python -m pdserve.builtin.lora_demo lora-demo/pirate      # or: make lora-demo
    .venv/bin/pdserve up --enable-lora --lora-modules pirate=lora-demo/pirate

Then `"model": "pirate"` answers in the pirate style ("Ahoy", "ye", "matey", "Arr!") and
`"model": "pdserve-tiny-llama"` as before. The training text is the built-in model's own
story corpus (pdserve/builtin/story_corpus.py) with pirate words swapped in: the adapter learns
the style, not new stories.
"""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path
from typing import Any

PIRATE = {"the": "ye", "The": "Ye", "my": "me", "My": "Me", "you": "ye", "You": "Ye", "is": "be",
          "are": "be", "friend": "matey", "friends": "mateys", "yes": "aye", "Yes": "Aye",
          "Hello": "Ahoy", "hello": "ahoy", "Hi": "Ahoy", "hi": "ahoy", "said": "roared"}
_WORD = re.compile(r"\b(" + "|".join(PIRATE) + r")\b")


def piratize(text: str) -> str:
    """The pirate style: the words swapped, every paragraph ending in "Arr!"."""
    swapped = _WORD.sub(lambda m: PIRATE[m[1]], text)
    return "\n\n".join(p.rstrip() + " Arr!" for p in swapped.split("\n\n") if p.strip())


def train(out: Path, steps: int = 300, rank: int = 8, seq_len: int = 128, batch: int = 8,
          seed: int = 0) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    from pdserve.builtin.default_model import default_model_dir
    from pdserve.builtin.story_corpus import documents

    base = default_model_dir()
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    stories = [d.text for d in documents("train") if d.text]
    ids = tok.encode("\n\n".join(piratize(s) for s in stories[:2000])).ids
    model: Any = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), LoraConfig(
        r=rank, lora_alpha=2 * rank, lora_dropout=0.0, bias="none", task_type="CAUSAL_LM",
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    model.train()
    for step in range(steps):
        starts = [rng.randrange(0, len(ids) - seq_len - 1) for _ in range(batch)]
        x = torch.tensor([ids[s:s + seq_len] for s in starts])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("out", type=Path, help="directory to write the PEFT adapter into")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    print(f"LoRA demo adapter written to {train(args.out, steps=args.steps)}")


if __name__ == "__main__":
    main()
