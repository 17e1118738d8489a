"""Wrap units: which modules are gathered and freed together.

FSDP does not shard a model as one piece: it groups parameters into *units* (FSDP2: one
`fully_shard` call per module; FSDP1: an `auto_wrap_policy`). A unit's parameters are
all-gathered just before the unit runs and freed right after, so peak memory is the shards
plus the largest unit — the unit is the grain of memory and of communication.

A plan names the unit roots. Each parameter belongs to the unit of the nearest enclosing
unit root (a module of the plan, or the model itself, the root unit, which takes whatever
nobody else claimed). A plan is built from

- a set of module classes      {Block}                      every Block is a unit
- a size threshold             MinParams(10_000)            bottom-up, like size_based_auto_wrap_policy
- a policy callable            lambda name, module: ...     True -> unit
- an explicit list of names    ["blocks.0", "blocks.1"]

and validated before any communication: a parameter shared by two modules (tied weights)
must fall in one unit, otherwise the two units would each gather, update and free their own
copy and the tie would silently break.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Union

import torch.nn as nn

ROOT = ""  # the root unit's name: the model itself
# Containers that are never called: hooks on them never fire, so they cannot be units.
_NO_FORWARD = (nn.ModuleList, nn.ModuleDict)


class PlanError(ValueError):
    """A wrap plan that cannot work; the message names what is wrong and the fix."""


@dataclass(frozen=True)
class MinParams:
    """Size threshold: a module is a unit once it holds >= `min_params` not yet claimed."""

    min_params: int


Units = Union[
    set, frozenset, tuple, list, Callable[[str, nn.Module], bool], MinParams, "WrapPlan", None
]


@dataclass(frozen=True)
class ParamRef:
    """One parameter of a unit: where it lives and every module that uses it."""

    name: str  # first fully qualified name, e.g. "tok_emb.weight"
    owners: tuple[tuple[str, str], ...]  # (module name, attribute) of each owner; >1 = tied


@dataclass(frozen=True)
class WrapPlan:
    """Unit roots in module (pre-)order, the root unit first, and each unit's parameters."""

    units: tuple[str, ...]
    params: dict[str, tuple[ParamRef, ...]]

    def describe(self) -> str:
        lines = []
        for u in self.units:
            refs = self.params[u]
            lines.append(
                f"unit {_show(u)}: {len(refs)} parameter(s) " + ", ".join(r.name for r in refs)
            )
        return "\n".join(lines)


def _show(name: str) -> str:
    return "'' (root)" if name == ROOT else repr(name)


def _unit_roots(model: nn.Module, units: Units) -> list[str]:
    names = [n for n, _ in model.named_modules()]
    if units is None:
        return []
    if isinstance(units, MinParams):
        return _size_based(model, units.min_params)
    if callable(units) and not isinstance(units, type):
        return [n for n, m in model.named_modules() if n != ROOT and units(n, m)]
    if isinstance(units, (set, frozenset, tuple, list)):
        items = list(units)
        if all(isinstance(u, type) and issubclass(u, nn.Module) for u in items):
            classes = tuple(items)
            return [n for n, m in model.named_modules() if n != ROOT and isinstance(m, classes)]
        if all(isinstance(u, str) for u in items):
            for u in items:
                if u not in names:
                    near = difflib.get_close_matches(u, names, n=3)
                    hint = f" did you mean {near}?" if near else ""
                    raise PlanError(
                        f"unknown module name {u!r} in the wrap plan;{hint} names come from "
                        "model.named_modules(), e.g. " + ", ".join(repr(n) for n in names[1:6])
                    )
            return [n for n in names if n in set(items) and n != ROOT]
    raise PlanError(
        f"units={units!r} is not a plan: pass a set of module classes, a list of module "
        "names, a policy callable (name, module) -> bool, MinParams(n), or a WrapPlan"
    )


