"""Pictures of structure: which processes exist and how they talk, drawn with graphviz.

What it teaches: before measuring a distributed run it helps to see its shape. A
`fsdp_lab.Cluster` is a notebook process, a rendezvous store, N rank processes, a pipe from the
notebook to each rank, and a process group joining the ranks; `cluster_diagram` draws exactly
that, the picture `torch.distributed`'s docs describe in words (init_process_group over a
TCPStore, then collectives among ranks).

`wrap_diagram` draws the other picture the weight-tying lab needs: a model's module tree with
its wrap units as boxes around it and every tied parameter as an ellipse linked to the modules
that use it, so the learner sees *why* a wrap plan is valid or not before anything runs.

Drawing needs graphviz's `dot` program, which is an OS package, not a pip package. Without it a
`Diagram` still works: Jupyter shows the DOT source with a one-line note instead of failing, so a
missing system package never breaks a lesson.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
import textwrap
from collections.abc import Container
from dataclasses import dataclass

import graphviz
import torch.nn as nn

from fsdp_lab.tying import find_ties
from fsdp_lab.wrap import (
    ROOT,
    Ownership,
    PlanError,
    Units,
    _roots_of,
    _unit_of,
    build_plan,
    ownership,
    unit_name,
)

MISSING_DOT_MESSAGE = (
    "graphviz's `dot` was not found on PATH (install the `graphviz` OS package or conda "
    "package); showing the DOT source instead"
)


def has_dot() -> bool:
    """Whether graphviz's `dot` executable is on PATH (checked each call: PATH may change)."""
    return shutil.which("dot") is not None


@functools.cache
def _explain_missing_dot_once() -> None:
    # Cached so a notebook that saves ten diagrams prints the explanation once, not ten times.
    print(MISSING_DOT_MESSAGE)


class Diagram:
    """DOT source that renders to SVG when graphviz's `dot` exists, and to its source otherwise.

    Args:
        source: a complete DOT graph (``digraph { ... }``).
    """

    def __init__(self, source: str) -> None:
        self.source = source

    def __str__(self) -> str:
        return self.source

    def __repr__(self) -> str:
        return f"Diagram({len(self.source.splitlines())} lines of DOT)"

    def svg(self) -> str | None:
        """The rendered SVG text, or None when `dot` is missing."""
        if not has_dot():
            return None
        try:
            return graphviz.Source(self.source).pipe(format="svg").decode("utf-8")
        except graphviz.ExecutableNotFound:
            # `shutil.which` and the graphviz package may disagree about PATH; missing is missing.
            return None

    def _repr_mimebundle_(
        self, include: Container[str] | None = None, exclude: Container[str] | None = None
    ) -> dict[str, str]:
        """Jupyter display: the SVG, or a one-line note plus the DOT source when `dot` is missing."""
        svg = self.svg()
        if svg is not None:
            bundle = {"image/svg+xml": svg, "text/plain": repr(self)}
        else:
            bundle = {
                "text/plain": f"{MISSING_DOT_MESSAGE}\n\n{self.source}",
                "text/markdown": f"{MISSING_DOT_MESSAGE}\n\n```dot\n{self.source}\n```",
            }
        # Jupyter may ask for a subset of mime types; honour it when it does.
        if include:
            bundle = {k: v for k, v in bundle.items() if k in include}
        if exclude:
            bundle = {k: v for k, v in bundle.items() if k not in exclude}
        return bundle

    def save(self, path: str | os.PathLike) -> pathlib.Path:
        """Write ``<path>.svg`` (or ``<path>.dot`` when `dot` is missing); returns the file written.

        Args:
            path: target without suffix (a ``.svg`` or ``.dot`` suffix is replaced).
        """
        path = pathlib.Path(path)
        if path.suffix in (".svg", ".dot"):
            path = path.with_suffix("")
        path.parent.mkdir(parents=True, exist_ok=True)
        svg = self.svg()
        if svg is not None:
            out = path.with_name(path.name + ".svg")
            out.write_text(svg, encoding="utf-8")
        else:
            _explain_missing_dot_once()
            out = path.with_name(path.name + ".dot")
            out.write_text(self.source, encoding="utf-8")
        return out


