"""Lab 03 — weight tying under wrap policies: one matrix, two modules, one wrap unit.

Its config, whose fields are the command-line options (`fsdp_lab.labs.options`); torch-free,
so that ``fsdp-lab --help`` stays fast.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

from fsdp_lab.config_checks import check_counts, check_ranges
from fsdp_lab.model_spec import load_factory

LAB_MODEL = "fsdp_lab.models:tiny_gpt"
WRAPPINGS = ("root_unit", "joint_unit")  # the two valid plans: trained, verified, measured
SPIKE_SYSTEMS = ("fsdp_lab", "fsdp2")  # who shards the model in the spike
SYSTEM_NAMES = {"fsdp_lab": "fsdp_lab shard", "fsdp2": "FSDP2 fully_shard"}  # as reports say it


# What one host runs (the spike's TinyGPT is also checked whole against host memory).
RANGES = {
    "steps": (1, 100_000),
    "spike_steps": (1, 100_000),
    "lr": (1e-8, 10.0),
    "vocab": (2, 1 << 20),
    "dim": (1, 16384),
    "layers": (1, 256),
    "heads": (1, 256),
    "seq_len": (2, 1 << 16),
    "batch": (1, 4096),
}


@dataclass(frozen=True)
class TyingConfig:
    """Args:
    world_size: ranks.
    steps: SGD steps of the verification, after which the tie is checked again.
    lr: SGD learning rate (momentum 0.9).
    model: "module:factory" of a model with a tie: its ties are reported, and the verification
        and the audit shard and train it at its own sizes (default: the TinyGPT below; the
        plans, to_empty and the spike stay on it). The result's `sections` says which ran where.
    vocab: rows of the tied embedding/head matrix (TinyGPT, every section).
    dim: model width (TinyGPT, every section).
    layers: transformer blocks (TinyGPT, every section).
    heads: attention heads (TinyGPT, every section).
    seq_len: tokens per sequence (TinyGPT, every section that trains it).
    batch: sequences per rank (TinyGPT, every section that trains it).
    spike_steps: training steps measured for the spike (figures from the last one).
    compare_fsdp2: measure the spike with PyTorch's `fully_shard` too (``--no-fsdp2``: ours only).
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    steps: int = 2
    lr: float = 0.1
    model: str | None = None
    vocab: int = 32768
    dim: int = 256
    layers: int = 4
    heads: int = 4
    seq_len: int = 64
    batch: int = 2
    spike_steps: int = 2
    compare_fsdp2: bool = field(default=True, metadata={"flag": "--no-fsdp2"})
    backend: str = "auto"

    def __post_init__(self) -> None:
        # Every int of this config is a count: one check, its help says what is counted.
        check_counts(self, {f.name: 1 for f in fields(self) if f.type == "int"})
        check_ranges(self, RANGES)
        if self.dim % self.heads:
            fits = self.heads * max(1, round(self.dim / self.heads))
            raise ValueError(
                f"dim={self.dim} is not divisible by heads={self.heads}: each head gets "
                f"dim/heads channels. Fix: dim={fits} or heads=1"
            )
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr={self.lr!r} is out of range: allowed a number > 0. Fix: lr=0.1")
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


CONFIG = TyingConfig
