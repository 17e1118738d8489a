"""Lab 03, the tie and the wrap plans around it: found on a model, judged by `build_plan`.

A plan is JSON: a list of module names, a list inside the list being one unit of several
modules. For any model with a tie the lab draws three:

    root_unit   the repeated blocks only: the tied modules fall to the root unit    (valid)
    joint_unit  the blocks, plus the tie's owners as one unit (``("tok_emb", "head")``,
                FSDP2's ``fully_shard([model.tok_emb, model.head])``)               (valid)
    split_tie   the tie's last owner alone, its partner left in the root            (INVALID)

Every section of the lab builds its model with `build_model` and says what it built with
`model_sizes`, so that ``--vocab/--dim/--layers`` reach every section and the result can show it.
Nothing here starts a rank: the models are built on CPU or on meta.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fsdp_lab.model_spec import load_factory
from fsdp_lab.models import tiny_gpt
from fsdp_lab.sharding.ties import Tie, find_ties
from fsdp_lab.sharding.wrap import PlanError, build_plan, ownership


def build_model(model_spec: str, gpt: dict[str, int] | None) -> nn.Module:
    """The model a section runs on: TinyGPT with the lab's sizes (`gpt`: `tiny_gpt`'s
    arguments), or, with ``gpt=None``, what the ``--model`` factory builds (its own sizes)."""
    return tiny_gpt(**gpt) if gpt is not None else load_factory(model_spec)()


def model_sizes(model: nn.Module, model_spec: str) -> dict[str, Any]:
    """What a section ran on, read off the model it built: the tied matrix's rows (vocab),
    columns (dim) and bytes, the repeated blocks and their bytes, all the parameters (a
    tied one once)."""
    ties = find_ties(model)
    tied = model.get_parameter(ties[0].names[0]) if ties else None
    blocks = block_names(model)
    return {
        "model": model_spec,
        "vocab": tied.shape[0] if tied is not None else None,
        "dim": tied.shape[-1] if tied is not None else None,
        "layers": len(blocks),
        "parameters": sum(p.numel() for p in model.parameters()),
        "block_bytes": sum(
            p.numel() * p.element_size()
            for b in blocks
            for p in model.get_submodule(b).parameters()
        ),
        "tied_bytes": tied.numel() * tied.element_size() if tied is not None else None,
    }


def detect_ties(model: nn.Module) -> list[dict[str, Any]]:
    """`find_ties` as JSON: names, owning modules and their types, kind, shape, bytes."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [
        {
            "names": list(t.names),
            "modules": list(t.modules),
            "module_types": [type(model.get_submodule(m)).__name__ for m in t.modules],
            "kind": t.kind,
            "shape": list(t.shape),
            "bytes": params[t.names[0]].numel() * params[t.names[0]].element_size(),
        }
        for t in find_ties(model)
    ]


def block_names(model: nn.Module) -> list[str]:
    """The repeated blocks (a transformer's layers): children of the outermost ModuleLists."""
    blocks: list[str] = []
    for name, module in model.named_modules():
        inside = any(name.startswith(b + ".") for b in blocks)
        if isinstance(module, nn.ModuleList) and not inside:
            blocks += [f"{name}.{i}" for i in range(len(module))]
    return blocks


def split_tie(model: nn.Module) -> tuple[Tie, str]:
    """The model's first tie, and the owner the invalid plan puts in a unit of its own (the
    last: TinyGPT's `head`)."""
    ties = find_ties(model)
    if not ties:
        raise ValueError(f"the {type(model).__name__} has no tied parameters (find_ties: none)")
    return ties[0], ties[0].modules[-1]


def as_units(spec: list) -> list:
    """A JSON plan -> the `units` argument of `shard` / `build_plan` / `wrap_diagram`."""
    return [tuple(u) if isinstance(u, list) else u for u in spec]


def tie_plans(model: nn.Module) -> dict[str, list]:
    """The three plans of `model` (the module docstring's), from its blocks and its first tie.

    ValueError (``Fix: ...``) when the model has no tie or a valid plan is refused, so that a
    wrong ``--model`` stops before any rank starts.
    """
    try:
        tie, split = split_tie(model)
    except ValueError as exc:
        raise ValueError(
            f"{exc}: the tying lab shards, trains and audits a model's tie. Fix: a model whose "
            "head shares the embedding's Parameter (self.head.weight = self.tok_emb.weight), "
            "or `fsdp-lab shard --model ...` to train it"
        ) from None
    blocks = block_names(model)
    owners = list(dict.fromkeys(tie.modules))  # a module owning two names of the tie: once
    specs = {"root_unit": blocks, "joint_unit": [*blocks, owners], "split_tie": [split]}
    for name in ("root_unit", "joint_unit"):
        try:
            build_plan(model, as_units(specs[name]))
        except PlanError as exc:
            why = str(exc).partition(" Fix: ")[0].rstrip(".")  # its fix is for the plan's author
            raise ValueError(
                f"the tying lab's {name} plan {specs[name]} is refused on the "
                f"{type(model).__name__}: {why}. Fix: a model whose tied modules sit outside its "
                "repeated blocks (an embedding and a head, as in GPT-2)"
            ) from None
    return specs


def describe_plans(model: nn.Module) -> dict[str, dict[str, Any]]:
    """Each plan of `model` (built on meta: no memory) as `build_plan` judges it: the plan, or
    its error and the parameters with two units."""
    out = {}
    for name, spec in tie_plans(model).items():
        units = as_units(spec)
        conflicts = [
            {"param": o.ref.name, "owners": [m for m, _ in o.ref.owners], "units": list(o.units)}
            for o in ownership(model, units)
            if o.conflict
        ]
        try:
            described, error = build_plan(model, units).describe(), None
        except PlanError as exc:
            described, error = None, str(exc)
        out[name] = {
            "units": spec,
            "valid": error is None,
            "plan": described,
            "error": error,
            "conflicts": conflicts,
        }
    return out
