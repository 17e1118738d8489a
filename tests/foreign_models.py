"""Models the pipeline tests feed it that fsdp_lab did not write: a small torchtitan-shaped Llama
(``layers`` an nn.ModuleList, RMSNorm, ``tok_embeddings``/``output``, its own ``init_weights``)
and a model built only of PyTorch's layers in an nn.Sequential (PyTorch's default init).

Shared by test_pipeline.py and test_pipeline_rng.py; importable on the ranks (tests/ is on the
path the cluster's ranks start with).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, DIM, LAYERS, HEADS, FFN = 32, 16, 4, 2, 32


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x (B, H, T, d), the angles computed here, not cached: each
    block takes one tensor and returns one, so the model is a plain chain of its children."""
    T, d = x.shape[-2], x.shape[-1]
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = torch.outer(torch.arange(T, dtype=torch.float32, device=x.device), inv_freq)
    cos, sin = angles.cos(), angles.sin()  # (T, d/2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (
            w(x).view(B, T, self.n_heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        y = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, C))

    def init_weights(self, init_std: float) -> None:  # torchtitan's Attention.init_weights
        for linear in (self.wq, self.wk, self.wv):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, init_std: float) -> None:  # torchtitan's FeedForward.init_weights
        nn.init.trunc_normal_(self.w1.weight, mean=0.0, std=0.02)
        for linear in (self.w2, self.w3):
            nn.init.trunc_normal_(linear.weight, mean=0.0, std=init_std)


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, dim: int, n_heads: int, hidden: int) -> None:
        super().__init__()
        self.attention = Attention(dim, n_heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = nn.RMSNorm(dim, eps=1e-5)
        self.ffn_norm = nn.RMSNorm(dim, eps=1e-5)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5  # torchtitan's depth_init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def init_weights(self) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)
        self.feed_forward.init_weights(self.weight_init_std)


class TitanLlama(nn.Module):
    """torchtitan's ``Transformer`` in miniature: build (on meta, if you like), then
    ``init_weights()`` — torchtitan's order: embeddings, each layer, norm, output."""

    def __init__(self, vocab_size: int = VOCAB, dim: int = DIM, n_layers: int = LAYERS) -> None:
        super().__init__()
        self.vocab_size, self.dim = vocab_size, dim
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(i, dim, HEADS, FFN) for i in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)  # (B, T, dim)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))  # (B, T, vocab)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers:
            layer.init_weights()
        self.norm.reset_parameters()
        std = self.dim**-0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=std, a=-3 * std, b=3 * std)


def torch_sequential(vocab_size: int = VOCAB, dim: int = DIM) -> nn.Sequential:
    """PyTorch's layers only, PyTorch's default init, no ``vocab_size`` attribute (the pipeline
    reads it off the logits)."""
    return nn.Sequential(
        nn.Embedding(vocab_size, dim),
        nn.Linear(dim, dim),
        nn.GELU(),
        nn.LayerNorm(dim),
        nn.Linear(dim, dim),
        nn.GELU(),
        nn.Linear(dim, vocab_size),
    )


FACTORIES = {"titan_llama": TitanLlama, "torch_sequential": torch_sequential}
N_LAYERS = {"titan_llama": LAYERS, "torch_sequential": 7}  # entries of the container split


def reference_init(name: str, seed: int) -> nn.Module:
    """The unsplit model, initialised as a single process would: build, seed, init."""
    model = FACTORIES[name]()
    torch.manual_seed(seed)
    if name == "titan_llama":
        model.init_weights()
    else:  # PyTorch's default init, redone in construction order (what init_stage runs too)
        for module in model:
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model
