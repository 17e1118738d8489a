"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.checkpoint` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class CheckpointConfig:
    """Args:
    layers: chain lengths N to measure.
    every: C for `every(C)` (default: round(√N)).
    segment: k for `segments(k)` (default: round(√N)).
    budget: stored layer inputs for `optimal(budget)` (default: what segments(k) keeps).
    dim, batch: layer width and batch rows.
    world_size: ranks for the with-sharding part (0 skips it).
    backend: "auto", "gloo" or "nccl".
    """

    layers: tuple[int, ...] = (8, 16, 32)
    every: int | None = None
    segment: int | None = None
    budget: int | None = None
    dim: int = 128
    batch: int = 64
    world_size: int = 2
    backend: str = "auto"

    def __post_init__(self) -> None:
        # schedules imports torch; a config is built only when a lab is about to run anyway.
        from fsdp_lab import schedules

        if not self.layers or any(
            isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in self.layers
        ):
            raise ValueError(f"layers={self.layers!r}: expected chain lengths, ints >= 1")
        for name in ("every", "segment", "budget"):
            value = getattr(self, name)
            top = min(self.layers)
            low = schedules.min_budget(top) if name == "budget" else 1
            if value is not None and not (isinstance(value, int) and low <= value <= top):
                raise ValueError(
                    f"{name}={value!r} is out of range: allowed {low}..{top} (the shortest chain "
                    f"has N={top} layers)"
                )


def add_arguments(parser: Any) -> None:
    parser.add_argument("--layers", type=int, nargs="+", default=None, help="chain lengths N")
    parser.add_argument("--every", type=int, default=None, help="C for every(C)")
    parser.add_argument("--segment", type=int, default=None, help="k for segments(k)")
    parser.add_argument("--budget", type=int, default=None, help="stored inputs for optimal()")


def config_from_args(args: Any) -> dict[str, Any]:
    out = {
        k: getattr(args, k)
        for k in ("every", "segment", "budget")
        if getattr(args, k, None) is not None
    }
    if getattr(args, "layers", None) is not None:  # the tour's parser has no --layers
        out["layers"] = tuple(args.layers)
    return out
