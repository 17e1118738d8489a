"""Pipeline stages: which layers go where, what a stage module is, which rank is which stage.

Mirrors torchtitan's manual split (`torchtitan/distributed/pipeline_parallel.py`,
``pipeline_module_split``): every rank builds the whole model (on the meta device, so the
size costs nothing) and then keeps only the modules its stage owns. What is left is an
ordinary module that `torch.distributed.pipelining.PipelineStage` — or our
`fsdp_lab.pipeline.schedule` — runs. Four pieces live here (`fsdp_lab.pipeline.split` decides
and checks *which* modules a stage owns, for any model):

1. `partition`: how many of the L layers each of the S stages gets. Balanced by default;
   when L % S != 0 the extra layers go to the **first** stages, because the last stage also
   runs the head and the loss (with a real vocabulary the largest matmul of the model) and
   stage 0's embedding lookup is almost free. Any uneven split can be asked for explicitly
   (``layers_per_stage=[1, 3, 2]``), as torchtitan's ``pipeline_parallel_split_points`` allow.
2. `StagePlan`: the module names of every stage, how a stage runs them, and the shape of what
   each stage sends to the next — the same on every rank. `stage_module_names` spells it out
   for `PipeGPT`: stage 0 keeps `tok_emb`/`pos_emb`, the last stage `norm`/`head`.
3. `build_stage`: the stage module. forward="model": the model itself, the modules of other
   stages set to None or deleted from their ModuleDict (the survivors keep their names:
   "layers.4" is still "layers.4" on stage 2). forward="sequence": a `SequentialStage`, this
   stage's modules under their full-model names, run one after another.
4. `stage_info`: the rank layout of a 2-D mesh pp × dp,

       rank = dp_rank * stages + stage

   so each pipeline is a block of S consecutive ranks (S=2, dp=2: pipeline 0 = ranks 0,1,
   pipeline 1 = ranks 2,3), and the data-parallel group of stage s is {s, s+S, s+2S, ...}.
   With dp_size=1 this is one pipeline and S must equal the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_lab.pipeline.model import PipeGPTConfig

FORWARDS = ("sequence", "model")  # how a stage runs its modules: see fsdp_lab.pipeline.split


def _check_int(name: str, value: object, low: int, high: int | None = None) -> None:
    bad = isinstance(value, bool) or not isinstance(value, int)
    if bad or value < low or (high is not None and value > high):
        allowed = f"{low}..{high}" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value!r}: allowed {allowed}")


def partition(
    n_layers: int, stages: int, layers_per_stage: list[int] | None = None
) -> list[list[int]]:
    """Layer indices of each stage: contiguous, in order, every stage at least one layer.

    Args:
        n_layers: L, the layers of the model.
        stages: S, 1..L (a stage without a layer would only forward what it receives).
        layers_per_stage: explicit counts, one per stage, each >= 1, summing to L; by
            default balanced, the first L % S stages one layer more.
    """
    _check_int("n_layers", n_layers, 1)
    if isinstance(stages, bool) or not isinstance(stages, int) or not 1 <= stages <= n_layers:
        raise ValueError(
            f"S={stages!r} stages for L={n_layers} layers: allowed 1..{n_layers} "
            "(every stage needs at least one layer)"
        )
    if layers_per_stage is None:
        base, extra = divmod(n_layers, stages)
        counts = [base + (1 if s < extra else 0) for s in range(stages)]
    else:
        counts = list(layers_per_stage)
        if len(counts) != stages:
            raise ValueError(
                f"layers_per_stage={counts} has {len(counts)} entries for S={stages} stages: "
                "give one count per stage"
            )
        most = n_layers - (stages - 1)
        for s, c in enumerate(counts):
            if isinstance(c, bool) or not isinstance(c, int) or not 1 <= c <= most:
                raise ValueError(
                    f"layers_per_stage={counts} gives stage {s} {c!r} layers: allowed "
                    f"1..{most} per stage (L={n_layers} layers over S={stages} stages)"
                )
        if sum(counts) != n_layers:
            raise ValueError(
                f"layers_per_stage={counts} sums to {sum(counts)}, but the model has "
                f"L={n_layers} layers: the counts must sum to {n_layers}"
            )
    out, start = [], 0
    for c in counts:
        out.append(list(range(start, start + c)))
        start += c
    return out


def stage_module_names(
    config: PipeGPTConfig, stage: int, stages: int, layers_per_stage: list[int] | None = None
) -> list[str]:
    """Top-level names stage `stage` owns, in forward order: ["tok_emb", "pos_emb", "layers.0", ...].

    Stage 0 owns the embeddings, the last stage `norm` and `head`; with S=1 one stage owns all.
    """
    layers = partition(config.n_layers, stages, layers_per_stage)
    _check_int("stage", stage, 0, stages - 1)
    names = ["tok_emb", "pos_emb"] if stage == 0 else []
    names += [f"layers.{i}" for i in layers[stage]]
    if stage == stages - 1:
        names += ["norm", "head"]
    return names


@dataclass(frozen=True)
class StagePlan:
    """Which modules each stage owns, how it runs them, and what flows between stages.

    Made and checked by `fsdp_lab.pipeline.split.plan_stages`; the same on every rank.

    Args:
        names: per stage, the module names it owns ("layers.3"), in the order it runs them.
        forward: "sequence" (run them one after another) or "model" (the model's own
            forward, the other stages' modules removed).
        activations: per boundary s -> s+1, the shape after (B, T) and the dtype of what
            stage s sends: an activation (B, T, *shape); its gradient comes back alike.
        vocab_size: tokens of the vocabulary (the last stage's logits are (B, T, vocab)).
        container: the layer container the default split cut ("" for an nn.Sequential model),
            or None.
    """

    names: tuple[tuple[str, ...], ...]
    forward: str
    activations: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    vocab_size: int
    container: str | None = None

    @property
    def stages(self) -> int:
        return len(self.names)

    def stage_of(self, name: str) -> int | None:
        """The stage owning module or parameter `name` ("layers.3.attn.qkv"), None if none."""
        for s, owned in enumerate(self.names):
            if any(name == n or name.startswith(n + ".") for n in owned):
                return s
        return None

    def layers(self, stage: int) -> list[int]:
        """The container entries (as ints, where they are numbered) stage `stage` owns."""
        if self.container is None:
            return []
        prefix = f"{self.container}." if self.container else ""
        keys = [n[len(prefix) :] for n in self.names[stage] if n.startswith(prefix)]
        return [int(k) for k in keys if k.isdigit()]


@dataclass(frozen=True)
class StageSpec:
    """What a stage module knows of its place: stage `index` of `plan`. Stored on the stage as
    ``module.stage_spec`` by `build_stage`; `gpipe_step` reads it."""

    plan: StagePlan
    index: int

    @property
    def names(self) -> tuple[str, ...]:
        return self.plan.names[self.index]

    def receives(self) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape after (B, T), dtype) of the activation this stage receives; None on stage 0."""
        return self.plan.activations[self.index - 1] if self.index > 0 else None

    def sends(self) -> tuple[tuple[int, ...], torch.dtype] | None:
        """(shape after (B, T), dtype) of what this stage sends; None on the last stage."""
        last = self.index == self.plan.stages - 1
        return None if last else self.plan.activations[self.index]


class SequentialStage(nn.Module):
    """One stage of any model: its modules, under their full-model names, run in order.

    ``SequentialStage`` of ["tok_embeddings", "layers.0"] holds ``self.tok_embeddings`` and
    ``self.layers["0"]`` (an nn.ModuleDict stands in for whatever container held it), so its
    state_dict keys are the full model's ("layers.0.attention.wq.weight") and checkpoints line
    up. The modules are shared with the model it was cut from, not copied.
    """

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.order = names
        for name in names:
            *path, leaf = name.split(".")
            holder: nn.Module = self
            for part in path:
                if part not in holder._modules:
                    holder.add_module(part, nn.ModuleDict())
                holder = holder._modules[part]
            holder.add_module(leaf, model.get_submodule(name))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) on the first stage, else the activation received; each module in turn."""
        for name in self.order:
            x = self.get_submodule(name)(x)  # (B, T, ...) -> (B, T, ...)
        return x


def build_stage(model: nn.Module, spec: StageSpec) -> nn.Module:
    """The module of stage `spec.index` (see the module docstring); no checks: use
    `fsdp_lab.pipeline.split.split_model`, which makes and checks the plan first.

    forward="model" modifies `model` in place and returns it; "sequence" leaves it whole.
    """
    if spec.plan.forward == "sequence":
        stage: nn.Module = SequentialStage(model, spec.names)
    else:
        others = {n for s, owned in enumerate(spec.plan.names) if s != spec.index for n in owned}
        for name in others:  # a name is a child, or an entry of a ModuleDict child
            parent, _, leaf = name.rpartition(".")
            if parent:
                del model.get_submodule(parent)[leaf]  # survivors keep their keys
            else:
                setattr(model, leaf, None)  # the forward skips a None module
        stage = model
    stage.stage_spec = spec
    return stage


@dataclass(frozen=True)
class StageInfo:
    """Where this rank sits in a pp × dp mesh (rank = dp_rank * stages + stage).

    Args:
        rank: this rank's global rank.
        stage: its pipeline stage, 0..stages-1.
        stages: S, stages per pipeline.
        layers: the layer indices this stage owns (empty when not given).
        prev_rank: global rank of the previous stage of the same pipeline (None on stage 0).
        next_rank: global rank of the next stage (None on the last stage).
        dp_rank: which pipeline (data-parallel replica) this rank belongs to.
        dp_size: how many pipelines run side by side on different slices of the batch.
    """

    rank: int
    stage: int
    stages: int
    layers: tuple[int, ...]
    prev_rank: int | None
    next_rank: int | None
    dp_rank: int
    dp_size: int

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def dp_ranks(self) -> list[int]:
        """Global ranks holding the same stage in every pipeline: this stage's dp group."""
        return [d * self.stages + self.stage for d in range(self.dp_size)]


def stage_info(
    rank: int,
    world_size: int,
    stages: int,
    n_layers: int | None = None,
    layers_per_stage: list[int] | None = None,
) -> StageInfo:
    """This rank's `StageInfo` when `world_size` ranks run world_size/S pipelines of S stages.

    `n_layers` (and `layers_per_stage`) record which layers of the container the stage owns,
    for `check_stage` to compare with the model; leave it None for stages given by names.
    """
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0, world_size - 1)
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if isinstance(stages, bool) or not isinstance(stages, int) or stages not in divisors:
        raise ValueError(
            f"S={stages!r} does not divide world_size={world_size}: allowed S in {divisors} "
            "(world_size = S stages x dp pipelines; S = world_size for one pipeline)"
        )
    layers = partition(n_layers, stages, layers_per_stage) if n_layers is not None else None
    dp_rank, stage = divmod(rank, stages)
    return StageInfo(
        rank=rank,
        stage=stage,
        stages=stages,
        layers=tuple(layers[stage]) if layers is not None else (),
        prev_rank=rank - 1 if stage > 0 else None,
        next_rank=rank + 1 if stage < stages - 1 else None,
        dp_rank=dp_rank,
        dp_size=world_size // stages,
    )
