"""Pictures of structure: which processes exist and how they talk, drawn with graphviz.

What it teaches: before measuring a distributed run it helps to see its shape. A
`fsdp_lab.Cluster` is a notebook process, a rendezvous store, N rank processes, a pipe from the
notebook to each rank, and a process group joining the ranks; `cluster_diagram` draws exactly
that, the picture `torch.distributed`'s docs describe in words (init_process_group over a
TCPStore, then collectives among ranks).

Drawing needs graphviz's `dot` program, which is an OS package, not a pip package. Without it a
`Diagram` still works: Jupyter shows the DOT source with a one-line note instead of failing, so a
missing system package never breaks a lesson.
"""

from __future__ import annotations

import functools
import os
import pathlib
import shutil
from collections.abc import Container

import graphviz

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
