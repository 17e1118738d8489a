"""Lab 03 — weight tying under wrap policies: one matrix, two modules, one wrap unit.

Its config, whose fields are the command-line options (`fsdp_lab.labs.options`); torch-free,
so that ``fsdp-lab --help`` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_fields, knob
from fsdp_lab.model_spec import load_factory

LAB_MODEL = "fsdp_lab.models:tiny_gpt"
WRAPPINGS = ("root_unit", "joint_unit")  # the two valid plans: trained, verified, measured
SPIKE_SYSTEMS = ("fsdp_lab", "fsdp2")  # who shards the model in the spike
SYSTEM_NAMES = {"fsdp_lab": "fsdp_lab shard", "fsdp2": "FSDP2 fully_shard"}  # as reports say it


@dataclass(frozen=True)
class TyingConfig:
    """The tying lab's options, each with its help and its range on the field: every int
    is a count; the highs are what one host runs (the spike's TinyGPT is also checked whole
    against host memory)."""

    world_size: int = knob(2, "ranks.", low=1)
    steps: int = knob(
        2,
        "SGD steps of the verification, after which the tie is checked again.",
        low=1,
        high=100_000,
    )
    lr: float = knob(0.1, "SGD learning rate (momentum 0.9).", low=1e-08, high=10.0)
    model: str | None = knob(
        None,
        '"module:factory" of a model with a tie: its ties are reported, and the verification and '
        "the audit shard and train it at its own sizes (default: the TinyGPT below; the plans, "
        "to_empty and the spike stay on it). The result's `sections` says which ran where.",
    )
    vocab: int = knob(
        32768,
        "rows of the tied embedding/head matrix (TinyGPT, every section).",
        low=2,
        high=1_048_576,
    )
    dim: int = knob(256, "model width (TinyGPT, every section).", low=1, high=16_384)
    layers: int = knob(4, "transformer blocks (TinyGPT, every section).", low=1, high=256)
    heads: int = knob(4, "attention heads (TinyGPT, every section).", low=1, high=256)
    seq_len: int = knob(
        64, "tokens per sequence (TinyGPT, every section that trains it).", low=2, high=65_536
    )
    batch: int = knob(
        2, "sequences per rank (TinyGPT, every section that trains it).", low=1, high=4096
    )
    spike_steps: int = knob(
        2, "training steps measured for the spike (figures from the last one).", low=1, high=100_000
    )
    compare_fsdp2: bool = knob(
        True,
        "measure the spike with PyTorch's `fully_shard` too.",
        flag="--no-fsdp2",
    )
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

    def __post_init__(self) -> None:
        check_fields(self)
        if self.dim % self.heads:
            fits = self.heads * max(1, round(self.dim / self.heads))
            raise ValueError(
                f"dim={self.dim} is not divisible by heads={self.heads}: each head gets "
                f"dim/heads channels. Fix: dim={fits} or heads=1"
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


CONFIG = TyingConfig
