"""Lab 04 — meta-device init: build any size without memory, materialise only each rank's shard.

The config (its fields are the options, `fsdp_lab.labs.options`) and the names of what the lab
compares. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_lab.config_checks import is_int

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
    """Args:
    world_size: ranks.
    model_mb: MiB of fp32 parameters of the host-memory picture's Llama; every rank builds it
        whole once, the ordinary way, so it needs about (world_size + 1) x model_mb of memory.
    sizes_mb: model sizes (MiB) of the sync-vs-deterministic table.
    seed: the init seed (`DeterministicInit(seed)`, ``torch.manual_seed(seed)`` on rank 0).
    measure_70b: build Llama-3-70B's shape on meta in a fresh process and measure it
        (``--no-70b``: skip it).
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    model_mb: int = 1024
    sizes_mb: tuple[int, ...] = (16, 64, 256)
    seed: int = 0
    measure_70b: bool = field(default=True, metadata={"flag": "--no-70b"})
    backend: str = "auto"

    def __post_init__(self) -> None:
        low, high = MODEL_MB
        sizes = self.sizes_mb
        checks = (  # (field, whether its value is allowed, what is, a value that is)
            ("world_size", is_int(self.world_size, 1), "an int >= 1", 2),
            ("model_mb", is_int(self.model_mb, low, high),
             f"an int in {low}..{high} (MiB of fp32 parameters)", 256),
            ("sizes_mb", isinstance(sizes, tuple) and bool(sizes)
             and all(is_int(s, low, high) for s in sizes),
             f"a non-empty tuple of ints in {low}..{high} (MiB)", (16, 64, 256)),
            ("seed", is_int(self.seed, 0, 2**62 - 1), "an int in 0..2**62-1", 0),
        )  # fmt: skip
        for name, ok, allowed, fix in checks:
            if not ok:
                value = f"{name}={getattr(self, name)!r}"
                raise ValueError(f"{value} is out of range: allowed {allowed}. Fix: {name}={fix!r}")


CONFIG = MetaInitConfig
