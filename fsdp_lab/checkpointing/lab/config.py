"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

Torch-free, for ``fsdp-lab --help``; building a config imports `fsdp_lab.checkpointing.schedules` for the
rule it shares with the executor (`min_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_lab.config_checks import check_ranges, is_int

# Where a checkpoint can sit relative to a ZeRO-3 unit (measure.sharded_chain_worker).
MODES = ("plain", "unit_wraps_checkpoint", "checkpoint_spans_two_units")
# What one host runs in a lab's time: the schedules sweep every layer count, and the optimal
# schedule's table grows with N x budget.
RANGES = {"layers": (1, 512), "dim": (1, 8192), "batch": (1, 8192)}


@dataclass(frozen=True)
class CheckpointConfig:
    """Args:
    layers: chain lengths N to measure.
    every: C for `every(C)`: C evenly spaced checkpoints, N/C layers apart (default: round(√N)).
    segment: k for `segments(k)` (default: round(√N)).
    budget: most layer inputs alive for `optimal(budget)`, in this lab's units — a grad-mode
        forward doubles as the advance, a tape of m layers holds m inputs; not revolve's
        (default: what segments(k) keeps).
    snapshots: s for `revolve(s)`, Griewank–Walther's binomial checkpointing in their units:
        s stored states, the chain input included, each layer taped alone (default:
        budget - 1, so that it keeps as many layer inputs as optimal(budget)).
    dim: layer width.
    batch: rows of the batch (B).
    world_size: ranks for the with-sharding part (0 skips it).
    backend: "auto", "gloo" or "nccl".
    """

    layers: tuple[int, ...] = field(default=(8, 16, 32), metadata={"metavar": "N"})
    every: int | None = field(default=None, metadata={"metavar": "C"})
    segment: int | None = field(default=None, metadata={"metavar": "K"})
    budget: int | None = None
    snapshots: int | None = None
    dim: int = 128
    batch: int = 64
    world_size: int = 2
    backend: str = "auto"

    def __post_init__(self) -> None:
        from fsdp_lab.checkpointing.schedules import (
            min_budget,
        )  # torch; a config is built to run the lab

        good = tuple(n for n in self.layers if is_int(n))  # chain lengths: ints >= 1
        if not self.layers or len(good) < len(self.layers):
            fix = good or (8, 16, 32)
            raise ValueError(
                f"layers={self.layers!r}: expected chain lengths, ints >= 1. Fix: layers={fix!r}"
            )
        check_ranges(self, RANGES)
        top = min(self.layers)  # every argument must fit the shortest chain
        bounds = (("every", 1), ("segment", 1), ("budget", min_budget(top)), ("snapshots", 1))
        for name, low in bounds:
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and low <= value <= top):
                near = min(max(value, low), top) if isinstance(value, int) else round(top**0.5)
                raise ValueError(
                    f"{name}={value!r} is out of range: allowed {low}..{top} (the shortest chain "
                    f"has N={top} layers). Fix: {name}={max(low, near)}"
                )


CONFIG = CheckpointConfig
