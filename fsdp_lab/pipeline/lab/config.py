"""Lab 05 — pipeline-parallel RNG seeding: four ways to initialise a pipeline's stages.

The config, torch-free so that ``fsdp-lab --help`` stays fast; its fields are the command-line
options (`fsdp_lab.labs.options`), its errors are in Python terms (``stages=5 ... Fix:
stages=4``) and the CLI says them in flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.config_checks import check_counts, check_ranges, is_int

LOSS_RTOL = 1e-5  # "within float rounding": GPipe sums M micro-batch losses in another order

# Below 5 seeds a verdict is too easily undone by the next seed (3 seeds: ±4.3 standard errors,
# and a sample that small can look tight by luck; seen here: +0.015 "shown" at 3 seeds of the
# default pipeline, its interval across 0 at 5): said "inconclusive", with the interval.
MIN_SEEDS = 5

if TYPE_CHECKING:
    from fsdp_lab.pipeline import PipeGPTConfig

OPTIMIZERS = {"sgd": 0.1, "adam": 1e-3}  # name -> default learning rate
# The integer fields and the smallest each allows; what each is, the docstring says.
_SIZES = {"stages": 1, "world_size": 1, "layers": 1, "dim": 1, "heads": 1, "vocab": 2}
_SIZES |= {"seq_len": 1, "steps": 1, "microbatches": 1, "global_batch": 1, "seed": 0}
_SIZES |= {"repeats": 1, "convergence_seeds": 0, "convergence_steps": 1}


# What one host runs in a lab's time (the model is also checked whole against host memory).
RANGES = {
    "layers": (1, 256),
    "dim": (1, 8192),
    "heads": (1, 256),
    "vocab": (2, 1 << 20),
    "seq_len": (2, 1 << 16),
    "steps": (1, 100_000),
    "microbatches": (1, 1024),
    "global_batch": (1, 1 << 16),
    "lr": (1e-8, 10.0),
    "seed": (0, 2**62),
    "repeats": (1, 100),
    "convergence_seeds": (0, 100),
    "convergence_steps": (1, 100_000),
    "grow_dims": (1, 8192),
    "scale_dim": (1, 8192),
}


@dataclass(frozen=True)
class PPSeedConfig:
    """Args:
    stages: S, pipeline stages — by default the world size, or 3 when neither is given.
    world_size: ranks, S x dp pipelines — by default S (one pipeline); S must divide it.
    layers: transformer blocks L of the `PipeGPT`, spread over the stages.
    dim: model width.
    heads: attention heads.
    vocab: vocabulary size.
    seq_len: tokens per sequence.
    steps: training steps of each initialised pipeline and of the single-process baseline.
    microbatches: GPipe micro-batches M per step.
    global_batch: sequences per step, over all pipelines.
    optimizer: "sgd" (momentum 0.9) or "adam".
    lr: the optimizer's learning rate (default 0.1 for sgd, 1e-3 for adam).
    seed: the seed of the unsplit reference init.
    strategies: which of `STRATEGIES` to measure.
    grow_dims: widths at which init time and peak memory are measured again, L kept (none: skip).
    repeats: times each measured init runs (ranks in step before each); the median is kept.
    scale_ranks: rank counts at which the init of `scale_strategies` is timed again, on one
        pipeline of that many stages (a cluster of each size; none: skip).
    scale_dim: the model width of that measurement (default: the largest grow_dims, else dim).
    scale_strategies: the strategies timed there (by default all but same_seed, the bug, whose
        cost is per_stage_seed's without the broadcast).
    convergence_seeds: seeds at which the unsplit init and the same-seed init are each trained on
        a learnable task, single-process, spread over the ranks (0: skip).
    convergence_steps: Adam steps of each of those trainings.
    backend: "auto", "gloo" or "nccl".
    """

    stages: int | None = None
    world_size: int | None = None
    layers: int = 6
    dim: int = 32
    heads: int = 4
    vocab: int = 64
    seq_len: int = 16
    steps: int = 50
    microbatches: int = 2
    global_batch: int = 8
    optimizer: str = field(default="sgd", metadata={"choices": list(OPTIMIZERS)})
    lr: float | None = None
    seed: int = 0
    strategies: tuple[str, ...] = field(default=STRATEGIES, metadata={"metavar": "S"})
    grow_dims: tuple[int, ...] = field(
        default=(64, 128, 256), metadata={"nargs": "*", "metavar": "D"}
    )
    repeats: int = 3
    scale_ranks: tuple[int, ...] = field(default=(), metadata={"nargs": "*", "metavar": "N"})
    scale_dim: int | None = None
    scale_strategies: tuple[str, ...] = field(
        default=tuple(s for s in STRATEGIES if s != "same_seed"), metadata={"metavar": "S"}
    )
    convergence_seeds: int = 0
    convergence_steps: int = 200
    backend: str = "auto"

    def __post_init__(self) -> None:
        # stages, world_size: None means "the other one"; the fix for them is a pipeline of 2
        check_counts(self, _SIZES, fixes={"stages": 2, "world_size": 2})
        check_ranges(self, RANGES)
        self._resolve_layout()
        if self.dim % self.heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by heads={self.heads}: allowed heads are the "
                f"divisors of {self.dim}. Fix: heads=1, or dim={self.heads * 8}"
            )
        per = self.dp * self.microbatches
        if self.global_batch % per:
            raise ValueError(
                f"global_batch={self.global_batch} does not split into dp={self.dp} pipelines "
                f"x microbatches={self.microbatches}: allowed a multiple of {per}. "
                f"Fix: global_batch={per * max(1, round(self.global_batch / per))}"
            )
        lr = self.lr
        if self.optimizer not in OPTIMIZERS or (
            lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0)
        ):
            raise ValueError(
                f"optimizer={self.optimizer!r}, lr={lr!r}: allowed optimizer in "
                f"{list(OPTIMIZERS)} and lr a number > 0 (or None). Fix: optimizer='sgd', lr=0.1"
            )
        strategies, grow = _strategy_list("strategies", self.strategies), tuple(self.grow_dims)
        bad = [d for d in grow if not is_int(d, 1) or d % self.heads]
        if bad:
            widths = tuple(16 * self.heads * k for k in (1, 2, 4))  # 64 128 256 for 4 heads
            raise ValueError(
                f"grow_dims={grow}: width {bad[0]!r} is out of range: allowed ints divisible by "
                f"heads={self.heads} (or none). Fix: grow_dims={widths}"
            )
        object.__setattr__(self, "strategies", strategies)  # frozen: normalised once, here
        object.__setattr__(self, "grow_dims", grow)
        self._check_scaling()

    def _check_scaling(self) -> None:
        """`scale_ranks`: distinct rank counts, each a pipeline of at most L stages; `scale_dim`."""
        counts = tuple(self.scale_ranks)
        bad = [n for n in counts if not is_int(n, 1, self.layers)]
        if bad or len(set(counts)) != len(counts):
            why = f"{bad[0]!r} is out of range" if bad else "a count appears twice"
            fix = tuple(range(1, min(4, self.layers) + 1))
            raise ValueError(
                f"scale_ranks={counts}: {why}: allowed distinct ints in 1..{self.layers} (one "
                f"pipeline stage per rank, at least one layer each), or none. "
                f"Fix: scale_ranks={fix}"
            )
        object.__setattr__(self, "scale_ranks", tuple(sorted(counts)))
        timed = _strategy_list("scale_strategies", self.scale_strategies)
        object.__setattr__(self, "scale_strategies", timed)
        dim = self.scale_dim
        if dim is not None and (not is_int(dim, 1) or dim % self.heads):
            raise ValueError(
                f"scale_dim={dim!r} is out of range: allowed an int divisible by "
                f"heads={self.heads}, or None (the largest grow_dims, else dim). Fix: "
                f"scale_dim={self.dim}"
            )

    @property
    def scale_width(self) -> int:
        """The width at which `scale_ranks` is measured."""
        if self.scale_dim is not None:
            return self.scale_dim
        return max(self.grow_dims) if self.grow_dims else self.dim

    def _resolve_layout(self) -> None:
        """Fill in S and the world size (each defaults to the other), then check them."""
        stages, ws = self.stages, self.world_size
        if stages is None:
            stages = ws if ws is not None else min(3, self.layers)
        ws = stages if ws is None else ws
        if stages > self.layers:
            raise ValueError(
                f"stages={stages} is out of range for layers={self.layers}: allowed "
                f"1..{self.layers} (every stage needs at least one layer). "
                f"Fix: stages={self.layers}, or layers={stages}"
            )
        if ws % stages:
            divisors = [d for d in range(1, min(ws, self.layers) + 1) if ws % d == 0]
            raise ValueError(
                f"stages={stages} does not divide world_size={ws}: allowed stages in "
                f"{divisors} (world_size = stages x dp pipelines). Fix: world_size={stages}, "
                f"or stages={divisors[-1]}"
            )
        object.__setattr__(self, "stages", stages)  # frozen: filled in once, here
        object.__setattr__(self, "world_size", ws)

    @property
    def dp(self) -> int:
        """Pipelines side by side (data-parallel replicas of every stage)."""
        return self.world_size // self.stages

    def gpt(self, dim: int | None = None) -> PipeGPTConfig:
        """The model to split (at width `dim`, for the growth measurement)."""
        from fsdp_lab.pipeline import PipeGPTConfig  # torch: only when the lab runs

        return PipeGPTConfig(self.vocab, dim or self.dim, self.layers, self.heads, self.seq_len)


CONFIG = PPSeedConfig


def _strategy_list(name: str, value: Any) -> tuple[str, ...]:
    """`value` as a tuple of known strategies, each once, at least one; else a ValueError
    naming the field `name`, what is wrong and the fix."""
    strategies = tuple(value)
    unknown = [s for s in strategies if s not in STRATEGIES]
    if not strategies or unknown or len(set(strategies)) != len(strategies):
        why = f"strategy {unknown[0]!r} is unknown" if unknown else "none, or one twice"
        raise ValueError(
            f"{name}={strategies}: {why}: allowed one or more of {list(STRATEGIES)}, "
            f"each once. Fix: {name}={STRATEGIES}"
        )
    return strategies
