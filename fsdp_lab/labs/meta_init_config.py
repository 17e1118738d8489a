"""Lab 04 — meta-device init: build any size without memory, materialise only each rank's shard.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.meta_init` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODEL_MB = (8, 16384)  # allowed model sizes, MiB of fp32 parameters


# `fsdp-lab tour` runs this lab smaller: the 1 GiB default needs ~3 GiB of host memory on 2 ranks.
TOUR = {"model_mb": 256, "sizes_mb": (16, 64)}


@dataclass(frozen=True)
class MetaInitConfig:
    """Args:
    world_size: ranks.
    model_mb: MiB of fp32 parameters of the host-memory picture's Llama (every rank builds it
        whole once, the ordinary way: it needs about (world_size + 1) x model_mb of memory).
    sizes_mb: model sizes of the sync-vs-deterministic table.
    seed: the init seed (`DeterministicInit(seed)`, ``torch.manual_seed(seed)`` on rank 0).
    measure_70b: build Llama-3-70B's shape on meta in a fresh process and measure it.
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    model_mb: int = 1024
    sizes_mb: tuple[int, ...] = (16, 64, 256)
    seed: int = 0
    measure_70b: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        low, high = MODEL_MB
        sizes = self.sizes_mb
        checks = (  # (name, value, ok, allowed, fix)
            ("world_size", self.world_size, _int_in(self.world_size, 1, None), "an int >= 1",
             "--world-size 2"),
            ("model_mb", self.model_mb, _int_in(self.model_mb, low, high),
             f"an int in {low}..{high} (MiB of fp32 parameters)", "--model-mb 256"),
            ("sizes_mb", sizes, isinstance(sizes, tuple) and bool(sizes)
             and all(_int_in(s, low, high) for s in sizes),
             f"a non-empty tuple of ints in {low}..{high} (MiB)", "--sizes-mb 16 64 256"),
            ("seed", self.seed, _int_in(self.seed, 0, 2**62 - 1), "an int in 0..2**62-1",
             "--seed 0"),
        )  # fmt: skip
        for name, value, ok, allowed, fix in checks:
            if not ok:
                raise ValueError(f"{name}={value!r} is out of range: allowed {allowed}. Fix: {fix}")


def _int_in(value: Any, low: int, high: int | None) -> bool:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    return ok and (high is None or value <= high)


def add_arguments(parser: Any) -> None:
    parser.add_argument("--model-mb", dest="model_mb", type=int, default=None,
                        help="MiB of the host-memory picture's model (default 1024)")  # fmt: skip
    parser.add_argument("--sizes-mb", dest="sizes_mb", type=int, nargs="+", default=None,
                        help="model sizes (MiB) of the sync-vs-deterministic table")  # fmt: skip
    parser.add_argument("--seed", type=int, default=None, help="init seed")
    parser.add_argument("--no-70b", dest="measure_70b", action="store_false", default=None,
                        help="skip building Llama-3-70B on meta in a fresh process")  # fmt: skip


def config_from_args(args: Any) -> dict[str, Any]:
    out = {
        k: getattr(args, k)
        for k in ("model_mb", "seed", "measure_70b")
        if getattr(args, k, None) is not None
    }
    if getattr(args, "sizes_mb", None) is not None:  # the tour's parser has no --sizes-mb
        out["sizes_mb"] = tuple(args.sizes_mb)
    return out
