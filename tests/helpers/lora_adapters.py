"""Random PEFT LoRA adapters for tests, made and saved by the real `peft` package.

PEFT initialises lora_B to zero (an adapter that changes nothing); here every LoRA
weight is redrawn non-zero and large enough that the adapter visibly changes greedy
output, so a server that ignored it (or applied another adapter) fails the test.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


# The three adapters the equivalence tests serve: different ranks, target modules,
# per-module ranks, one with rank-stabilised scaling.
@dataclass(frozen=True)
class AdapterSpec:
    name: str
    r: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    rank_pattern: dict[str, int] = field(default_factory=dict)
    seed: int = 0


THREE_ADAPTERS = (
    AdapterSpec("attn-r4", 4, 8.0, ("q_proj", "v_proj"), seed=1),
    AdapterSpec("mlp-r8-rslora", 8, 16.0, ("gate_proj", "up_proj", "down_proj"), rslora=True, seed=2),
    AdapterSpec("all-r16", 16, 32.0, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                      "up_proj", "down_proj"), rank_pattern={"o_proj": 2}, seed=3),
)


def make_peft_adapter(base_dir: Path, out_dir: Path, spec: AdapterSpec, scale: float = 0.3) -> Path:
    """Save a PEFT LoRA adapter for the checkpoint at `base_dir` into `out_dir`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets),
                        use_rslora=spec.rslora, rank_pattern=dict(spec.rank_pattern),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(1234 + spec.seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    model.save_pretrained(out_dir)
    return Path(out_dir)


def peft_model(base_dir: Path, adapter_dir: Path) -> Any:
    """transformers + peft: the reference model for `adapter_dir` (float32, eager)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                attn_implementation="eager")
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    model.generation_config.eos_token_id = None
    return model


def peft_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), do_sample=False,
                             max_new_tokens=new_tokens, pad_token_id=0)
    return [int(t) for t in out[0, len(prompt):]]
