"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

The lab's config: its fields are the command-line options (`fsdp_lab.labs.options`). Torch-free,
so that ``fsdp-lab --help`` answers at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from fsdp_lab.choices import SHARDING_STRATEGIES
from fsdp_lab.config_checks import check_counts, check_ranges

DEFAULT_MODEL = "fsdp_lab.models:tiny_gpt"


def check_batch_divides(global_batch: int, world_size: int) -> None:
    """Every rank takes an equal slice of the global batch: raise if `world_size` cannot."""
    if global_batch % world_size:
        fits = [n for n in range(1, global_batch + 1) if global_batch % n == 0]
        raise ValueError(
            f"global_batch={global_batch} does not divide over world_size={world_size} ranks: "
            f"allowed world sizes {fits}. Fix: world_size={max(n for n in fits if n <= world_size)}"
        )


# What one host runs in a lab's time (a learning rate past 10 only diverges).
RANGES = {"steps": (1, 100_000), "global_batch": (1, 4096), "lr": (1e-8, 10.0)}


@dataclass(frozen=True)
class ShardConfig:
    """Args:
    world_size: ranks.
    strategy: "none" (DDP), "optimizer" (ZeRO-1), "grad_op" (ZeRO-2), "full" (ZeRO-3).
    steps: training steps.
    prefetch: overlap the next unit's all-gather with the current unit's compute (on by
        default).
    model: "module:factory" returning a token model (default: TinyGPT with a tied head).
    optimizer: "adam" (16 B/param of model state, `fsdp_lab.theory`) or "sgd" (momentum).
    lr: learning rate.
    global_batch: sequences per step over all ranks (must divide by world_size).
    compare_fsdp2: also train PyTorch's fully_shard on the same model and data (and, beside
        the sharded optimizer, PyTorch's DDP + ZeroRedundancyOptimizer); on by default.
    sharded_optimizer: with strategy="optimizer", also train ZeRO-1 as an optimizer — DDP
        (``shard(strategy="none")``) + `fsdp_lab.ShardedOptimizer` — and measure it beside;
        on by default.
    free_root: with strategy="full", free the root unit after forward too and gather it again
        for backward (off by default: FSDP2 and FSDP1 keep the root gathered, since its
        backward comes right next; the notebook measures both).
    replicate_root: keep the root unit (what no block holds: the embedding, the final norm, a
        tied head) whole on every rank, its gradient all-reduced — a per-unit policy
        (`UnitPolicy(strategy="replicate")`); the bytes then follow each unit's own strategy.
    offload: keep every unit's shard, gradient and optimizer state in host memory; the
        parameters visit the compute device for each gather, and the ledger counts those copies
        (host_to_device, device_to_host). On a CPU-only machine host and device are one memory:
        the copies are real and counted, the memory they would save is not.
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    strategy: str = field(default="full", metadata={"choices": sorted(SHARDING_STRATEGIES)})
    steps: int = 5
    prefetch: bool = True
    model: str = DEFAULT_MODEL
    optimizer: str = field(default="adam", metadata={"choices": ["adam", "sgd"]})
    lr: float = 1e-3
    global_batch: int = 12
    compare_fsdp2: bool = field(default=True, metadata={"flag": "--no-fsdp2"})
    sharded_optimizer: bool = True
    free_root: bool = False
    replicate_root: bool = False
    offload: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if "choices" in f.metadata and value not in f.metadata["choices"]:
                raise ValueError(
                    f"{f.name}={value!r}: expected one of {f.metadata['choices']}. "
                    f"Fix: {f.name}={f.default!r}"
                )
        check_counts(self, {"steps": 1, "global_batch": 1})
        check_ranges(self, RANGES)
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
