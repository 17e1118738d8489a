"""Tied parameters: find them, remember them, put them back, check that they still hold.

A *tie* is one set of numbers used by two modules. GPT-2's language-model head is the
token-embedding matrix: ``model.head.weight is model.tok_emb.weight`` (`TinyGPT` does the
same). Two flavours exist:

    identity    one `nn.Parameter` object registered under two names        (kind "identity")
    storage     two Parameter objects viewing one storage, e.g.
                ``b = nn.Parameter(a.data[:4])`` — writes to one show in the other  (kind "storage")

Why a tie must sit in one wrap unit: a unit all-gathers, updates (through its shard) and frees
its *own* copy of every parameter. Were the embedding in one unit and the head in another,
each would own a copy, each copy would receive only its own module's gradient, and after the
first optimizer step the two would differ — silently. `fsdp_lab.sharding.wrap.build_plan` refuses such
a plan; `shard` then keeps a tied parameter as *one* flat segment whose `aliases` name every
owner, and gives every owner the very same view when the unit is gathered.

Why materialising from meta unties them: the usual large-model recipe is "build on meta,
`to_empty`, `init_weights`" (torchtitan). `Module.to_empty` walks each module's own
`_parameters` and, unless it can swap the storage into the existing object, puts a *new*
Parameter in each owner's slot — two owners, two Parameters, no tie (lab 03 measures what the
installed torch does; torch 2.13 CPU: untied). Hence: record the ties on meta, `retie` after
`to_empty`, then initialise — `to_empty_tied` does the three (its ``retie_fn=`` is where
course mode puts a learner's `retie`). Real FSDP2 leaves this to the user too
(`model.tie_weights()` in Hugging Face).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

TIES_ATTR = "_fsdp_lab_ties"  # where `record_ties` keeps the ties on the model


@dataclass(frozen=True)
class Tie:
    """One group of shared parameters.

    names: fully qualified parameter names, e.g. ("tok_emb.weight", "head.weight").
    modules: the owning module of each name, e.g. ("tok_emb", "head"); "" is the model itself.
    kind: "identity" (one Parameter object) or "storage" (distinct objects, one storage).
    shape: shape of the first name's parameter when the tie was found.
    """

    names: tuple[str, ...]
    modules: tuple[str, ...]
    kind: str
    shape: tuple[int, ...]


def _owner(name: str) -> tuple[str, str]:
    module, _, attr = name.rpartition(".")
    return module, attr


def _make_tie(names: list[str], kind: str, shape: torch.Size) -> Tie:
    return Tie(tuple(names), tuple(_owner(n)[0] for n in names), kind, tuple(shape))


# -- finding ------------------------------------------------------------------------------------


def find_ties(model: nn.Module) -> list[Tie]:
    """Every group of shared parameters in `model`, identity ties first.

    Identity: names whose Parameter is the same Python object. Storage: distinct Parameters
    whose data lives in one (non-empty) storage; each is listed by its first name. On the meta
    device there is no storage to compare (every meta tensor has a null data pointer), so only
    identity ties are reported there. On a sharded model `named_parameters()` yields only the
    flat shards, so no tie is visible: use `verify_weight_tying`, which reads the units.
    """
    by_object: dict[int, list[str]] = {}
    objects: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_object.setdefault(id(p), []).append(name)
        objects[id(p)] = p
    ties = [
        _make_tie(names, "identity", objects[key].shape)
        for key, names in by_object.items()
        if len(names) > 1
    ]
    # Storage: key on (device, data pointer of the storage), not of the tensor — a view at an
    # offset has its own data_ptr() but the same untyped_storage().data_ptr().
    by_storage: dict[tuple[str, int], list[int]] = {}
    for key, p in objects.items():
        if p.is_meta:
            continue
        storage = p.untyped_storage()
        if storage.nbytes() == 0:  # freed (a resharded buffer): nothing is shared
            continue
        by_storage.setdefault((str(p.device), storage.data_ptr()), []).append(key)
    for keys in by_storage.values():
        if len(keys) > 1:
            names = [by_object[k][0] for k in keys]
            ties.append(_make_tie(names, "storage", objects[keys[0]].shape))
    return ties


def record_ties(model: nn.Module) -> list[Tie]:
    """Find the ties of `model` and keep them on it (survives `to_empty` and `shard`)."""
    ties = find_ties(model)
    # A tuple: the record is a snapshot, nobody should append to it by accident.
    setattr(model, TIES_ATTR, tuple(ties))
    return ties


def recorded_ties(model: nn.Module) -> list[Tie]:
    """The ties `record_ties` stored on `model` ([] if none were recorded)."""
    return list(getattr(model, TIES_ATTR, ()))


# -- re-establishing ----------------------------------------------------------------------------


def retie(model: nn.Module, ties: list[Tie]) -> None:
    """Make every name of each tie point to the first name's Parameter object.

    Raises ValueError (before changing anything) if a tie's parameters disagree in shape:
    pointing a (64, 32) slot at a (4,) tensor would only fail later, deep in a forward.
    """
    for tie in ties:
        first = model.get_parameter(tie.names[0])
        for name in tie.names[1:]:
            other = model.get_parameter(name)
            if other.shape != first.shape:
                raise ValueError(
                    f"cannot tie {name!r} {tuple(other.shape)} to {tie.names[0]!r} "
                    f"{tuple(first.shape)}: the shapes differ"
                )
    for tie in ties:
        first = model.get_parameter(tie.names[0])
        for name in tie.names[1:]:
            module, attr = _owner(name)
            # setattr on the owner registers the same Parameter object under a second name.
            setattr(model.get_submodule(module), attr, first)


def to_empty_tied(
    model: nn.Module,
    device: torch.device | str,
    retie_fn: Callable[[nn.Module, list[Tie]], None] = retie,
) -> nn.Module:
    """``model.to_empty(device=device)`` with its ties put back: materialise a meta model.

    The ties are read before `to_empty` (on meta only identity ties exist, and `to_empty`
    unties them) — those `record_ties` kept, else found now — and `retie_fn` restores them
    after. The values are garbage until an init runs (``init_weights()``, `DeterministicInit`).
    """
    ties = recorded_ties(model) or record_ties(model)
    model.to_empty(device=device)
    retie_fn(model, ties)
    return model


# -- verifying ----------------------------------------------------------------------------------


def verify_weight_tying(model: nn.Module, ties: list[Tie] | None = None) -> list[str]:
    """Problems with the ties of `model` (an empty list: every tie holds).

    Args:
        model: an unsharded model, or one sharded by `fsdp_lab.shard`.
        ties: the ties to check; default: the recorded ones, else (unsharded) `find_ties`,
            else (sharded) every unit segment with two or more aliases.

    Unsharded: each name resolves to a parameter; all share one storage; and where shapes
    match, the values are equal (a storage tie at another offset is checked by storage only).

    Sharded: all names of a tie are aliases of one flat segment of one unit (so one copy is
    gathered, updated and freed). If any owner already holds its attribute (set when the unit
    was gathered: after a forward, it stays as a view of the freed buffer), then every owner
    must hold it and all must be the very same tensor object. Right after `shard` no owner has
    the attribute yet, so only the segment check applies.
    """
    from fsdp_lab.sharding.state import sharding_state  # sharding imports this module

    state = sharding_state(model, required=False)
    if ties is None:
        ties = recorded_ties(model)
        if not ties and state is None:
            ties = find_ties(model)
        elif not ties:
            ties = [
                _make_tie(list(names), "identity", seg.shape)
                for unit in state.units
                for names, seg in zip(unit.aliases, unit.flat.segments, strict=True)
                if len(names) > 1
            ]
    if state is None:
        return [p for tie in ties for p in _check_unsharded(model, tie)]
    return [p for tie in ties for p in _check_sharded(model, state, tie)]


def _check_unsharded(model: nn.Module, tie: Tie) -> list[str]:
    params: list[torch.Tensor] = []
    for name in tie.names:
        try:
            params.append(model.get_parameter(name))
        except AttributeError:
            return [f"tie {tie.names}: {name!r} is not a parameter of the model"]
    first, problems = params[0], []
    for name, p in zip(tie.names[1:], params[1:], strict=True):
        pair = f"{tie.names[0]!r} and {name!r}"
        if p.is_meta or first.is_meta:  # no storage on meta: identity is all there is
            if p is not first:
                problems.append(f"{pair} are different Parameter objects (meta, no storage)")
            continue
        if p.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            problems.append(f"{pair} no longer share storage: the tie is broken")
            continue
        if p.shape == first.shape and not torch.equal(p, first):
            problems.append(f"{pair} share storage but hold different values")
    return problems


def _check_sharded(model: nn.Module, state: Any, tie: Tie) -> list[str]:
    where = {}  # name -> (unit label, segment index)
    for unit in state.units:
        for i, names in enumerate(unit.aliases):
            for n in names:
                where[n] = (unit.label, i)
    missing = [n for n in tie.names if n not in where]
    if missing:
        return [f"tie {tie.names}: {missing} belong to no unit segment"]
    if len({where[n] for n in tie.names}) > 1:
        spread = ", ".join(f"{n!r} -> unit {where[n][0]} segment {where[n][1]}" for n in tie.names)
        return [f"tie {tie.names} is split over flat segments ({spread}): each copy drifts"]
    # The owners' attributes exist once the unit was gathered (`_use_views`).
    held = {n: getattr(model.get_submodule(_owner(n)[0]), _owner(n)[1], None) for n in tie.names}
    if all(t is None for t in held.values()):
        return []  # never gathered yet: the segment check is all there is
    first = held[tie.names[0]]
    return [
        f"{tie.names[0]!r} and {n!r} are not the same tensor object in the gathered unit"
        for n in tie.names[1:]
        if first is None or held[n] is not first
    ]


def assert_tied(model: nn.Module, ties: list[Tie] | None = None) -> None:
    """Raise ValueError listing every problem `verify_weight_tying` finds."""
    problems = verify_weight_tying(model, ties)
    if problems:
        raise ValueError("weight tying is broken:\n  " + "\n  ".join(problems))