def _size_based(model: nn.Module, min_params: int) -> list[str]:
    if min_params < 1:
        raise PlanError(f"MinParams({min_params}): the threshold must be >= 1")
    users: dict[int, set[str]] = {}  # every module that owns each parameter (2+ when tied)
    for mname, module in model.named_modules(remove_duplicate=False):
        for p in module.parameters(recurse=False):
            users.setdefault(id(p), set()).add(mname)
    chosen: list[str] = []
    claimed: set[int] = set()
    # Post-order (children first), so small modules are units before their parents are asked.
    for name, module in reversed(list(model.named_modules())):
        if name == ROOT or isinstance(module, _NO_FORWARD):
            continue

        def inside(m: str, name: str = name) -> bool:
            return m == name or m.startswith(name + ".")

        # A tied parameter counts only for a module that holds all of its owners.
        free = [
            p
            for p in module.parameters()
            if id(p) not in claimed and all(inside(m) for m in users[id(p)])
        ]
        if sum(p.numel() for p in free) >= min_params:
            chosen.append(name)
            claimed.update(id(p) for p in free)
    order = [n for n, _ in model.named_modules()]
    return sorted(chosen, key=order.index)


def _unit_of(module_name: str, roots: Iterable[str]) -> str:
    """The nearest enclosing unit root of a module (longest prefix match)."""
    best = ROOT
    for r in roots:
        if (module_name == r or module_name.startswith(r + ".")) and len(r) > len(best):
            best = r
    return best


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    prefix = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix)


def build_plan(model: nn.Module, units: Units = None) -> WrapPlan:
    """Resolve `units` on `model` into a validated `WrapPlan` (no communication happens here).

    Args:
        model: the module to be sharded.
        units: module classes, names, a policy, `MinParams`, or an existing `WrapPlan`.
    """
    if isinstance(units, WrapPlan):
        roots = [u for u in units.units if u != ROOT]
        _unit_roots(model, roots)  # names must still exist
    else:
        roots = _unit_roots(model, units)
    owners: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if (mname, pname) not in owners.setdefault(id(p), []):
                owners[id(p)].append((mname, pname))
    by_unit: dict[str, list[ParamRef]] = {u: [] for u in [ROOT, *roots]}
    for owned_by in owners.values():
        units_hit = {m: _unit_of(m, roots) for m, _ in owned_by}
        first = owned_by[0]
        full_name = f"{first[0]}.{first[1]}" if first[0] else first[1]
        if len(set(units_hit.values())) > 1:
            where = ", ".join(f"{m!r} -> unit {_show(u)}" for m, u in units_hit.items())
            parent = _common_parent([m for m, _ in owned_by])
            users = " and ".join(repr(m) for m, _ in owned_by)
            raise PlanError(
                f"parameter {full_name!r} is shared by modules {users} (tied weights), "
                f"but they fall in different wrap units: {where}. A unit gathers, updates "
                "and frees its own copy, so the tie would break. Fix: put both in one unit"
                + (f" (wrap their common parent {parent!r} as the unit)" if parent else "")
                + ", or leave them both to the root unit (take their units out of the plan)."
            )
        by_unit[next(iter(units_hit.values()))].append(ParamRef(full_name, tuple(owned_by)))
    for u in roots:
        if isinstance(model.get_submodule(u), _NO_FORWARD):
            raise PlanError(
                f"wrap unit {u!r} is a {type(model.get_submodule(u)).__name__}, which is never "
                "called: its hooks would never gather it. Fix: wrap its children instead."
            )
        if not by_unit[u]:
            raise PlanError(
                f"wrap unit {u!r} has no parameters of its own (nested units took them all, "
                "or it has none): an empty unit gathers nothing. Fix: drop it from the plan."
            )
    return WrapPlan(tuple([ROOT, *roots]), {u: tuple(refs) for u, refs in by_unit.items()})


def unit_sizes(plan: WrapPlan, model: nn.Module) -> dict[str, int]:
    """Elements per unit (a tied parameter once)."""
    lookup = dict(model.named_parameters(remove_duplicate=False))
    return {u: sum(lookup[r.name].numel() for r in plan.params[u]) for u in plan.units}
