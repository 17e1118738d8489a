"""Cutting any model into pipeline stages by module names, checked before anything is sent.

torchtitan's manual split (`torchtitan/distributed/pipeline_parallel.py`,
``pipeline_module_split``) names the modules of each stage; so does `plan_stages`, for any
``nn.Module``:

    plan_stages(model, 2)                               default: the model's `layers` / `blocks`
                                                        / `h` container (ModuleList, ModuleDict
                                                        or Sequential; or the model itself if it
                                                        is an nn.Sequential) cut by `partition`;
                                                        the children before it (named_children
                                                        order) go to stage 0, those after it to
                                                        the last stage
    plan_stages(model, [["tok_embeddings", "layers.0", "layers.1"],
                        ["layers.2", "layers.3", "norm", "output"]])
                                                        explicit: module names per stage, in
                                                        the order the stage runs them

A stage runs its modules in one of two ways (`forward`), and which one is the model's to say:

    "sequence"  ``x = module(x)`` for each of its modules, in order (a `SequentialStage` that
                keeps the full-model names, so state_dict keys line up). Right when the model's
                forward *is* that chain: an nn.Sequential, or embedding -> blocks -> norm -> head
                with every block taking and returning one tensor. The default.
    "model"     the model's own forward on the model with the other stages' modules removed
                (None, or deleted from a ModuleDict). Right when the forward skips absent
                modules — torchtitan's convention, ``h = self.tok_embeddings(x) if
                self.tok_embeddings else x`` — as `PipeGPT`'s does (its default).

Everything the pipeline needs from the model is derived here, on the whole model, with no
message sent: every name is a module, none inside another; every parameter lies in exactly one
stage (none on the root or on an unowned container, no tie across stages, none without one);
and `fsdp_lab.pipeline.probe` runs a probe batch through the stages, which gives the shape of
what flows between them and the vocabulary, and on a model with values checks that the chain
computes the model's own forward. The plan is a pure function of the model, so every rank
computes the same one: a model that cannot be split fails on every rank before the first send,
never on one rank while the others wait for it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.nn as nn

from fsdp_lab.pipeline.model import PipeGPT
from fsdp_lab.pipeline.probe import stage_shapes
from fsdp_lab.pipeline.stages import (
    FORWARDS,
    StagePlan,
    StageSpec,
    build_stage,
    partition,
    stage_module_names,
)

CONTAINER_NAMES = ("layers", "blocks", "h")  # torchtitan/Llama, nanoGPT-style, GPT-2


def find_container(model: nn.Module) -> str | None:
    """Name of the model's `layers`/`blocks`/`h` container child, "" if the model is an
    nn.Sequential itself, None if it has neither."""
    if type(model) is nn.Sequential:
        return ""
    kinds = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
    found = [
        name
        for name, child in model.named_children()
        if name in CONTAINER_NAMES and isinstance(child, kinds)
    ]
    if len(found) > 1:
        raise ValueError(
            f"{type(model).__name__} has {len(found)} layer containers {found}: the default split "
            f"cuts one. Give the stages as module names: {_example(model)}"
        )
    return found[0] if found else None


def default_stages(
    model: nn.Module, stages: int, layers_per_stage: list[int] | None = None
) -> list[list[str]]:
    """The default split: the container's entries cut by `partition`, what comes before it in
    `named_children` on stage 0, what comes after it on the last stage."""
    container = find_container(model)
    if container is None:
        raise ValueError(
            f"{type(model).__name__} has no child named {' / '.join(CONTAINER_NAMES)} that is an "
            f"nn.ModuleList, nn.ModuleDict or nn.Sequential (its children: "
            f"{[n for n, _ in model.named_children()]}), so there is no default split: give the "
            f"stages as module names, e.g. stages={_example(model)}"
        )
    holder = model if container == "" else model.get_submodule(container)
    keys = [key for key, _ in holder.named_children()]
    prefix = "" if container == "" else f"{container}."
    before, after, seen = [], [], False
    for name, _ in model.named_children() if container else []:
        if name == container:
            seen = True
        else:
            (after if seen else before).append(name)
    parts = partition(len(keys), stages, layers_per_stage)
    names = [[prefix + keys[i] for i in part] for part in parts]
    names[0] = before + names[0]
    names[-1] = names[-1] + after
    return names


def plan_stages(
    model: nn.Module,
    stages: int | Sequence[Sequence[str]] | StagePlan,
    layers_per_stage: list[int] | None = None,
    *,
    forward: str | None = None,
    vocab_size: int | None = None,
) -> StagePlan:
    """Which modules each stage owns and what flows between them, checked on the whole model.

    Args:
        model: the whole model, on any device (meta included); not modified.
        stages: S for the default split, or the module names of each stage (see the module
            docstring), or a `StagePlan` made for this model before: its names and parameters
            are checked again, it is not probed again (the probe of a meta model costs ~0.1 s).
        layers_per_stage: with an int `stages`, the container entries per stage (`partition`).
        forward: "sequence" or "model" (see the module docstring); default "model" for
            `PipeGPT`, "sequence" for any other model.
        vocab_size: tokens of the vocabulary; default ``model.vocab_size``, else the last
            dimension of the logits.
    """
    if getattr(model, "stage_spec", None) is not None:
        spec = model.stage_spec
        raise ValueError(
            f"split_model needs the whole model, but this {type(model).__name__} was split "
            f"already (it is stage {spec.index} of {spec.plan.stages}): build a fresh model "
            "and split that"
        )
    if isinstance(stages, StagePlan):
        names = [list(n) for n in stages.names]
        _check_names(model, names, stages.forward)
        _check_parameters(model, names)
        return stages
    if forward is None:  # PipeGPT's forward skips absent modules; nothing else is assumed to
        forward = "model" if isinstance(model, PipeGPT) else "sequence"
    if forward not in FORWARDS:
        raise ValueError(f"forward={forward!r}: allowed {list(FORWARDS)}")
    if isinstance(model, PipeGPT) and isinstance(stages, int):
        # PipeGPT's own names: the same split as the default, spelled out (and its checks).
        names = [
            stage_module_names(model.config, s, stages, layers_per_stage) for s in range(stages)
        ]
    elif isinstance(stages, int) and not isinstance(stages, bool):
        names = default_stages(model, stages, layers_per_stage)
    else:
        if layers_per_stage is not None:
            raise ValueError(
                "layers_per_stage goes with a number of stages; with stages given as module "
                "names, the names say which layers each stage gets"
            )
        names = _as_names(model, stages)
    _check_names(model, names, forward)
    _check_parameters(model, names)
    vocab = vocab_size if vocab_size is not None else getattr(model, "vocab_size", None)
    shapes, vocab = stage_shapes(model, names, forward, vocab)
    return StagePlan(
        names=tuple(tuple(n) for n in names),
        forward=forward,
        activations=shapes,
        vocab_size=vocab,
        container=find_container(model),
    )


def split_model(
    model: nn.Module,
    stage: int,
    stages: int | Sequence[Sequence[str]] | StagePlan,
    layers_per_stage: list[int] | None = None,
    *,
    forward: str | None = None,
) -> nn.Module:
    """This stage's part of `model` (see the module docstring); the model must be whole.

    With forward="model" the model itself is returned, the other stages' modules deleted in
    place (torchtitan's way; `PipeGPT`); with "sequence" a `SequentialStage` holding this
    stage's modules under their full names. Either way the result has ``.stage_spec``, which
    `fsdp_lab.pipeline.schedule.gpipe_step` reads. Works on meta and on materialised models.
    """
    plan = plan_stages(model, stages, layers_per_stage, forward=forward)
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < plan.stages:
        raise ValueError(f"stage={stage!r}: allowed 0..{plan.stages - 1}")
    return build_stage(model, StageSpec(plan, stage))


# -- checks (every rank runs them, on the whole model, before any message) ----------------------


def _example(model: nn.Module) -> list[list[str]]:
    """A two-stage split of this model's children, to show the form (and copy, and edit)."""
    names = [n for n, child in model.named_children() if next(child.parameters(), None) is not None]
    half = max(1, len(names) // 2)
    return [names[:half], names[half:]]


def _as_names(model: nn.Module, stages: Sequence[Sequence[str]]) -> list[list[str]]:
    def refuse(what: str, expected: str) -> ValueError:
        form = f'e.g. stages={_example(model)}: a list per stage of module names like "layers.0"'
        return ValueError(f"{what}: expected {expected}, {form}")

    if isinstance(stages, str) or not isinstance(stages, Sequence) or not stages:
        raise refuse(f"stages={stages!r}", "an int >= 1 or")
    names = []
    for s, stage in enumerate(stages):
        if isinstance(stage, str) or not isinstance(stage, Sequence) or not stage:
            raise refuse(f"stages[{s}]={stage!r}", "a non-empty list of names")
        if not all(isinstance(n, str) for n in stage):
            raise refuse(f"stages[{s}]={list(stage)!r}", "module names (str)")
        names.append(list(stage))
    return names


def _check_names(model: nn.Module, names: list[list[str]], forward: str) -> None:
    modules = dict(model.named_modules())
    flat = [n for stage in names for n in stage]
    for s, stage in enumerate(names):
        for name in stage:
            if name not in modules or name == "":
                children = [n for n, _ in model.named_children()]
                raise ValueError(
                    f"stages[{s}] names {name!r}, which is not a module of "
                    f"{type(model).__name__}: names are paths as named_modules() gives them, "
                    f"e.g. {children[:4]} or 'layers.0'"
                )
    for i, name in enumerate(flat):
        for other in flat[i + 1 :]:
            if name == other or other.startswith(name + ".") or name.startswith(other + "."):
                raise ValueError(
                    f"{name!r} and {other!r} are both named in the stages: a module belongs to "
                    "one stage, with everything inside it"
                )
    if forward == "model":
        for name in flat:
            parent, _, _ = name.rpartition(".")
            if parent and ("." in parent or not isinstance(modules[parent], nn.ModuleDict)):
                raise ValueError(
                    f"forward='model' removes the modules a stage does not own from the model, "
                    f"but {name!r} is inside {type(modules[parent]).__name__} {parent!r}: only "
                    "children of the model and entries of a ModuleDict child can be removed "
                    "without renumbering the rest (an nn.ModuleList would make 'layers.3' "
                    "'layers.0'). Use an nn.ModuleDict (as PipeGPT and torchtitan do), or "
                    "forward='sequence'"
                )


def _check_parameters(model: nn.Module, names: list[list[str]]) -> None:
    """Every parameter in exactly one stage: none outside the named modules, no tie across."""
    stage_of = {name: s for s, stage in enumerate(names) for name in stage}
    where: dict[int, tuple[str, int]] = {}
    for pname, p in model.named_parameters(remove_duplicate=False):
        owner = next((n for n in stage_of if pname.startswith(n + ".")), None)
        if owner is None:
            raise ValueError(
                f"parameter {pname!r} lies in no stage's modules: every parameter must belong "
                f"to one named module (one on the root or on a container a stage does not own "
                f"cannot be given to a stage). Name its module in a stage, or move the "
                f"parameter into a submodule"
            )
        s = stage_of[owner]
        if id(p) in where and where[id(p)][1] != s:
            first, t = where[id(p)]
            raise ValueError(
                f"{first!r} (stage {t}) and {pname!r} (stage {s}) are one tied Parameter: a "
                "pipeline cannot split a tie (each stage would train its own copy; Megatron-LM "
                "all-reduces the two halves of its gradient, see fsdp_lab.sharding.ties). Put both "
                "modules on one stage, or untie them"
            )
        where.setdefault(id(p), (pname, s))
    held = {s for _, s in where.values()}
    for s, stage in enumerate(names):
        if s not in held:
            raise ValueError(
                f"stage {s} ({stage}) owns no parameter: a stage with nothing to train only "
                "passes on what it receives. Give it a module with parameters"
            )
