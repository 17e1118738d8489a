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
- a group of modules           [("tok_emb", "head")]        one unit made of several modules
                                                            (FSDP2: fully_shard([emb, head]))

and validated before any communication: a parameter shared by two modules (tied weights)
must fall in one unit, otherwise the two units would each gather, update and free their own
copy and the tie would silently break. That check is one step, `find_split_ties`, passed to
`build_plan` as ``split_ties=`` (course mode swaps in a learner's); `group_tied_units`, passed as
``mend_ties=``, is the other way out: it merges the units a tie would split into one group.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
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
GROUP_SEP = "+"  # a group unit's name: its members joined, e.g. "tok_emb+head"


@dataclass(frozen=True)
class ParamRef:
    """One parameter of a unit: where it lives and every module that uses it."""

    name: str  # first fully qualified name, e.g. "tok_emb.weight"
    owners: tuple[tuple[str, str], ...]  # (module name, attribute) of each owner; >1 = tied


@dataclass(frozen=True)
class WrapPlan:
    """Unit names in module (pre-)order, the root unit first, and each unit's parameters.

    A unit's name is its module's name, or for a group its members joined by "+"
    ("tok_emb+head"); `members` lists the modules of each unit (the root: ("",)).
    """

    units: tuple[str, ...]
    params: dict[str, tuple[ParamRef, ...]]
    members: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # The tie check that accepted the plan (None: `find_split_ties`). `shard` resolves the plan
    # again with it, so a plan is judged by one rule from `build_plan` to the sharded model.
    split_ties: Callable[..., list[tuple[str, ...]]] | None = field(
        default=None, compare=False, repr=False
    )

    def members_of(self, unit: str) -> tuple[str, ...]:
        return self.members.get(unit, (unit,))

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


def _unit_roots(model: nn.Module, units: Units) -> list[tuple[str, ...]]:
    """The plan's units as tuples of member module names (one member unless grouped)."""
    names = [n for n, _ in model.named_modules()]
    if units is None:
        return []
    if isinstance(units, MinParams):
        return [(n,) for n in _size_based(model, units.min_params)]
    if callable(units) and not isinstance(units, type):
        return [(n,) for n, m in model.named_modules() if n != ROOT and units(n, m)]
    if isinstance(units, (set, frozenset, tuple, list)):
        items = list(units)
        if all(isinstance(u, type) and issubclass(u, nn.Module) for u in items):
            classes = tuple(items)
            return [(n,) for n, m in model.named_modules() if n != ROOT and isinstance(m, classes)]
        if all(isinstance(u, str) or _is_group(u) for u in items):
            groups = [(u,) if isinstance(u, str) else tuple(u) for u in items]
            for member in (m for g in groups for m in g):
                _check_name(member, names)
            _check_disjoint(groups)
            # Module order: a unit sits where its first member sits.
            return sorted(groups, key=lambda g: min(names.index(m) for m in g))
    raise PlanError(
        f"units={units!r} is not a plan: pass a set of module classes, a list of module "
        "names (a tuple of names inside it is one unit of several modules), a policy "
        "callable (name, module) -> bool, MinParams(n), or a WrapPlan"
    )


def _is_group(item: object) -> bool:
    return (
        isinstance(item, (tuple, list)) and len(item) > 0 and all(isinstance(m, str) for m in item)
    )


def _check_name(name: str, names: list[str]) -> None:
    if name in names and name != ROOT:
        return
    if name == ROOT:
        raise PlanError("'' is the model itself, the root unit: it is always a unit; drop it")
    near = difflib.get_close_matches(name, names, n=3)
    hint = f" did you mean {near}?" if near else ""
    raise PlanError(
        f"unknown module name {name!r} in the wrap plan;{hint} names come from "
        "model.named_modules(), e.g. " + ", ".join(repr(n) for n in names[1:6])
    )


def _check_disjoint(groups: list[tuple[str, ...]]) -> None:
    seen: dict[str, tuple[str, ...]] = {}
    for group in groups:
        for m in group:
            if m in seen and (seen[m] != group or group.count(m) > 1):
                raise PlanError(
                    f"module {m!r} is listed in two units, {seen[m]} and {group}: a module "
                    "belongs to one unit. Fix: list it once."
                )
            seen[m] = group
        for a in group:  # inside one group, no member may contain another
            for b in group:
                if a != b and b.startswith(a + "."):
                    raise PlanError(
                        f"unit {group}: member {b!r} is inside member {a!r}; a group joins "
                        f"separate modules. Fix: list only {a!r}, or make {b!r} its own unit."
                    )


def unit_name(members: tuple[str, ...]) -> str:
    """A unit's name: its module, or its members joined by "+" for a group."""
    return GROUP_SEP.join(members)


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

        unclaimed = [p for p in module.parameters() if id(p) not in claimed]
        # A module that holds one owner of an unclaimed tie but not the other cannot be a unit:
        # the tie would be split (build_plan refuses that). The tie goes up to the first module
        # that holds all its owners, and counts there.
        if any(not all(inside(m) for m in users[id(p)]) for p in unclaimed):
            continue
        free = unclaimed
        if sum(p.numel() for p in free) >= min_params:
            chosen.append(name)
            claimed.update(id(p) for p in free)
    order = [n for n, _ in model.named_modules()]
    return sorted(chosen, key=order.index)


def unit_of_module(module_name: str, roots: Iterable[tuple[str, ...]]) -> str:
    """The unit of a module: the one whose member encloses it most closely (longest prefix)."""
    best, best_len = ROOT, -1
    for members in roots:
        for r in members:
            if (module_name == r or module_name.startswith(r + ".")) and len(r) > best_len:
                best, best_len = unit_name(members), len(r)
    return best


@dataclass(frozen=True)
class Ownership:
    """One parameter, every module that uses it, and the unit each of those modules is in.

    More than one distinct unit in `units` is a conflict: a tie split across units.
    """

    ref: ParamRef
    units: tuple[str, ...]  # per owner, in `ref.owners` order

    @property
    def conflict(self) -> bool:
        return len(set(self.units)) > 1


def ownership(model: nn.Module, units: Units = None) -> list[Ownership]:
    """Who owns each parameter under `units` — conflicts included, nothing raised for them.

    For pictures and explanations (`fsdp_lab.diagrams.wrap_diagram`); `build_plan` is the
    check that refuses a conflict.
    """
    return _ownership(model, _roots_of(model, units))


def _ownership(model: nn.Module, roots: list[tuple[str, ...]]) -> list[Ownership]:
    return [
        Ownership(ref, tuple(unit_of_module(m, roots) for m, _ in ref.owners))
        for ref in _param_refs(model)
    ]


def _roots_of(model: nn.Module, units: Units) -> list[tuple[str, ...]]:
    if isinstance(units, WrapPlan):
        roots = [units.members_of(u) for u in units.units if u != ROOT]
        _unit_roots(model, [m for g in roots for m in g])  # names must still exist
        return roots
    return _unit_roots(model, units)


def _param_refs(model: nn.Module) -> list[ParamRef]:
    """Every parameter once (a tied one with all its owners), in registration order."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for mname, module in model.named_modules(remove_duplicate=False):
        for pname, p in module.named_parameters(recurse=False, remove_duplicate=False):
            if (mname, pname) not in owners.setdefault(id(p), []):
                owners[id(p)].append((mname, pname))
    refs = []
    for owned_by in owners.values():
        first = owned_by[0]
        full_name = f"{first[0]}.{first[1]}" if first[0] else first[1]
        refs.append(ParamRef(full_name, tuple(owned_by)))
    return refs


def _common_parent(names: list[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    prefix = []
    for level in zip(*parts, strict=False):
        if len(set(level)) != 1:
            break
        prefix.append(level[0])
    return ".".join(prefix)


UnitOf = Callable[[str], str]  # a module's name -> the name of its unit


def find_split_ties(model: nn.Module, unit_of: UnitOf) -> list[tuple[str, ...]]:
    """The tie check of a plan: every Parameter reached under two or more names whose owning
    modules fall in different units, as the tuple of all its names (none: the plan is safe).

    A tie is one Parameter *object*: its names differ ("tok_emb.weight", "head.weight"), so
    they are grouped by identity. ``remove_duplicate=False`` lists every name, also those
    reached through a module registered in two places.
    """
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    return [
        tuple(names)
        for names in names_of.values()
        if len({unit_of(n.rpartition(".")[0]) for n in names}) > 1
    ]


def group_tied_units(model: nn.Module, units: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Mend a plan that splits ties: the units holding owners of one tied Parameter become one
    group unit (FSDP2: ``fully_shard([model.tok_emb, model.head])``); every other unit stays.

    Args:
        model: the model to be sharded.
        units: the plan's units, each a tuple of member module names (the root not listed).
    An owner left to the root unit takes the tie's other units with it into the root.
    """
    roots = [tuple(u) for u in units]
    for ref in _param_refs(model):
        held = {unit_of_module(m, roots) for m, _ in ref.owners}
        if len(held) < 2:
            continue  # not tied, or tied inside one unit
        merged = [m for r in roots if unit_name(r) in held for m in r]
        roots = [r for r in roots if unit_name(r) not in held]
        if ROOT not in held:  # else the root takes them all: the units are simply dropped
            roots.append(tuple(merged))
    return roots


def _refusal(owned: list[Ownership], names: tuple[str, ...]) -> PlanError:
    """The error for the first tie the check reported split, with the fix."""
    for own in owned:
        full = {f"{m}.{a}" if m else a for m, a in own.ref.owners}
        if own.conflict and full & set(names):
            ref = own.ref
            break
    else:  # nothing split under these names: the check itself said so
        return PlanError(
            f"the tie check reported {list(names)} as a tie split across wrap units. Fix: put "
            "every owner of each tied parameter in one unit"
        )
    where = ", ".join(
        f"{m!r} -> unit {_show(u)}" for (m, _), u in zip(ref.owners, own.units, strict=True)
    )
    parent = _common_parent([m for m, _ in ref.owners])
    users = " and ".join(repr(m) for m, _ in ref.owners)
    return PlanError(
        f"parameter {ref.name!r} is shared by modules {users} (tied weights), "
        f"but they fall in different wrap units: {where}. A unit gathers, updates "
        "and frees its own copy, so the tie would break. Fix: put both in one unit"
        + (f" (wrap their common parent {parent!r} as the unit" if parent else " (")
        + (" or " if parent else "")
        + "group them: units=[..., ("
        + ", ".join(repr(m) for m, _ in ref.owners)
        + ")]), or leave them both to the root unit (take their units out of the plan)."
    )


def build_plan(
    model: nn.Module,
    units: Units = None,
    *,
    split_ties: Callable[[nn.Module, UnitOf], list[tuple[str, ...]]] | None = None,
    mend_ties: Callable[[nn.Module, list[tuple[str, ...]]], list] | None = None,
) -> WrapPlan:
    """Resolve `units` on `model` into a validated `WrapPlan` (no communication happens here).

    Args:
        model: the module to be sharded.
        units: module classes, names (a tuple of names: one unit of several modules), a
            policy, `MinParams`, or an existing `WrapPlan`.
        split_ties: the tie check (default `find_split_ties`, or the one a `WrapPlan` was
            built with); a plan it reports ties for is refused.
        mend_ties: applied to the units before the check, e.g. `group_tied_units`; returns
            units in the list form (names, tuples of names).
    """
    roots = _roots_of(model, units)
    if mend_ties is not None:
        roots = _unit_roots(model, list(mend_ties(model, [tuple(r) for r in roots])))
    if split_ties is None and isinstance(units, WrapPlan):
        split_ties = units.split_ties
    names = [unit_name(g) for g in roots]
    owned = _ownership(model, roots)
    split = (split_ties or find_split_ties)(model, lambda m: unit_of_module(m, roots))
    if split:
        raise _refusal(owned, tuple(split[0]))
    by_unit: dict[str, list[ParamRef]] = {u: [] for u in [ROOT, *names]}
    for own in owned:
        if not own.conflict:
            by_unit[own.units[0]].append(own.ref)
            continue
        # Only a check that missed this split tie gets here: each unit then holds a copy of its
        # own, owned by its own modules — what a sharder that trusts the plan does.
        for u in dict.fromkeys(own.units):
            mine = tuple(o for o, ou in zip(own.ref.owners, own.units, strict=True) if ou == u)
            by_unit[u].append(ParamRef(f"{mine[0][0]}.{mine[0][1]}".lstrip("."), mine))
    for members, u in zip(roots, names, strict=True):
        for m in members:
            if isinstance(model.get_submodule(m), _NO_FORWARD):
                raise PlanError(
                    f"wrap unit {m!r} is a {type(model.get_submodule(m)).__name__}, which is "
                    "never called: its hooks would never gather it. Fix: wrap its children "
                    "instead."
                )
        if not by_unit[u]:
            raise PlanError(
                f"wrap unit {u!r} has no parameters of its own (nested units took them all, "
                "or it has none): an empty unit gathers nothing. Fix: drop it from the plan."
            )
    return WrapPlan(
        tuple([ROOT, *names]),
        {u: tuple(refs) for u, refs in by_unit.items()},
        {ROOT: (ROOT,), **dict(zip(names, roots, strict=True))},
        split_ties=split_ties,
    )


def unit_sizes(plan: WrapPlan, model: nn.Module) -> dict[str, int]:
    """Elements per unit (a tied parameter once)."""
    lookup = dict(model.named_parameters(remove_duplicate=False))
    return {u: sum(lookup[r.name].numel() for r in plan.params[u]) for u in plan.units}


def without_params(
    plan: WrapPlan, model: nn.Module, ignored: Iterable[nn.Parameter] | None
) -> WrapPlan:
    """`plan` without the `ignored` parameters (FSDP2's ``ignored_params``): they stay as they
    are — whole on every rank, on their device, their gradients never reduced (the caller's to
    handle)."""
    ignored = list(ignored or ())
    for i, entry in enumerate(ignored):
        if not isinstance(entry, nn.Parameter):
            raise PlanError(
                f"ignored_params[{i}] is a {type(entry).__name__}, not a parameter. Fix: pass "
                "parameters, e.g. list(model.norm.parameters()) for a module's"
            )
    ignored_ids = {id(p) for p in ignored}
    if not ignored_ids:
        return plan
    known = {id(p) for p in model.parameters()}
    strangers = ignored_ids - known
    if strangers:
        raise PlanError(
            f"ignored_params holds {len(strangers)} parameter(s) of another model. Fix: pass "
            "parameters of the model being sharded, e.g. "
            "[m.weight for m in model.modules() if isinstance(m, nn.LayerNorm)]"
        )
    lookup = dict(model.named_parameters(remove_duplicate=False))
    params = {
        u: tuple(r for r in refs if id(lookup[r.name]) not in ignored_ids)
        for u, refs in plan.params.items()
    }
    for u in plan.units[1:]:
        if not params[u]:
            raise PlanError(
                f"wrap unit {u!r} has only ignored parameters: an empty unit gathers nothing. "
                "Fix: drop it from `units`, or ignore fewer of its parameters"
            )
    return replace(plan, params=params)
