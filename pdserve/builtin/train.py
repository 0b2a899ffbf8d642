"""Train the built-in models on `pdserve.builtin.story_corpus` (`pdserve train-model`).

Writes `pdserve/builtin/weights/`: `tokenizer.json` (byte-level BPE retrained on the
corpus), `tiny-llama.safetensors` and `tiny-llama-draft.safetensors` (float32, Hugging
Face Llama names) and `training.json` (the record below, with file digests).
`pdserve.builtin.default_model` assembles the served directories from these files without
torch. The model here is a plain Llama (RMSNorm, rotary embedding, grouped-query
attention, SwiGLU) in the Hugging Face layout, so the engine and `transformers` load
the result as they load any Llama checkpoint.

Deterministic: fixed seeds, float32, a fixed thread count and deterministic torch
algorithms; the batches are drawn from one seeded generator.

Last training (2 shared CPU cores): see `TRAINING_RECORD`. The models write readable
English in the corpus's style and end their chat turns, but have not learned to pick the
topic a question names (3 of the 40 "Tell me about X." topics answered on topic).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from pdserve.builtin.default_model import BUILTIN_WEIGHTS_DIR, DRAFT_SPEC, TINY_SPEC, WEIGHT_FILES
from pdserve.builtin.random_model import DefaultModelSpec
from pdserve.builtin.story_corpus import documents, plain_text, render
from pdserve.builtin.tokenizer import train_tokenizer

# The committed weights' run (training.json has the same numbers): one torch thread each,
# the two models trained side by side on 2 CPU cores shared with other test runs.
# Held-out loss is per token over all 41,385 held-out tokens (327,924 training tokens).
TRAINING_RECORD = (
    "pdserve-tiny-llama: 500 steps x 4 x 256 tokens, 822 s, train loss 0.547, held-out 0.553; "
    "pdserve-tiny-llama-draft: 300 steps x 4 x 256 tokens, 329 s, train loss 0.720, held-out 0.722"
)


@dataclass(frozen=True)
class TrainConfig:
    steps: int
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.01
    seed: int = 0


TRAIN_CONFIGS = {
    "tiny-llama": TrainConfig(steps=500, batch=4, lr=5e-3),
    "tiny-llama-draft": TrainConfig(steps=300, batch=4, lr=5e-3),
}
SPECS = {"tiny-llama": TINY_SPEC, "tiny-llama-draft": DRAFT_SPEC}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(nn.Module):
    def __init__(self, s: DefaultModelSpec) -> None:
        super().__init__()
        self.s = s
        self.q_proj = nn.Linear(s.hidden_size, s.num_heads * s.head_dim, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_kv_heads * s.head_dim, bias=False)
        self.o_proj = nn.Linear(s.num_heads * s.head_dim, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        s = self.s
        q = self.q_proj(x).view(b, t, s.num_heads, s.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_kv_heads, s.head_dim).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        rep = s.num_heads // s.num_kv_heads  # query head h reads KV head h // rep, as in HF
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class _MLP(nn.Module):
    def __init__(self, s: DefaultModelSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    def __init__(self, s: DefaultModelSpec) -> None:
        super().__init__()
        self.self_attn = _Attention(s)
        self.mlp = _MLP(s)
        self.input_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.post_attention_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, s: DefaultModelSpec, vocab_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.num_layers))
        self.norm = _RMSNorm(s.hidden_size, s.rms_norm_eps)


class TinyLlama(nn.Module):
    """A Llama whose `state_dict()` names are Hugging Face's `LlamaForCausalLM` names."""

    def __init__(self, s: DefaultModelSpec, vocab_size: int) -> None:
        super().__init__()
        self.spec = s
        self.model = _Body(s, vocab_size)
        self.lm_head = nn.Linear(s.hidden_size, vocab_size, bias=False)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2).float() / s.head_dim))
        freqs = torch.arange(s.max_position_embeddings).float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos(), emb.sin()  # not weights: never saved
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual projections shrink with depth (GPT-2's scaled init).
                deep = name.endswith(("o_proj.weight", "down_proj.weight"))
                std = s.init_std / math.sqrt(2 * s.num_layers) if deep else s.init_std
                nn.init.normal_(p, 0.0, std)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab] of token ids [batch, time]."""
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))


class TrainResult(NamedTuple):
    state: dict[str, torch.Tensor]
    train_loss: float  # mean over the last 10% of steps
    heldout_loss: float  # teacher-forced, every held-out token once
    seconds: float


def token_stream(split: str, tok_path: Path) -> torch.Tensor:
    """The split's documents rendered and tokenized end to end, one long int64 tensor."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_path))
    enc = tok.encode_batch([render(d) for d in documents(split)], add_special_tokens=False)
    return torch.tensor([i for e in enc for i in e.ids], dtype=torch.long)


