"""`Llama`: the shape of today's large models (RMSNorm, rotary positions, grouped-query
attention, SwiGLU), the models meta-device init exists for; `llama3_config("70b")` is
Llama-3-70B (and "8b", "405b"), to be built on the meta device only, `twin_config` its
scaled-down twin; `lab_llama(mb)` the meta-init lab's model of
a given size and `lab_units` its wrap plan.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.config_checks import is_int


@dataclass(frozen=True)
class LlamaConfig:
    """Args:
    vocab_size: tokens in the vocabulary (rows of the embedding and of the output head).
    dim: model width.
    n_layers: transformer blocks.
    n_heads: query heads (must divide `dim`; head_dim = dim / n_heads must be even for RoPE).
    n_kv_heads: key/value heads, grouped-query attention (must divide `n_heads`).
    ffn_dim: hidden width of the SwiGLU MLP.
    seq_len: longest sequence (rows of the rotary cache).
    tie_embeddings: the output head reuses the embedding matrix (one Parameter).
    rope_theta: base of the rotary frequencies.
    norm_eps: added to the mean square in RMSNorm.
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 96
    seq_len: int = 16
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "dim",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "seq_len",
        ):
            value = getattr(self, name)
            if not is_int(value, 1):
                raise ValueError(f"LlamaConfig.{name}={value!r}: expected an int >= 1")
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings={self.tie_embeddings!r}: expected a bool")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r}: expected a number > 0")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}: "
                "each key/value head serves a whole group of query heads"
            )
        if (self.dim // self.n_heads) % 2:
            raise ValueError(
                f"head_dim = dim / n_heads = {self.dim // self.n_heads} is odd: RoPE rotates "
                "pairs of features, so it must be even"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight: LayerNorm without the mean and the bias."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary(nn.Module):
    """The cos/sin table of rotary position embeddings, a cache derived from the config.

    Non-persistent buffers: not in the state_dict (nothing to load: it follows from the config)
    and, on the meta device, shapes only. Whoever materialises the model must call
    `reset_parameters()` to recompute it — `to_empty` leaves uninitialised memory here.
    """

    def __init__(self, head_dim: int, seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.seq_len, self.theta = head_dim, seq_len, theta
        self.register_buffer("rope_cos", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.register_buffer("rope_sin", torch.empty(seq_len, head_dim // 2), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.rope_cos.is_meta:  # shapes only: nothing to compute
            return
        device = self.rope_cos.device  # filled in place: to_empty made these the real buffers
        inv_freq = self.theta ** -(
            torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        )  # (head_dim/2,)
        angles = torch.outer(
            torch.arange(self.seq_len, dtype=torch.float32, device=device), inv_freq
        )
        self.rope_cos.copy_(angles.cos())  # (seq_len, head_dim/2)
        self.rope_sin.copy_(angles.sin())

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        if seq_len > self.seq_len:
            raise ValueError(
                f"sequence of {seq_len} tokens is longer than the rotary cache ({self.seq_len}): "
                "raise LlamaConfig.seq_len"
            )
        return self.rope_cos[:seq_len], self.rope_sin[:seq_len]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate feature pairs (i, i + d/2) of x (B, H, T, d) by position-dependent angles."""
    x1, x2 = x.chunk(2, dim=-1)  # 2 x (B, H, T, d/2)
    # The cache is fp32 (a buffer: mixed precision casts parameters only); q, k keep their dtype.
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaAttention(nn.Module):
    """Causal attention with RoPE and grouped-query K/V: n_kv_heads < n_heads shrinks wk, wv."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = (
            config.n_heads,
            config.n_kv_heads,
            config.head_dim,
        )
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, d)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        group = self.n_heads // self.n_kv_heads  # query heads sharing one K/V head
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)  # (B, H, T, d)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, T, d)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): Llama's gated MLP."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attention(norm(x)), then x + feed_forward(norm(x)). The wrap unit."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention = LlamaAttention(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = SwiGLU(config.dim, config.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """A Llama-shaped decoder (torchtitan's parameter names), initialised by PyTorch's defaults.

    Every module that owns a parameter or a buffer has `reset_parameters()` (nn.Linear,
    nn.Embedding, RMSNorm, Rotary), so "build on meta, `to_empty`, `reset_parameters()` on each
    module" re-creates a model like an ordinarily built one, rotary cache included.
    """

    def __init__(self, config: LlamaConfig = LlamaConfig()) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.rope = Rotary(config.head_dim, config.seq_len, config.rope_theta)
        self.layers = nn.ModuleList(LlamaBlock(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two owners

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(idx.shape[1])  # 2 x (T, head_dim/2)
        x = self.tok_embeddings(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.output(self.norm(x))  # (B, T, V)


def llama(**overrides: int | float | bool) -> Llama:
    """Factory for ``--model fsdp_lab.models:llama`` (seeded, so every rank builds the same)."""
    torch.manual_seed(0)
    return Llama(LlamaConfig(**overrides))


def tied_llama() -> Llama:
    """Factory for ``--model fsdp_lab.models:tied_llama``: `output.weight is tok_embeddings.weight`
    (a second tied model for the tying lab, with torchtitan's names)."""
    return llama(tie_embeddings=True)


# Meta's published shapes (the Llama 3 paper, Table 3): dim, layers, heads, K/V heads, SwiGLU
# width; every size has vocabulary 128256, RoPE base 500000 and an untied head.
LLAMA3 = {
    "8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405b": dict(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
}


def llama3_config(size: str, **overrides: int | float | bool) -> LlamaConfig:
    """A Llama-3 shape, ``size`` one of `LLAMA3` ("8b", "70b", "405b"): 70b is 80 layers of
    dim 8192, 64 heads, 8 K/V heads, SwiGLU 28672 — 70.55e9 parameters, 282 GB in fp32.

    seq_len is 4096 unless overridden (it only sizes the rotary cache). Build it on meta
    only: ``with torch.device("meta"): Llama(llama3_config("70b"))``.
    """
    if size not in LLAMA3:
        raise ValueError(f"Llama-3 size {size!r}: expected one of {sorted(LLAMA3)}")
    shape = dict(vocab_size=128256, seq_len=4096, rope_theta=500000.0, **LLAMA3[size])
    return LlamaConfig(**{**shape, **overrides})


def llama_70b_config(**overrides: int | float | bool) -> LlamaConfig:
    """`llama3_config("70b")`: the meta-init lab's 70B."""
    return llama3_config("70b", **overrides)


def twin_config(config: LlamaConfig, layers: int = 4) -> LlamaConfig:
    """A scaled-down twin of `config`: the same architecture — heads per K/V head, SwiGLU width
    over model width, tied or not — at dim 64 (8 heads of 8), `layers` blocks, vocabulary 512,
    small enough to train on real ranks here."""
    n_heads, group = 8, config.n_heads // config.n_kv_heads
    return replace(
        config,
        vocab_size=512,
        dim=64,
        n_layers=layers,
        n_heads=n_heads,
        n_kv_heads=max(1, n_heads // group),
        ffn_dim=max(8, round(64 * config.ffn_dim / config.dim / 8) * 8),
        seq_len=min(config.seq_len, 64),
    )


def llama_param_count(config: LlamaConfig) -> int:
    """Parameters of `Llama(config)`, a tied embedding/head counted once (no model needed)."""
    c = config
    kv = c.n_kv_heads * c.head_dim
    per_layer = 2 * c.dim * c.dim + 2 * c.dim * kv + 3 * c.dim * c.ffn_dim + 2 * c.dim
    head = 0 if c.tie_embeddings else c.vocab_size * c.dim
    return c.vocab_size * c.dim + c.n_layers * per_layer + c.dim + head


def llama_config_of_bytes(target_bytes: int, **overrides: int | float | bool) -> LlamaConfig:
    """The deepest Llama whose fp32 parameters fit in `target_bytes` (width fixed, layers vary).

    Default width: dim 1024, 16 heads, 4 K/V heads, SwiGLU 2816, vocabulary 32000, seq_len 512.
    ``llama_config_of_bytes(3 * 2**29)`` (1.5 GiB) gives 29 layers, 392e6 parameters: big
    enough that an ordinary build shows in the process's resident memory, small enough for
    a laptop. Raises ValueError if not even one layer fits.
    """
    base = dict(
        vocab_size=32000, dim=1024, n_layers=1, n_heads=16, n_kv_heads=4, ffn_dim=2816, seq_len=512
    )
    base.update(overrides)
    one = llama_param_count(LlamaConfig(**{**base, "n_layers": 1}))
    two = llama_param_count(LlamaConfig(**{**base, "n_layers": 2}))
    n_layers = (target_bytes // 4 - one) // (two - one) + 1
    if n_layers < 1:
        raise ValueError(
            f"target_bytes={target_bytes:,}: one layer already needs {4 * one:,} bytes in fp32; "
            "raise the target or pass a smaller dim / vocab_size"
        )
    return LlamaConfig(**{**base, "n_layers": int(n_layers)})


# -- the meta-init lab's Llama of a given size ----------------------------------------------

# Widths from wide to narrow; `lab_llama` takes the widest that still gives >= 8 blocks, so a
# model of any size is a deep stack of similar units (the largest unit stays a small share).
_WIDTHS = (
    {"dim": 1024, "n_heads": 16, "n_kv_heads": 4, "ffn_dim": 2816, "vocab_size": 32000},
    {"dim": 512, "n_heads": 8, "n_kv_heads": 2, "ffn_dim": 1408, "vocab_size": 16000},
    {"dim": 256, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 704, "vocab_size": 8000},
    {"dim": 128, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 352, "vocab_size": 4000},
)
MIN_LAYERS = 8


def lab_llama(model_mb: int) -> LlamaConfig:
    """The Llama of about `model_mb` MiB of fp32 parameters the lab builds (untied head).

    ``lab_llama(1024)``: dim 1024, 17 blocks, 257e6 parameters; ``lab_llama(256)``: dim 512,
    17 blocks. Raises ValueError below the narrowest width's single block (about 5 MiB).
    """
    fits = []
    for width in _WIDTHS:
        with contextlib.suppress(ValueError):  # not even one block of this width fits
            fits.append(llama_config_of_bytes(model_mb * 2**20, **width))
    if not fits:
        raise ValueError(f"model_mb={model_mb}: too small for one Llama block; allowed >= 8")
    deep = [c for c in fits if c.n_layers >= MIN_LAYERS]
    return deep[0] if deep else fits[-1]


def lab_units(config: LlamaConfig) -> list:
    """One unit per block, the embedding and the head each their own (one joint unit if tied).

    Left to the root unit, embedding + head would be the largest unit by far; split like this
    the largest unit is the embedding: an eighth of the model at 256 MiB and at 1 GiB.
    """
    ends = [("tok_embeddings", "output")] if config.tie_embeddings else ["tok_embeddings", "output"]
    return [f"layers.{i}" for i in range(config.n_layers)] + ends


def llama_bytes(config: LlamaConfig) -> dict[str, int]:
    """Parameters, their fp32 bytes and the buffer bytes of `Llama(config)` (built on meta)."""
    with torch.device("meta"):
        model = Llama(config)
    params = sum(p.numel() for p in model.parameters())
    return {
        "parameters": params,
        "parameter_bytes": 4 * params,
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
    }