def cluster_diagram(world_size: int, backend: str, devices: list[str] | None = None) -> Diagram:
    """What `fsdp_lab.Cluster` starts: notebook, rendezvous store, rank processes, pipes, group.

    Args:
        world_size: number of rank processes (>= 1).
        backend: process-group backend name ("gloo", "nccl").
        devices: one device string per rank; defaults to "cpu" for every rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    devices = devices if devices is not None else ["cpu"] * world_size
    if len(devices) != world_size:
        raise ValueError(f"got {len(devices)} devices for world_size {world_size}")

    g = graphviz.Digraph("fsdp_lab_cluster", graph_attr={"rankdir": "TB", "nodesep": "0.35"})
    g.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="11")
    g.attr("edge", fontname="Helvetica", fontsize="9")
    g.node("notebook", "notebook process\\n(parent: Cluster)", fillcolor="#FCE8B2")
    g.node("store", "TCPStore rendezvous\\n127.0.0.1:<port>", shape="cylinder", fillcolor="#E0E0E0")
    # The notebook hosts the store (side by side on the top row); ranks only connect to it to
    # find each other, then talk through the process group.
    with g.subgraph() as top:
        top.attr(rank="same")
        top.edge("notebook", "store", label="hosts", style="dashed", arrowhead="none")

    with g.subgraph(name="cluster_group") as group, group.subgraph() as row:
        group.attr(
            label=f"process group ({backend}, world_size={world_size})",
            style="rounded,dashed",
            color="#4C72B0",
            fontname="Helvetica",
            fontsize="10",
        )
        # Ranks sit in one row in rank order (rank="same" only works on a non-cluster subgraph).
        row.attr(rank="same")
        for r, device in enumerate(devices):
            row.node(f"rank{r}", f"rank {r}\\n{device}", fillcolor="#D6E4F5")
        # A ring among ranks: the topology of ring all-reduce / all-gather / reduce-scatter.
        # Neighbours link side to side; the edge closing the ring runs under the row. Two ranks
        # share one link (not two parallel edges); one rank has none.
        style = {"dir": "none", "color": "#4C72B0", "penwidth": "2"}
        for r in range(world_size - 1):
            row.edge(f"rank{r}", f"rank{r + 1}", **style)
        if world_size > 2:
            row.edge(f"rank{world_size - 1}:s", "rank0:s", constraint="false", **style)
    # Only the first pipe and the last rendezvous line are labelled: one label per edge is
    # clutter. The store lines do not constrain the layout; if they did, dot would reorder the
    # ranks to uncross them.
    for r in range(world_size):
        label = {"label": "pipe: commands ↓ results ↑"} if r == 0 else {}
        g.edge("notebook", f"rank{r}", dir="both", color="#B07A00", **label)
    for r in range(world_size):
        label = {"label": "rendezvous"} if r == world_size - 1 else {}
        style = {"style": "dotted", "dir": "none", "color": "#777777", "constraint": "false"}
        g.edge("store", f"rank{r}", **style, **label)
    return Diagram(g.source)


# -- the wrap-boundary diagram -------------------------------------------------------------------


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
    model: nn.Module, units: Units = None, title: str | None = None, *, max_depth: int = 2
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
        units: anything `fsdp_lab.wrap.build_plan` accepts (classes, names, groups of names,
            a policy callable, `MinParams`, a `WrapPlan`).
        title: first line of the graph label; default "<ModelClass> wrap units".
        max_depth: modules deeper than this are folded into their shown ancestor (their
            parameters counted there), except unit roots and users of tied parameters, which
            are always shown. 0 shows only the model (and those).
    """
    if max_depth < 0:
        raise ValueError(f"max_depth must be >= 0, got {max_depth}")
    roots = _roots_of(model, units)  # raises PlanError for a non-plan, e.g. an unknown name
    unit_names = [ROOT, *(unit_name(g) for g in roots)]
    modules = dict(model.named_modules(remove_duplicate=False))
    owned = ownership(model, units)  # conflicts included: nothing is refused here
    shared = _shared_params(model, owned, roots)
    shown = _shown_modules(modules, roots, shared, max_depth)
    in_conflict = {u for s in shared if s.conflict for u in s.units}
    verdict = _verdict(model, units, shared)

    label = f"{title or type(model).__name__ + ' wrap units'}\\n{verdict}"
    invalid = verdict.startswith("INVALID")
    g = graphviz.Digraph(
        "fsdp_lab_wrap",
        graph_attr={"rankdir": "TB", "label": label, "labelloc": "t", "fontname": "Helvetica"},
    )
    g.attr("graph", fontcolor="#C00000" if invalid else "black", nodesep="0.25")
    g.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica")
    g.attr("node", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="9", color="#999999", arrowsize="0.6")

    # Units are disjoint sets of modules, so their boxes are siblings, never nested: the root
    # unit holds only what no other unit claimed.
    sizes = _unit_sizes(model, owned, unit_names)
    node_sizes, folded = _node_sizes(modules, shown)
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
                if m in shown and _unit_of(m, roots) == unit:
                    c.node(_module_id(m), _module_label(m, modules[m], node_sizes, folded))
            # A tie inside one unit is drawn inside it: one copy, gathered and freed with it.
            for s in shared:
                if not s.conflict and s.units[0] == unit:
                    c.node(s.node, s.label, shape="ellipse", fillcolor="#FCE8B2")
    for s in shared:
        if s.conflict:  # outside every box: no single unit can hold it
            g.node(s.node, s.label, shape="ellipse", fillcolor="#F4CCCC", color="#C00000")

    for m in modules:  # module order, so the same model always gives the same source
        if m in shown and m != ROOT:
            g.edge(_module_id(m.rpartition(".")[0]), _module_id(m))
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
            tie_units = tuple(_unit_of(m, roots) for m in tie.modules)
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
    it); for a valid plan this equals `fsdp_lab.wrap.unit_sizes`."""
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
