"""Lab 03 — weight tying under wrap policies: one matrix, two modules, one wrap unit.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.tying` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fsdp_lab.model_spec import load_factory

LAB_MODEL = "fsdp_lab.models:tiny_gpt"
_SIZES = {  # config field -> (CLI flag, what it is)
    "vocab": ("--vocab", "rows of the tied embedding/head matrix"),
    "dim": ("--dim", "model width"),
    "layers": ("--layers", "transformer blocks"),
    "heads": ("--heads", "attention heads"),
    "seq_len": ("--seq-len", "tokens per sequence"),
    "batch": ("--batch", "sequences per rank"),
    "steps": ("--steps", "optimizer steps of the verification"),
    "spike_steps": ("--spike-steps", "training steps measured for the spike"),
}


@dataclass(frozen=True)
class TyingConfig:
    """Args:
    world_size: ranks.
    steps: SGD steps before the tie is verified again (and compared with one process).
    lr: SGD learning rate (momentum 0.9).
    model: "module:factory" of a model with a tie: its ties are reported, and the verification
        and the audit shard and train it (default TinyGPT; the spike stays on TinyGPT).
    vocab, dim, layers, heads, seq_len: the spike's TinyGPT (a large tied vocabulary).
    batch: sequences per rank in the spike.
    spike_steps: training steps under the memory tracker (figures from the last one).
    compare_fsdp2: also measure the spike with PyTorch's `fully_shard`.
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    steps: int = 5
    lr: float = 0.1
    model: str | None = None
    vocab: int = 32768
    dim: int = 256
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    batch: int = 2
    spike_steps: int = 2
    compare_fsdp2: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        ws = self.world_size
        if isinstance(ws, bool) or not isinstance(ws, int) or ws < 1:
            raise ValueError(
                f"world_size={ws!r} is out of range: allowed >= 1. Fix: --world-size 2"
            )
        for name, (flag, what) in _SIZES.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}={value!r} is out of range: allowed an int >= 1 ({what}). "
                    f"Fix: {flag} {getattr(TyingConfig, name)}"
                )
        if self.dim % self.heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by heads={self.heads}: each head gets dim/heads "
                f"channels. Fix: --dim {self.heads * max(1, round(self.dim / self.heads))} or "
                f"--heads 1"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(
                f"lr={self.lr!r} is out of range: allowed a number > 0. Fix: lr=0.1 (the default)"
            )
        if self.model is not None and ":" not in self.model:
            raise ValueError(
                f"model={self.model!r}: expected 'module:factory'. Fix: e.g. --model {LAB_MODEL}"
            )
        if self.model is not None:
            load_factory(self.model)  # a clear ValueError now, not a traceback from run()

    def gpt(self) -> dict[str, int]:
        """`tiny_gpt` arguments of the spike's model."""
        return {
            "vocab_size": self.vocab,
            "dim": self.dim,
            "n_layers": self.layers,
            "n_heads": self.heads,
            "seq_len": self.seq_len,
        }


def add_arguments(parser: Any) -> None:
    for name, (flag, what) in _SIZES.items():
        parser.add_argument(flag, dest=name, type=int, default=None, help=what)
    parser.add_argument("--no-fsdp2", dest="compare_fsdp2", action="store_false", default=None)


def config_from_args(args: Any) -> dict[str, Any]:
    keys = (*_SIZES, "compare_fsdp2")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
