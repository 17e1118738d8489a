"""Lab 00 — the four collectives every sharding scheme is made of, run on real ranks.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.collectives` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
        for name in ("numel", "repeats"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1")


def add_arguments(parser: Any) -> None:
    parser.add_argument("--numel", type=int, default=None, help="float32 elements per shard")
    parser.add_argument("--repeats", type=int, default=None, help="measured calls per op")


def config_from_args(args: Any) -> dict[str, Any]:
    return {k: getattr(args, k) for k in ("numel", "repeats") if getattr(args, k, None) is not None}
