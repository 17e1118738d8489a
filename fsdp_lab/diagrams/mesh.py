"""A hybrid-sharding mesh: R nodes of S ranks, the links each collective of HSDP uses."""

from __future__ import annotations

import graphviz

from fsdp_lab.diagrams.base import Diagram
from fsdp_lab.sizes import format_bytes


def mesh_diagram(
    mesh: tuple[int, int], bytes_per_group: dict[str, dict[str, float]] | None = None
) -> Diagram:
    """R shard groups ("nodes", boxes) of S ranks; inside a node the ranks all-gather and
    reduce-scatter over the fast link (blue ring), across nodes the ranks holding the same shard
    all-reduce its gradient over the NIC (red, dashed). With `bytes_per_group` (one rank's
    measured bytes per step by group kind and op) the edges carry the measured numbers.

    Args:
        mesh: (R replicas, S ranks per shard group), R·S ranks, global rank r·S + s.
        bytes_per_group: e.g. ``result["comm_bytes_per_rank"][0]``.
    """
    r, s = mesh
    if r < 1 or s < 1:
        raise ValueError(f"mesh={mesh}: expected two positive ints (R, S)")
    moved = bytes_per_group or {}

    def label(kind: str, default: str) -> str:
        ops = moved.get(kind)
        if not ops:
            return default
        return (
            default + "\\n" + "\\n".join(f"{op}: {format_bytes(b)}/step" for op, b in ops.items())
        )

    g = graphviz.Graph(
        "fsdp_lab_mesh", graph_attr={"rankdir": "LR", "nodesep": "0.3", "pad": "0.2"}
    )
    g.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="8")
    inner = {"color": "#4C72B0", "penwidth": "2"}
    for node in range(r):
        with g.subgraph(name=f"cluster_node{node}") as box:
            box.attr(
                label=f"node {node} · shard group (ranks {node * s}..{node * s + s - 1})",
                style="rounded,dashed",
                color="#4C72B0",
                fontname="Helvetica",
                fontsize="10",
            )
            for i in range(s):
                box.node(
                    f"r{node * s + i}", f"rank {node * s + i}\\nshard {i}", fillcolor="#D6E4F5"
                )
            for i in range(s - 1):  # the ring inside a node (its closing edge implied)
                text = label("shard", "all-gather, reduce-scatter\\n(fast link)") if i == 0 else ""
                box.edge(f"r{node * s + i}", f"r{node * s + i + 1}", label=text, **inner)
    across = {"color": "#C44E52", "style": "dashed", "penwidth": "1.5", "constraint": "false"}
    for i in range(s):
        for node in range(r - 1):
            g.edge(f"r{node * s + i}", f"r{(node + 1) * s + i}", **across)
    if r > 1:  # a note, not an edge label: a label on a non-constraining edge gets clipped
        text = label(
            "replicate", "red, dashed: all-reduce of each\\ngradient shard across nodes (NIC)"
        )
        g.node("note", text, shape="note", fillcolor="#F8E0E0", fontsize="9")
    return Diagram(g.source)
