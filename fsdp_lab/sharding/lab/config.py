"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

The lab's config: its fields are the command-line options (`fsdp_lab.labs.options`). Torch-free,
so that ``fsdp-lab --help`` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_lab.choices import SHARDING_STRATEGIES
from fsdp_lab.config_checks import check_fields, knob

DEFAULT_MODEL = "fsdp_lab.models:tiny_gpt"


def check_batch_divides(global_batch: int, world_size: int) -> None:
    """Every rank takes an equal slice of the global batch: raise if `world_size` cannot."""
    if global_batch % world_size:
        fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise ValueError(
            f"global_batch={global_batch} does not divide over world_size={world_size} ranks: "
            f"allowed world sizes {fits}. Fix: world_size={max(n for n in fits if n <= world_size)}"
        )


def lr_knob() -> Any:
    """The learning rate of the labs that train TinyGPT's way (a rate past 10 only diverges)."""
    return knob(1e-3, "learning rate.", low=1e-08, high=10.0)


def global_batch_knob() -> Any:
    """The global batch of the labs that train TinyGPT's way, split evenly over the ranks."""
    return knob(
        12, "sequences per step over all ranks (must divide by world_size).", low=1, high=4096
    )


@dataclass(frozen=True)
class ShardConfig:
    """The shard lab's options. Each field's help and allowed values are on the field
    (`knob`): its ``--help`` line and its range, the highs being what one host runs in a lab's
    time (a learning rate past 10 only diverges)."""

    world_size: int = knob(2, "ranks.", low=1)
    strategy: str = knob(
        "full",
        '"none" (DDP), "optimizer" (ZeRO-1), "grad_op" (ZeRO-2), "full" (ZeRO-3).',
        choices=list(SHARDING_STRATEGIES),
    )
    steps: int = knob(5, "training steps.", low=1, high=100_000)
    prefetch: bool = knob(
        True, "overlap the next unit's all-gather with the current unit's compute (on by default)."
    )
    model: str = knob(
        DEFAULT_MODEL,
        '"module:factory" returning a token model (default: TinyGPT with a tied head).',
    )
    optimizer: str = knob(
        "adam",
        '"adam" (16 B/param of model state, `fsdp_lab.theory`) or "sgd" (momentum).',
        choices=["adam", "sgd"],
    )
    lr: float = lr_knob()
    global_batch: int = global_batch_knob()
    compare_fsdp2: bool = knob(
        True,
        "also train PyTorch's fully_shard on the same model and data (and, beside the sharded "
        "optimizer, PyTorch's DDP + ZeroRedundancyOptimizer); on by default.",
        flag="--no-fsdp2",
    )
    sharded_optimizer: bool = knob(
        True,
        'with strategy="optimizer", also train ZeRO-1 as an optimizer — DDP '
        '(``shard(strategy="none")``) + `fsdp_lab.ShardedOptimizer` — and measure it beside; on by '
        "default.",
    )
    free_root: bool = knob(
        False,
        'with strategy="full", free the root unit after forward too and gather it again for '
        "backward (off by default: FSDP2 and FSDP1 keep the root gathered, since its backward "
        "comes right next; the notebook measures both).",
    )
    replicate_root: bool = knob(
        False,
        "keep the root unit (what no block holds: the embedding, the final norm, a tied head) "
        "whole on every rank, its gradient all-reduced — a per-unit policy "
        '(`UnitPolicy(strategy="replicate")`); the bytes then follow each unit\'s own strategy.',
    )
    offload: bool = knob(
        False,
        "keep every unit's shard, gradient and optimizer state in host memory; the parameters "
        "visit the compute device for each gather, and the ledger counts those copies "
        "(host_to_device, device_to_host). On a CPU-only machine host and device are one memory: "
        "the copies are real and counted, the memory they would save is not.",
    )
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

    def __post_init__(self) -> None:
        check_fields(self)
        if self.free_root and self.strategy != "full":
            raise ValueError(
                f"free_root=True with strategy={self.strategy!r}: only ZeRO-3 frees units after "
                "forward. Fix: strategy='full', or free_root=False"
            )
        if self.replicate_root and (self.strategy == "none" or self.free_root):
            raise ValueError(
                f"replicate_root=True with strategy={self.strategy!r}"
                + (" and free_root=True" if self.free_root else "")
                + ": a replicated root is kept whole, never freed, and under 'none' every unit "
                "already is. Fix: strategy='full' (or 'grad_op', 'optimizer') without free_root"
            )
        if ":" not in self.model:
            raise ValueError(
                f"model={self.model!r}: expected 'module:factory'. Fix: model={DEFAULT_MODEL!r}"
            )
        # Checked here, before any rank starts, and again on the ranks (torchrun's world wins).
        if isinstance(self.world_size, int) and self.world_size >= 1:
            check_batch_divides(self.global_batch, self.world_size)


CONFIG = ShardConfig
