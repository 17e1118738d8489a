"""Lab 05 — pipeline-parallel RNG seeding: four ways to initialise a pipeline's stages, and
which of them equal the unsplit model bitwise, at what cost.

The unsplit model is initialised by ``PipeGPT(config); torch.manual_seed(s);
model.init_weights()``: one random stream, read module after module. A pipeline gives each
rank a contiguous slice of the modules (`fsdp_lab.pipeline.stages`), and each of the four
strategies of `fsdp_lab.pipeline.rng` initialises that slice differently:

    seed_checkpoint   rank 0 builds the whole model, saves it, every stage loads its keys
    same_seed         every stage seeds alike (the bug: later stages repeat stage 0's draws)
    per_stage_seed    one broadcast seed per stage (distinct, but not the unsplit init)
    rng_replay        the recorded init order replayed, the generator state handed on

On live ranks the lab initialises the pipeline with each strategy (timed, its peak memory and
messages measured by `init_stage`), compares every stage with the unsplit reference, measures
how much the stages repeat each other's draws (`fsdp_lab.labs.pp_seed_report`), trains each
pipeline with GPipe (`train_pipeline`) beside single-process training of the reference, and
grows the model to show what the seed checkpoint costs rank 0. With more ranks than stages
(a pp x dp mesh) it checks that the replicas of a stage got the same weights.

Mirrors torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint``) and
``torch.distributed.pipelining``'s stage split; see `fsdp_lab.pipeline.rng` for the four.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from fsdp_lab import comm, reference
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    device,
    intra_op_threads,
    rank,
    world_size,
)
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.pp_seed_report import analyse, figures, summary
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, dp_group, stage_info, train_pipeline
from fsdp_lab.pipeline.rng import CHECKPOINT_NAME, STRATEGIES, generator_state, init_stage

__all__ = ["STRATEGIES", "PPSeedConfig", "figures", "run", "summary"]

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
        return PipeGPTConfig(self.vocab, dim or self.dim, self.layers, self.heads, self.seq_len)


def make_optimizer(config: PPSeedConfig, params: Any) -> torch.optim.Optimizer:
    lr = OPTIMIZERS[config.optimizer] if config.lr is None else config.lr
    if config.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr)
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


# -- on every rank -----------------------------------------------------------------------------


def shared_dir_worker() -> str:
    """A fresh folder that every rank can read (rank 0 makes it and broadcasts its path):
    under torchrun each rank runs the lab's `run`, so a folder made there would differ."""
    path = tempfile.mkdtemp(prefix="fsdp_lab_pp_seed_") if rank() == 0 else ""
    size = torch.tensor([len(path.encode())], dtype=torch.int64, device=device())
    comm.broadcast(size, src=0)
    data = torch.zeros(int(size), dtype=torch.uint8, device=device())
    if rank() == 0:
        data.copy_(torch.tensor(list(path.encode()), dtype=torch.uint8))
    comm.broadcast(data, src=0)
    return bytes(data.cpu().tolist()).decode()


def remove_dir_worker(path: str) -> None:
    comm.all_reduce(torch.zeros(1, device=device()))  # every rank is done with the folder
    if rank() == 0:
        shutil.rmtree(path, ignore_errors=True)


def _init(config: PPSeedConfig, strategy: str, model_config: PipeGPTConfig, folder: str):
    info = stage_info(rank(), world_size(), config.stages, config.layers)
    torch.manual_seed(10_000 + rank())  # whatever a rank drew before must not matter
    model, report = init_stage(
        strategy, model_config, info, config.seed, device=device(), checkpoint_dir=folder
    )
    return info, model, report


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def strategies_worker(config: PPSeedConfig, folder: str) -> dict[str, Any]:
    """Every strategy in turn: initialise this rank's stage (measured), keep a copy of the
    initial values, train `steps` GPipe steps. Returns what this rank saw, per strategy."""
    for strategy in config.strategies:  # warm-up: first calls pay one-time costs (not timed)
        _init(config, strategy, config.gpt(), folder)
    info = stage_info(rank(), world_size(), config.stages, config.layers)
    group = dp_group(info)  # created once: process groups are not freed
    out: dict[str, Any] = {"rank": rank(), "stage": info.stage, "dp_rank": info.dp_rank}
    for strategy in config.strategies:
        info, model, report = _init(config, strategy, config.gpt(), folder)
        if strategy == "seed_checkpoint":
            report["checkpoint_file_bytes"] = (Path(folder) / CHECKPOINT_NAME).stat().st_size
        initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        optimizer = make_optimizer(config, model.parameters())
        losses = train_pipeline(
            model,
            info,
            optimizer,
            config.steps,
            config.microbatches,
            config.global_batch,
            config.seq_len,
            group=group,
        )
        out[strategy] = {"init": report, "params": initial, "losses": losses}
        del model, optimizer
    state = generator_state(device())
    out["generator_state_bytes"] = state.numel() * state.element_size()
    return out


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def growth_worker(config: PPSeedConfig, folder: str) -> list[dict[str, Any]]:
    """Init time and peak bytes of every strategy at each width in `grow_dims` (no training)."""
    rows = []
    for strategy in config.strategies:  # warm-up at the smallest width, not recorded
        _init(config, strategy, config.gpt(min(config.grow_dims)), folder)
    for dim in config.grow_dims:
        row: dict[str, Any] = {"dim": dim}
        for strategy in config.strategies:
            _, model, report = _init(config, strategy, config.gpt(dim), folder)
            row[strategy] = report
            del model
        rows.append(row)
    return rows


@intra_op_threads(1)  # tiny matmuls: more threads only contend
def baseline_worker(config: PPSeedConfig) -> dict[str, Any] | None:
    """On rank 0: the unsplit reference init, and single-process training from it."""
    if rank() != 0:
        return None
    model = PipeGPT(config.gpt()).to(device())
    torch.manual_seed(config.seed)
    model.init_weights()
    initial = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    start = time.perf_counter()
    losses = reference.train_steps(
        model,
        make_optimizer(config, model.parameters()),
        config.steps,
        global_batch=config.global_batch,
        seq_len=config.seq_len,
        device=device(),
    )
    return {"params": initial, "losses": losses, "train_time_s": time.perf_counter() - start}


# -- the lab ------------------------------------------------------------------------------------


def run(
    config: PPSeedConfig = PPSeedConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """Initialise, compare, train and grow; see the module docstring."""
    owned = cluster is None
    cluster = cluster or Cluster(config.world_size, config.backend)
    try:
        if cluster.world_size != config.world_size:  # the cluster decides (torchrun, too)
            config = replace(config, world_size=cluster.world_size)
        folder = cluster.run(shared_dir_worker)[0]
        try:
            ranks = cluster.run(strategies_worker, config, folder)
            growth = cluster.run(growth_worker, config, folder) if config.grow_dims else []
        finally:
            cluster.run(remove_dir_worker, folder)
        base = cluster.run(baseline_worker, config)[0]
        backend = cluster.backend
    finally:
        if owned:
            cluster.close()
    return LabResult("pp-seed", analyse(config, ranks, growth, base, backend))


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
