"""The names a user picks from: process-group backends, sharding strategies, pipeline seeding.

Kept free of torch on purpose. Lab configs validate against these names and ``fsdp-lab --help``
lists them; importing torch for that took 4-18 s per ``--help``. The mechanisms import their
tables from here, so each name has one home.
"""

from __future__ import annotations

from dataclasses import dataclass

# Process-group backends: "auto" picks NCCL with one GPU per rank, gloo otherwise.
BACKENDS = ("auto", "gloo", "nccl")
# Where the ranks compute: "auto" uses the GPUs there are (one each under NCCL; several ranks
# sharing one over gloo), "cpu" forces the CPU lab on a GPU machine (`fsdp_lab.cluster.where`).
DEVICES = ("auto", "cpu", "cuda")
DEVICE_ENV = "FSDP_LAB_DEVICE"  # a `Cluster`'s default device; `fsdp-lab --device` sets it


@dataclass(frozen=True)
class Strategy:
    """What a sharding strategy keeps sharded and when it frees (`fsdp_lab.sharding.unit`)."""

    name: str  # as `shard(strategy=...)` takes it
    sharded: bool  # parameters split over ranks (False: replicated, DDP)
    reshard_after_forward: bool  # ZeRO-3 frees between forward and backward
    reshard_after_backward: bool  # ZeRO-2/3 free the gathered parameters after backward
    reduce_at_end: bool  # ZeRO-1: full gradients stay until the end of backward
    replicated: bool = False  # HSDP: sharded inside a shard group, all-reduced across replicas


SHARDING_STRATEGIES: dict[str, Strategy] = {
    "none": Strategy(
        "none",
        sharded=False,
        reshard_after_forward=False,
        reshard_after_backward=False,
        reduce_at_end=False,
    ),
    "optimizer": Strategy(
        "optimizer",
        sharded=True,
        reshard_after_forward=False,
        reshard_after_backward=False,
        reduce_at_end=True,
    ),
    "grad_op": Strategy(
        "grad_op",
        sharded=True,
        reshard_after_forward=False,
        reshard_after_backward=True,
        reduce_at_end=False,
    ),
    "full": Strategy(
        "full",
        sharded=True,
        reshard_after_forward=True,
        reshard_after_backward=True,
        reduce_at_end=False,
    ),
}

# Hybrid sharding (HSDP) on a 2-D (replicate x shard) mesh: ZeRO-3 / ZeRO-2 inside each shard
# group (a "node"), the shard's gradient all-reduced across the replicas. Apart from
# SHARDING_STRATEGIES: they need a mesh, and every 1-D comparison iterates over those four.
HYBRID_STRATEGIES: dict[str, Strategy] = {
    "hybrid": Strategy(
        "hybrid",
        sharded=True,
        reshard_after_forward=True,
        reshard_after_backward=True,
        reduce_at_end=False,
        replicated=True,
    ),
    "hybrid_zero2": Strategy(
        "hybrid_zero2",
        sharded=True,
        reshard_after_forward=False,
        reshard_after_backward=True,
        reduce_at_end=False,
        replicated=True,
    ),
}

# A unit's own strategy inside a sharded model (`shard(policies={unit: UnitPolicy(strategy=
# "replicate")})`): whole on every rank, its gradient all-reduced — "none" for one unit.
REPLICATE = Strategy(
    "replicate",
    sharded=False,
    reshard_after_forward=False,
    reshard_after_backward=False,
    reduce_at_end=False,
)

# Every strategy `shard` takes, by name: the 1-D ones and the hybrid ones.
ALL_SHARDING_STRATEGIES: dict[str, Strategy] = {**SHARDING_STRATEGIES, **HYBRID_STRATEGIES}


def strategy_named(name: str) -> Strategy:
    """The strategy `shard(strategy=name)` means; a ValueError listing them if there is none."""
    if name not in ALL_SHARDING_STRATEGIES:
        raise ValueError(f"strategy={name!r} is not one of {list(ALL_SHARDING_STRATEGIES)}")
    return ALL_SHARDING_STRATEGIES[name]


# How the stages of a pipeline are initialised (`fsdp_lab.pipeline.rng` explains each).
SEEDING_STRATEGIES = ("seed_checkpoint", "same_seed", "per_stage_seed", "rng_replay")
