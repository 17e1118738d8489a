"""Lab 00 — the four collectives every sharding scheme is made of, run on real ranks."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_counts, check_ranges

OPS = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


# What one host runs (each rank holds a few tensors of `numel` fp32 elements).
RANGES = {"numel": (1, 1 << 26), "repeats": (1, 1_000_000)}


@dataclass(frozen=True)
class CollectivesConfig:
    """Args:
    world_size: number of ranks.
    numel: float32 elements of each rank's shard in the measured runs.
    repeats: measured calls per op (the median time is reported).
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 4
    numel: int = 1 << 18
    repeats: int = 5
    backend: str = "auto"

    def __post_init__(self) -> None:
        check_counts(self, {"numel": 1, "repeats": 1})
        check_ranges(self, RANGES)


CONFIG = CollectivesConfig
