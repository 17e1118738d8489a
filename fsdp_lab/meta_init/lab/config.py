"""Lab 04 — meta-device init: build any size without memory, materialise only each rank's shard.

The config (its fields are the options, `fsdp_lab.labs.options`) and the names of what the lab
compares. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_fields, knob

MODEL_MB = (8, 16384)  # allowed model sizes, MiB of fp32 parameters
MiB = 2**20

# `fsdp-lab tour` runs this lab smaller: the ordinary build needs (world_size + 1) x model_mb.
TOUR = {"model_mb": 256, "sizes_mb": (16, 64)}

MODES = {  # how the host-memory picture builds and shards the model
    "ordinary": "ordinary build, then shard",
    "meta_param_init_fn": "meta build, shard: module by module (param_init_fn)",
    "meta_shard_init": "meta build, shard(shard_init=DeterministicInit)",
}
APPROACHES = {  # how the ranks come to agree on the values
    "sync_module_states": "rank 0 initialises each unit, broadcasts it",
    "deterministic": "each rank computes its slice (DeterministicInit)",
}
CONTROL = "unsynced"  # ordinary init, every rank its own seed, no broadcast: must disagree
PARENT_INIT = {  # how a model whose init lives on its root (TinyGPT.init_weights) is sharded
    "param_init_fn": "shard: every module's reset_parameters(), children first, root last",
    "owners_only": "the recipe: reset_parameters() on each module that owns a parameter",
    "torchtitan": "shard(param_init_fn='empty'), then init_weights() under full_init",
}
RECIPE = "owners_only"  # the course-note recipe the lab puts to the test


@dataclass(frozen=True)
class MetaInitConfig:
    """The meta-init lab's options, each with its help and its range on the field."""

    world_size: int = knob(2, "ranks.", low=1)
    model_mb: int = knob(
        1024,
        "MiB of fp32 parameters of the host-memory picture's Llama; every rank builds it whole "
        "once, the ordinary way, so it needs about (world_size + 1) x model_mb of memory.",
        low=MODEL_MB[0],
        high=MODEL_MB[1],
        fix=256,
    )
    sizes_mb: tuple[int, ...] = knob(
        (16, 64, 256),
        "model sizes (MiB) of the sync-vs-deterministic table, one or more.",
        low=MODEL_MB[0],
        high=MODEL_MB[1],
    )
    seed: int = knob(
        0,
        "the init seed (`DeterministicInit(seed)`, ``torch.manual_seed(seed)`` on rank 0).",
        low=0,
        high=2**62 - 1,
    )
    measure_70b: bool = knob(
        True,
        "build Llama-3-70B's shape on meta in a fresh process and measure it.",
        flag="--no-70b",
    )
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

    def __post_init__(self) -> None:
        if not (isinstance(self.sizes_mb, tuple) and self.sizes_mb):
            raise ValueError(
                f"sizes_mb={self.sizes_mb!r} is out of range: allowed a non-empty tuple of MiB. "
                "Fix: sizes_mb=(16, 64, 256)"
            )
        check_fields(self)


CONFIG = MetaInitConfig
