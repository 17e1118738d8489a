"""`TinyGPT`: a GPT-2-shaped decoder whose head weight **is** the token-embedding weight (the
tied pair every wrap policy must respect); `MLPStack`, residual MLP blocks with no attention in
the way; and the synthetic tokens every lab trains on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Args:
    vocab_size: tokens in the vocabulary (rows of the tied embedding/head).
    seq_len: longest sequence (rows of the position embedding).
    dim: model width.
    n_layers: transformer blocks.
    n_heads: attention heads (must divide `dim`).
    """

    vocab_size: int = 64
    seq_len: int = 16
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "dim", "n_layers", "n_heads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}: expected an int >= 1")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)  # 3 x (B, T, C)
        shape = (B, T, self.n_heads, C // self.n_heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, H, T, C/H)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, C/H)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x)). The usual wrap unit."""

    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, n_heads)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT with its language-model head tied to the token embedding (one shared Parameter)."""

    def __init__(self, config: GPTConfig = GPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.tok_emb = nn.Embedding(config.vocab_size, config.dim)
        self.pos_emb = nn.Embedding(config.seq_len, config.dim)
        self.blocks = nn.ModuleList(
            Block(config.dim, config.n_heads) for _ in range(config.n_layers)
        )
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # the tie: one Parameter, two owners
        self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2 style: N(0, 0.02), residual projections scaled by 1/sqrt(2 n_layers)."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif p.dim() == 1:  # LayerNorm gains
                p.fill_(1.0)
            else:
                std = 0.02 / math.sqrt(2 * self.config.n_layers) if "proj" in name else 0.02
                p.normal_(0.0, std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))  # (B, T, V)


class MLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class MLPStack(nn.Module):
    """Embedding, `n_layers` residual MLP blocks, untied head: no attention, no tie."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, n_layers: int = 4) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.emb = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(MLPBlock(dim) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.head(x)  # (B, T, V)


def tiny_gpt(**overrides: int) -> TinyGPT:
    """Factory for ``--model fsdp_lab.models:tiny_gpt`` (seeded, so every rank builds the same)."""
    torch.manual_seed(0)
    return TinyGPT(GPTConfig(**overrides))


def synthetic_batch(
    vocab_size: int, batch: int, seq_len: int, step: int, seed: int = 1234
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets, the same on every rank for the same `step`."""
    g = torch.Generator().manual_seed(seed + step)
    tokens = torch.randint(0, vocab_size, (batch, seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]