def _lr(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    frac = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def heldout_loss(model: nn.Module, stream: torch.Tensor, seq_len: int) -> float:
    n = (len(stream) - 1) // seq_len
    total = 0.0
    for i in range(0, n, 16):
        rows = range(i, min(n, i + 16))
        x = torch.stack([stream[r * seq_len : (r + 1) * seq_len] for r in rows])
        y = torch.stack([stream[r * seq_len + 1 : (r + 1) * seq_len + 1] for r in rows])
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten(), reduction="sum").item()
    return total / (n * seq_len)


def train(spec: DefaultModelSpec, cfg: TrainConfig, train_ids: torch.Tensor,
          heldout_ids: torch.Tensor, vocab_size: int, log: bool = True) -> TrainResult:
    """Train one model from seed `cfg.seed`; deterministic for a given thread count."""
    torch.manual_seed(cfg.seed)
    return fit(TinyLlama(spec, vocab_size), cfg, train_ids, heldout_ids, log)


def fit(model: nn.Module, cfg: TrainConfig, train_ids: torch.Tensor, heldout_ids: torch.Tensor,
        log: bool = True) -> TrainResult:
    """Train `model` (token ids [batch, time] -> logits) in place on `cfg`'s schedule, its
    batches drawn from seed `cfg.seed` (bench/moe_model.py trains its Mixtral here too)."""
    gen = torch.Generator().manual_seed(cfg.seed)
    decay = [p for p in model.parameters() if p.dim() == 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    start, losses = time.monotonic(), []
    for step in range(cfg.steps):
        offs = torch.randint(0, len(train_ids) - cfg.seq_len - 1, (cfg.batch,), generator=gen)
        x = torch.stack([train_ids[o : o + cfg.seq_len] for o in offs.tolist()])
        y = torch.stack([train_ids[o + 1 : o + cfg.seq_len + 1] for o in offs.tolist()])
        for g in opt.param_groups:
            g["lr"] = _lr(cfg, step)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if log and (step % 20 == 0 or step == cfg.steps - 1):
            print(f"step {step:4d} loss {losses[-1]:.4f} {time.monotonic() - start:6.1f}s", flush=True)
    seconds = time.monotonic() - start
    tail = losses[-max(1, cfg.steps // 10) :]
    model.eval()
    held = heldout_loss(model, heldout_ids, cfg.seq_len)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    return TrainResult(state, sum(tail) / len(tail), held, seconds)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def train_all(out_dir: Path = BUILTIN_WEIGHTS_DIR, threads: int = 1, steps: int | None = None,
              names: Sequence[str] = tuple(SPECS)) -> dict[str, object]:
    """Retrain the tokenizer and the models `names` into `out_dir`; returns the record.

    Models trained by separate runs (`names`) share one tokenizer (it is deterministic)
    and one `training.json`, each run updating its own entries.
    """
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    out_dir.mkdir(parents=True, exist_ok=True)
    texts = [*plain_text("train").split("\n\n"), "system user assistant"]  # the chat roles
    tok = train_tokenizer(TINY_SPEC.target_vocab_size, texts)
    tok_path = out_dir / WEIGHT_FILES["tokenizer"]
    tmp = tok_path.with_suffix(f".tmp{os.getpid()}")
    tok.save(str(tmp), pretty=False)
    os.replace(tmp, tok_path)  # atomic: a concurrent run reads a whole file
    vocab = tok.get_vocab_size(with_added_tokens=True)
    train_ids, held_ids = token_stream("train", tok_path), token_stream("heldout", tok_path)
    done: dict[str, object] = {}
    for name in names:
        cfg = TRAIN_CONFIGS[name]
        if steps is not None:
            cfg = dataclasses.replace(cfg, steps=steps)
        r = train(SPECS[name], cfg, train_ids, held_ids, vocab)
        path = out_dir / WEIGHT_FILES[name]
        save_file(r.state, str(path), metadata={"format": "pt"})
        done[name] = {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                      "lr": cfg.lr, "threads": threads, "seconds": round(r.seconds, 1),
                      "train_loss": round(r.train_loss, 4), "heldout_loss": round(r.heldout_loss, 4),
                      "sha256": _sha256(path)}
        print(name, done[name], flush=True)
    rec_path = out_dir / WEIGHT_FILES["record"]
    record = json.loads(rec_path.read_text()) if rec_path.exists() else {}
    record.update({"train_tokens": len(train_ids), "heldout_tokens": len(held_ids),
                   "tokenizer_sha256": _sha256(tok_path), **done})
    record.pop("threads", None)
    rec_path.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return record


