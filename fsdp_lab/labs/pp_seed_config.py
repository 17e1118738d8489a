"""Lab 05 — pipeline-parallel RNG seeding: four ways to initialise a pipeline's stages.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.pp_seed` runs it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES

if TYPE_CHECKING:
    from fsdp_lab.pipeline import PipeGPTConfig

OPTIMIZERS = {"sgd": 0.1, "adam": 1e-3}  # name -> default learning rate
_SIZES = {  # config field -> (CLI flag, what it is, smallest allowed)
    "layers": ("--layers", "transformer blocks L, spread over the stages", 1),
    "dim": ("--dim", "model width", 1),
    "heads": ("--heads", "attention heads", 1),
    "vocab": ("--vocab", "vocabulary size", 2),
    "seq_len": ("--seq-len", "tokens per sequence", 1),
    "steps": ("--steps", "training steps of each pipeline and of the baseline", 1),
    "microbatches": ("--microbatches", "GPipe micro-batches M per step", 1),
    "global_batch": ("--global-batch", "sequences per step, over all pipelines", 1),
    "seed": ("--seed", "seed of the unsplit reference init", 0),
}


def _bad_int(value: Any, low: int) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < low


@dataclass(frozen=True)
class PPSeedConfig:
    """Args:
    stages: S, pipeline stages (default: the world size; 3 when neither is given).
    world_size: ranks = S x dp pipelines (default: S, one pipeline); S must divide it.
    layers, dim, heads, vocab, seq_len: the `PipeGPT` split into stages.
    steps: training steps of each initialised pipeline and of the single-process baseline.
    microbatches, global_batch: GPipe's M, and the sequences per step over all pipelines.
    optimizer: "sgd" (momentum 0.9) or "adam"; lr: its learning rate (default 0.1 / 1e-3).
    seed: the seed of the unsplit reference init.
    strategies: which of `STRATEGIES` to measure.
    grow_dims: widths at which init time and peak memory are measured again (L kept).
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
    optimizer: str = "sgd"
    lr: float | None = None
    seed: int = 0
    strategies: tuple[str, ...] = STRATEGIES
    grow_dims: tuple[int, ...] = (64, 128, 256)
    backend: str = "auto"

    def __post_init__(self) -> None:
        for name, (flag, what, low) in _SIZES.items():
            value = getattr(self, name)
            if _bad_int(value, low):
                default = next(f.default for f in fields(self) if f.name == name)
                raise ValueError(
                    f"{name}={value!r} is out of range: allowed an int >= {low} ({what}). "
                    f"Fix: {flag} {default}"
                )
        self._resolve_layout()
        if self.dim % self.heads:
            raise ValueError(
                f"dim={self.dim} is not divisible by heads={self.heads}: allowed heads are the "
                f"divisors of {self.dim}. Fix: --heads 1, or --dim {self.heads * 8}"
            )
        per = self.dp * self.microbatches
        if self.global_batch % per:
            raise ValueError(
                f"global_batch={self.global_batch} does not split into dp={self.dp} pipelines "
                f"x microbatches={self.microbatches}: allowed a multiple of {per}. "
                f"Fix: --global-batch {per * max(1, round(self.global_batch / per))}"
            )
        lr = self.lr
        if self.optimizer not in OPTIMIZERS or (
            lr is not None and not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0)
        ):
            raise ValueError(
                f"optimizer={self.optimizer!r}, lr={lr!r}: allowed optimizer in "
                f"{list(OPTIMIZERS)} and lr a number > 0 (or None). Fix: --optimizer sgd --lr 0.1"
            )
        strategies, grow = tuple(self.strategies), tuple(self.grow_dims)
        unknown = [s for s in strategies if s not in STRATEGIES]
        if not strategies or unknown or len(set(strategies)) != len(strategies):
            what = f"strategy {unknown[0]!r} is unknown" if unknown else f"{list(strategies)}"
            raise ValueError(
                f"strategies: {what}: allowed one or more of {list(STRATEGIES)}, each once. "
                f"Fix: --strategies {' '.join(STRATEGIES)}"
            )
        bad = [d for d in grow if _bad_int(d, 1) or d % self.heads]
        if bad:
            raise ValueError(
                f"grow_dims: dim={bad[0]!r} is out of range: allowed ints divisible by "
                f"heads={self.heads} (or none). Fix: --grow-dims 64 128 256"
            )
        object.__setattr__(self, "strategies", strategies)
        object.__setattr__(self, "grow_dims", grow)

    def _resolve_layout(self) -> None:
        """Fill in S and the world size (each defaults to the other), then check them."""
        stages, ws = self.stages, self.world_size
        for name, value in (("stages", stages), ("world_size", ws)):
            if value is not None and _bad_int(value, 1):
                flag = name.replace("_", "-")
                raise ValueError(
                    f"{name}={value!r} is out of range: allowed an int >= 1. Fix: --{flag} 2"
                )
        if stages is None:
            stages = ws if ws is not None else min(3, self.layers)
        ws = stages if ws is None else ws
        if stages > self.layers:
            raise ValueError(
                f"stages={stages} is out of range for layers={self.layers}: allowed "
                f"1..{self.layers} (every stage needs at least one layer). "
                f"Fix: --stages {self.layers}, or --layers {stages}"
            )
        if ws % stages:
            divisors = [d for d in range(1, min(ws, self.layers) + 1) if ws % d == 0]
            raise ValueError(
                f"stages={stages} does not divide world_size={ws}: allowed stages in "
                f"{divisors} (world_size = stages x dp pipelines). Fix: --world-size {stages}, "
                f"or --stages {divisors[-1]}"
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


def add_arguments(parser: Any) -> None:
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages S")
    for name, (flag, what, _) in _SIZES.items():
        parser.add_argument(flag, dest=name, type=int, default=None, help=what)
    parser.add_argument("--optimizer", choices=list(OPTIMIZERS), default=None)
    parser.add_argument("--lr", type=float, default=None, help="learning rate")
    parser.add_argument(
        "--strategies", nargs="+", default=None, metavar="S", help=f"some of {list(STRATEGIES)}"
    )
    parser.add_argument(
        "--grow-dims",
        dest="grow_dims",
        type=int,
        nargs="*",
        default=None,
        metavar="D",
        help="widths for the growth measurement (none: skip it)",
    )


def config_from_args(args: Any) -> dict[str, Any]:
    keys = ("stages", *_SIZES, "optimizer", "lr", "strategies", "grow_dims")
    out = {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
    for k in ("strategies", "grow_dims"):
        if k in out:
            out[k] = tuple(out[k])
    return out
