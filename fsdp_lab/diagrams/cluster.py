"""What `fsdp_lab.Cluster` starts: notebook, fork server, rendezvous file, ranks, pipes, group."""

from __future__ import annotations

import graphviz

from fsdp_lab.diagrams.base import Diagram


def cluster_diagram(world_size: int, backend: str, devices: list[str] | None = None) -> Diagram:
    """What `fsdp_lab.Cluster` starts: notebook, fork server, rendezvous file, ranks, pipes, group.

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
    g.node(
        "forkserver", "fork server\\n(torch imported once;\\nforks every rank)", fillcolor="#F2F2F2"
    )
    g.node(
        "store",
        "rendezvous file\\n(private temp folder)",
        shape="cylinder",
        fillcolor="#E0E0E0",
    )
    # Top row: the notebook starts the fork server (ranks are forked from it, in tens of ms);
    # the rendezvous is a file, not a TCP port: nothing of a Cluster listens on the network.
    with g.subgraph() as top:
        top.attr(rank="same")
        top.edge("notebook", "forkserver", label="starts", style="dashed")
        top.node("store")

    with g.subgraph(name="cluster_group") as group, group.subgraph() as row:
        group.attr(
            label=f"process group ({backend}, world_size={world_size})",
            labelloc="b",  # under the ranks, where no line from above crosses it
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
    # Only the first pipe is labelled: one label per edge is clutter.
    for r in range(world_size):
        label = {"label": "pipes: calls ↓ replies, prints ↑"} if r == 0 else {}
        g.edge("notebook", f"rank{r}", dir="both", color="#B07A00", **label)
    # One edge to the group's box (compound), not one per rank: the fork lines were clutter.
    g.attr(compound="true")
    g.edge(
        "forkserver",
        f"rank{world_size - 1}",
        lhead="cluster_group",
        style="dashed",
        color="#999999",
        constraint="false",
    )
    # Every rank reads the rendezvous file: one line to the group's box, as for the fork server
    # (one line per rank crossed the group's label and each other).
    g.edge("store", f"rank{world_size - 1}", lhead="cluster_group",
           style="dotted", dir="none", color="#777777", constraint="false")  # fmt: skip
    return Diagram(g.source)
