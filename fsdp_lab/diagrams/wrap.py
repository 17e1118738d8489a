"""The wrap-boundary diagram: module tree, one box per wrap unit, tied parameters between."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

import graphviz
import torch.nn as nn

from fsdp_lab.diagrams.base import Diagram
from fsdp_lab.sharding.ties import find_ties
from fsdp_lab.sharding.wrap import (
    ROOT,
    Ownership,
    PlanError,
    Units,
    _roots_of,
    build_plan,
    ownership,
    unit_name,
    unit_of_module,
)


@dataclass(frozen=True)
class _Shared:
    """A tied parameter as drawn: one ellipse, one edge to each module that uses it."""

    name: str  # e.g. "tok_emb.weight"; for a storage tie, its names joined by " ~ "
    label: str
    owners: tuple[str, ...]  # module names, one per use
    units: tuple[str, ...]  # the unit of each owner, in `owners` order

    @property
    def node(self) -> str:
        return f"shared {self.name}"

    @property
    def conflict(self) -> bool:
        return len(set(self.units)) > 1


def wrap_diagram(
    model: nn.Module,
    units: Units = None,
    title: str | None = None,
    *,
    max_depth: int = 2,
    rankdir: str = "TB",
    collapse_repeats: bool = False,
    max_width_in: float | None = None,
) -> Diagram:
    """The wrap-boundary picture: module tree, one box per wrap unit, tied parameters between.

    What it teaches: a unit all-gathers, updates (through its shard) and frees its *own* copy
    of every parameter its modules use. A tied parameter (ellipse) whose users all sit in one
    box has one copy, and the tie holds. One whose users sit in two boxes gets two copies (red
    dashed edges, "own copy in unit ..."), each updated by its own module's gradient only: the
    tie breaks silently after the first step. The classic pair on `TinyGPT`: ``units={Block}``
    leaves embedding and head in the root unit (valid); ``units=["head"]`` splits them
    (invalid); ``units=[("tok_emb", "head"), ...]`` groups them into one unit (valid again).

    An invalid plan is drawn, not refused (the graph label says what is wrong, in
    `build_plan`'s words); `units` that are not a plan at all raise `PlanError`.

    Args:
        model: the unsharded model (or built on meta: shapes are all the picture needs).
        units: anything `fsdp_lab.sharding.wrap.build_plan` accepts (classes, names, groups of names,
            a policy callable, `MinParams`, a `WrapPlan`).
        title: first line of the graph label; default "<ModelClass> wrap units".
        max_depth: modules deeper than this are folded into their shown ancestor (their
            parameters counted there), except unit roots and users of tied parameters, which
            are always shown. 0 shows only the model (and those).
        rankdir: "TB" (the module tree grows downwards: sibling units side by side) or "LR"
            (rightwards: sibling units stacked, narrow enough for a notebook column).
        collapse_repeats: draw a run of 4+ alike units (siblings ``blocks.0``, ``blocks.1``,
            ... of one type and size, none holding a tie) as its first, one dashed box for the
            middle ones, and its last: the picture of 32 blocks is the picture of 4.
        max_width_in: scale the drawing down (never up) to at most this many inches wide.
    """
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    if rankdir not in ("TB", "LR"):
        raise ValueError(f"rankdir={rankdir!r}: expected 'TB' or 'LR'")
    if max_width_in is not None and not max_width_in > 0:
        raise ValueError(f"max_width_in={max_width_in!r}: expected a number of inches > 0")
    roots = _roots_of(model, units)  # raises PlanError for a non-plan, e.g. an unknown name
    unit_names = [ROOT, *(unit_name(g) for g in roots)]
    modules = dict(model.named_modules(remove_duplicate=False))
    owned = ownership(model, units)  # conflicts included: nothing is refused here
    shared = _shared_params(model, owned, roots)
    sizes = _unit_sizes(model, owned, unit_names)
    runs = _alike_runs(modules, roots, shared, sizes) if collapse_repeats else []
    hidden = {u for run in runs for u in run[1:-1]}  # drawn as one dashed box per run
    unit_names = [u for u in unit_names if u not in hidden]
    shown = _shown_modules(modules, roots, shared, max_depth)
    node_sizes, folded = _node_sizes(modules, shown)  # before hiding: nothing folds upwards
    shown = {m for m in shown if unit_of_module(m, roots) not in hidden}
    in_conflict = {u for s in shared if s.conflict for u in s.units}
    verdict = _verdict(model, units, shared)

    label = f"{title or type(model).__name__ + ' wrap units'}\\n{verdict}"
    invalid = verdict.startswith("INVALID")
    g = graphviz.Digraph(
        "fsdp_lab_wrap",
        graph_attr={"rankdir": rankdir, "label": label, "labelloc": "t", "fontname": "Helvetica"},
    )
    if max_width_in is not None:  # graphviz scales down to fit the box; the height is free
        g.attr("graph", size=f"{max_width_in:g},100")
    g.attr("graph", fontcolor="#C00000" if invalid else "black", nodesep="0.25")
    g.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica")
    g.attr("node", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="9", color="#999999", arrowsize="0.6")

    # Units are disjoint sets of modules, so their boxes are siblings, never nested: the root
    # unit holds only what no other unit claimed.
    for unit in unit_names:
        name = "root unit" if unit == ROOT else f"unit {unit!r}"
        with g.subgraph(name="cluster_root_unit" if unit == ROOT else f"cluster_unit_{unit}") as c:
            c.attr(
                label=f"{name} · {sizes[unit]:,} params",
                style="rounded,filled",
                fillcolor="#F2F2F2" if unit == ROOT else "#E3ECF7",
                color="#C00000" if unit in in_conflict else "#4C72B0",
                fontcolor="#C00000" if unit in in_conflict else "black",
                fontsize="10",
            )
            for m in modules:
                if m in shown and unit_of_module(m, roots) == unit:
                    c.node(_module_id(m), _module_label(m, modules[m], node_sizes, folded))
            # A tie inside one unit is drawn inside it: one copy, gathered and freed with it.
            for s in shared:
                if not s.conflict and s.units[0] == unit:
                    c.node(s.node, s.label, shape="ellipse", fillcolor="#FCE8B2")
        for run in runs:  # declared right after its first unit: drawn in its place
            if run[0] == unit:
                _draw_collapsed(g, run, sizes[unit])
    for s in shared:
        if s.conflict:  # outside every box: no single unit can hold it
            g.node(s.node, s.label, shape="ellipse", fillcolor="#F4CCCC", color="#C00000")

    collapsed_at = {run[1]: run for run in runs}  # where each run's middle starts
    for m in modules:  # module order, so the same model always gives the same source
        if m in shown and m != ROOT:
            g.edge(_module_id(m.rpartition(".")[0]), _module_id(m))
        if m in collapsed_at:  # the dashed box sits between the run's first and last
            g.edge(_module_id(m.rpartition(".")[0]), _collapsed_id(collapsed_at[m]), style="dashed")
    for s in shared:
        # One edge per using module (a module may hold one parameter under two names).
        for m, unit in dict.fromkeys(zip(s.owners, s.units, strict=True)):
            if s.conflict:
                where = "root unit" if unit == ROOT else f"unit {unit!r}"
                g.edge(
                    _module_id(m),
                    s.node,
                    label=f"own copy in {where}",
                    color="red",
                    fontcolor="red",
                    style="dashed",
                    dir="none",
                )
            else:
                g.edge(_module_id(m), s.node, color="#555555", dir="none")
    return Diagram(g.source)


def _shared_params(
    model: nn.Module, owned: list[Ownership], roots: list[tuple[str, ...]]
) -> list[_Shared]:
    """Identity ties (one Parameter, 2+ owners) from `ownership`, then storage ties."""
    shared = []
    for own in owned:
        if len(own.ref.owners) > 1:
            shape = tuple(model.get_parameter(own.ref.name).shape)
            owners = tuple(m for m, _ in own.ref.owners)
            label = f"{own.ref.name}\\n{shape}\\nshared"
            shared.append(_Shared(own.ref.name, label, owners, own.units))
    for tie in find_ties(model):
        if tie.kind == "storage":  # distinct Parameters over one storage: each name its shape
            lines = [f"{n} {tuple(model.get_parameter(n).shape)}" for n in tie.names]
            label = "\\n".join([*lines, "shared storage"])
            tie_units = tuple(unit_of_module(m, roots) for m in tie.modules)
            shared.append(_Shared(" ~ ".join(tie.names), label, tie.modules, tie_units))
    return shared


def _verdict(model: nn.Module, units: Units, shared: list[_Shared]) -> str:
    """The graph label's verdict: split ties first (the lesson), else `build_plan`'s word."""
    conflicts = [s for s in shared if s.conflict]
    if conflicts:
        lines = [
            f"INVALID: {s.name} is tied across units "
            + " and ".join(repr(u) for u in dict.fromkeys(s.units))
            for s in conflicts
        ]
        return "\\n".join([*lines, "(each unit would gather, update and free its own copy)"])
    try:
        build_plan(model, units)  # the other ways a plan fails: empty units, ModuleList units
    except PlanError as err:
        problem = str(err).split(" Fix:")[0]
        return "INVALID: " + "\\n".join(textwrap.wrap(problem, 80))
    return "valid: every tie inside one unit" if shared else "valid: no tied parameters"


def _alike_runs(
    modules: dict[str, nn.Module],
    roots: list[tuple[str, ...]],
    shared: list[_Shared],
    sizes: dict[str, int],
) -> list[list[str]]:
    """Runs of 4+ consecutive sibling units ``X.i`` of one module type and size, none of whose
    modules uses a tied parameter (those must stay drawn: their edges are the lesson)."""
    tie_users = {m for s in shared for m in s.owners}
    runs: list[list[str]] = []
    for (name,) in (g for g in roots if len(g) == 1):
        parent, _, index = name.rpartition(".")
        uses_tie = any(u == name or u.startswith(name + ".") for u in tie_users)
        if not index.isdigit() or uses_tie:
            continue
        last = runs[-1][-1] if runs else None
        alike = last is not None and (
            last.rpartition(".")[0] == parent
            and int(last.rpartition(".")[2]) + 1 == int(index)
            and type(modules[last]) is type(modules[name])
            and sizes[last] == sizes[name]
        )
        if alike:
            runs[-1].append(name)
        else:
            runs.append([name])
    return [run for run in runs if len(run) >= 4]


def _collapsed_id(run: list[str]) -> str:
    return f"{run[1]} ... {run[-2]}"


def _draw_collapsed(g: graphviz.Digraph, run: list[str], size: int) -> None:
    """One dashed box for the middle of `run`: which units it stands for, and their size."""
    middle = run[1:-1]
    with g.subgraph(name=f"cluster_alike_{run[1]}") as c:
        c.attr(label="", style="rounded,dashed,filled", fillcolor="#E3ECF7", color="#4C72B0")
        label = (
            f"units {middle[0]!r} … {middle[-1]!r}\\n{len(middle)} more like {run[0]!r},"
            f"\\n{size:,} params each"
        )
        c.node(_collapsed_id(run), label, shape="plaintext", style="")


def _shown_modules(
    modules: dict[str, nn.Module],
    roots: list[tuple[str, ...]],
    shared: list[_Shared],
    max_depth: int,
) -> set[str]:
    """Module names drawn as boxes: down to `max_depth`, plus what the picture must show."""
    shown = {m for m in modules if (m.count(".") + 1 if m else 0) <= max_depth}
    shown |= {m for group in roots for m in group}  # a unit's box needs its modules in it
    shown |= {m for s in shared for m in s.owners}  # a tie's edges land on its real users
    for m in list(shown):  # and a shown module's ancestors, so the tree stays connected
        parts = m.split(".") if m else []
        shown.update(".".join(parts[:i]) for i in range(len(parts)))
    return shown


def _node_sizes(
    modules: dict[str, nn.Module], shown: set[str]
) -> tuple[dict[str, int], dict[str, int]]:
    """Per shown module: parameter elements held by it and its folded descendants, and how
    many descendants were folded into it. Every unit root is shown, so a folded module is
    always in the same unit as the box it is folded into."""
    sizes, folded, seen = dict.fromkeys(shown, 0), dict.fromkeys(shown, 0), set()
    for name, module in modules.items():
        at = name
        while at not in shown:
            at = at.rpartition(".")[0]
        folded[at] += at != name
        for p in module.parameters(recurse=False):
            if (at, id(p)) not in seen:  # a tied parameter once per box
                seen.add((at, id(p)))
                sizes[at] += p.numel()
    return sizes, folded


def _unit_sizes(model: nn.Module, owned: list[Ownership], unit_names: list[str]) -> dict[str, int]:
    """Elements each unit would gather: a tie split across units counts in each (each copies
    it); for a valid plan this equals `fsdp_lab.sharding.wrap.unit_sizes`."""
    sizes = dict.fromkeys(unit_names, 0)
    for own in owned:
        for unit in set(own.units):
            sizes[unit] += model.get_parameter(own.ref.name).numel()
    return sizes


def _module_id(name: str) -> str:
    return name or "(model)"


def _module_label(
    name: str, module: nn.Module, sizes: dict[str, int], folded: dict[str, int]
) -> str:
    parts = name.split(".")
    # "0" alone says nothing: an index keeps its container's name ("blocks.0").
    short = ".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1]
    lines = [short or "(model)", type(module).__name__]
    if sizes[name]:
        lines.append(f"{sizes[name]:,} params")
    if folded[name]:
        lines.append(f"(+{folded[name]} submodules inside)")
    return "\\n".join(lines)
