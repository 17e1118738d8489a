"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

Torch-free, for ``fsdp-lab --help``; building a config imports `fsdp_lab.checkpointing.schedules` for the
rule it shares with the executor (`min_budget`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_fields, is_int, knob

# Where a checkpoint can sit relative to a ZeRO-3 unit (measure.sharded_chain_worker).
MODES = ("plain", "unit_wraps_checkpoint", "checkpoint_spans_two_units")


@dataclass(frozen=True)
class CheckpointConfig:
    """The checkpointing lab's options, each with its help and its range on the field: the
    highs are what one host runs in a lab's time (the schedules sweep every layer count, and
    the optimal schedule's table grows with N x budget); every, segment, budget and snapshots
    must also fit the shortest chain."""

    layers: tuple[int, ...] = knob(
        (8, 16, 32), "chain lengths N to measure.", low=1, high=512, metavar="N"
    )
    every: int | None = knob(
        None,
        "C for `every(C)`: C evenly spaced checkpoints, N/C layers apart (default: round(√N)).",
        metavar="C",
    )
    segment: int | None = knob(None, "k for `segments(k)` (default: round(√N)).", metavar="K")
    budget: int | None = knob(
        None,
        "most layer inputs alive for `optimal(budget)`, in this lab's units — a grad-mode forward "
        "doubles as the advance, a tape of m layers holds m inputs; not revolve's (default: what "
        "segments(k) keeps).",
    )
    snapshots: int | None = knob(
        None,
        "s for `revolve(s)`, Griewank–Walther's binomial checkpointing in their units: s stored "
        "states, the chain input included, each layer taped alone (default: budget - 1, so that it "
        "keeps as many layer inputs as optimal(budget)).",
    )
    dim: int = knob(128, "layer width.", low=1, high=8192)
    batch: int = knob(64, "rows of the batch (B).", low=1, high=8192)
    world_size: int = knob(2, "ranks for the with-sharding part (0 skips it).")
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

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
        check_fields(self)
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
