"""Cutting a model into pipeline stages: which layers go where, and which rank is which stage.

Mirrors torchtitan's manual split (`torchtitan/distributed/pipeline_parallel.py`,
``pipeline_module_split``): every rank builds the whole model (on the meta device, so the
size costs nothing) and then *deletes* the modules its stage does not own. What is left is
an ordinary module that `torch.distributed.pipelining.PipelineStage` — or our
`fsdp_lab.pipeline.schedule` — runs. Three decisions live here:

1. `partition`: how many of the L layers each of the S stages gets. Balanced by default;
   when L % S != 0 the extra layers go to the **first** stages, because the last stage also
   runs the head and the loss (with a real vocabulary the largest matmul of the model) and
   stage 0's embedding lookup is almost free. Any uneven split can be asked for explicitly
   (``layers_per_stage=[1, 3, 2]``), as torchtitan's ``pipeline_parallel_split_points`` allow.
2. `split_model`: stage 0 keeps `tok_emb`/`pos_emb`, the last stage `norm`/`head`, every stage
   its layers; the rest becomes None or leaves the ModuleDict (the survivors keep their
   names: "layers.4" is still "layers.4" on stage 2).
3. `stage_info`: the rank layout of a 2-D mesh pp × dp,

       rank = dp_rank * stages + stage

   so each pipeline is a block of S consecutive ranks (S=2, dp=2: pipeline 0 = ranks 0,1,
   pipeline 1 = ranks 2,3), and the data-parallel group of stage s is {s, s+S, s+2S, ...}.
   With dp_size=1 this is one pipeline and S must equal the world size.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig


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


def split_model(
    model: PipeGPT, stage: int, stages: int, layers_per_stage: list[int] | None = None
) -> PipeGPT:
    """Delete, in place, every module stage `stage` does not own; return the model.

    Works on meta and on materialised models. The model must be whole (not split before).
    """
    owned = set(stage_module_names(model.config, stage, stages, layers_per_stage))
    expected = {str(i) for i in range(model.config.n_layers)}
    if set(model.layers.keys()) != expected or any(
        getattr(model, n) is None for n in ("tok_emb", "pos_emb", "norm", "head")
    ):
        raise ValueError(
            "split_model needs the whole model, but this one was split already "
            f"(layers {sorted(model.layers.keys(), key=int)} of {model.config.n_layers}): "
            "build a fresh PipeGPT and split that"
        )
    for name in ("tok_emb", "pos_emb", "norm", "head"):
        if name not in owned:
            setattr(model, name, None)  # forward and init_weights skip a None module
    for key in list(model.layers.keys()):
        if f"layers.{key}" not in owned:
            del model.layers[key]  # a ModuleDict: the survivors keep their keys
    return model


@dataclass(frozen=True)
class StageInfo:
    """Where this rank sits in a pp × dp mesh (rank = dp_rank * stages + stage).

    Args:
        rank: this rank's global rank.
        stage: its pipeline stage, 0..stages-1.
        stages: S, stages per pipeline.
        layers: the layer indices this stage owns.
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
    n_layers: int,
    layers_per_stage: list[int] | None = None,
) -> StageInfo:
    """This rank's `StageInfo` when `world_size` ranks run world_size/S pipelines of S stages."""
    _check_int("world_size", world_size, 1)
    _check_int("rank", rank, 0, world_size - 1)
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    if isinstance(stages, bool) or not isinstance(stages, int) or stages not in divisors:
        raise ValueError(
            f"S={stages!r} does not divide world_size={world_size}: allowed S in {divisors} "
            "(world_size = S stages x dp pipelines; S = world_size for one pipeline)"
        )
    layers = partition(n_layers, stages, layers_per_stage)
    dp_rank, stage = divmod(rank, stages)
    return StageInfo(
        rank=rank,
        stage=stage,
        stages=stages,
        layers=tuple(layers[stage]),
        prev_rank=rank - 1 if stage > 0 else None,
        next_rank=rank + 1 if stage < stages - 1 else None,
        dp_rank=dp_rank,
        dp_size=world_size // stages,
    )
