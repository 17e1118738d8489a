"""Lab 00 — the four collectives every sharding scheme is made of, run on real ranks."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_fields, knob

OPS = ("broadcast", "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


@dataclass(frozen=True)
class CollectivesConfig:
    """The collectives lab's options, each with its help and its range on the field; the
    highs are what one host runs (each rank holds a few tensors of `numel` fp32 elements)."""

    world_size: int = knob(4, "number of ranks.", low=1)
    numel: int = knob(
        1 << 18,
        "float32 elements of each rank's shard in the measured runs.",
        low=1,
        high=1 << 26,
    )
    repeats: int = knob(
        5, "measured calls per op (the median time is reported).", low=1, high=1_000_000
    )
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

    def __post_init__(self) -> None:
        check_fields(self)


CONFIG = CollectivesConfig
