"""The four ways to split training over N ranks, side by side: what each rank holds, and what
crosses between ranks every step (data, context, pipeline, tensor parallelism)."""

from __future__ import annotations

import graphviz

from fsdp_lab.diagrams.base import Diagram

# strategy -> (what rank r holds, what is sent, built here?)
_SPLITS = {
    "data": ("samples {part} of the batch\\nall layers, whole weights", "all-reduce gradients"),
    "context": ("tokens {part} of every sequence\\nall layers, whole weights",
                "K, V blocks around a ring\\n+ all-reduce gradients"),
    "pipeline": ("layers {part}\\nthe whole batch, in micro-batches",
                 "activations forward,\\ntheir gradients back"),
    "tensor": ("columns/rows {part} of every\\nweight matrix, all layers, whole batch",
               "all-reduce of each layer's\\noutput, 2x forward, 2x backward"),
}  # fmt: skip
_BUILT = {"data": True, "context": False, "pipeline": True, "tensor": False}


def parallelism_diagram(n: int, layers: int = 6) -> Diagram:
    """One row per strategy, one box per rank saying which part it holds; an edge says what the
    ranks send each other. Strategies fsdp_lab does not build (context, tensor) are drawn
    dashed and labelled "theory only".

    Args:
        n: ranks.
        layers: the model's layers, for the pipeline row's stages.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: expected an int >= 1 (ranks)")
    # size: scaled down (never up) to a notebook's width, whatever N is
    g = graphviz.Digraph(
        "fsdp_lab_parallelism", graph_attr={"rankdir": "LR", "nodesep": "0.15", "size": "9.5"}
    )
    g.attr("node", shape="box", style="rounded,filled", fontname="Helvetica", fontsize="9")
    g.attr("edge", fontname="Helvetica", fontsize="8", dir="both", arrowsize="0.5")
    per_stage = [layers // n + (1 if s < layers % n else 0) for s in range(n)]
    # LR stacks the rows bottom-up in the order they are written: reversed, data comes first.
    for name, (holds, sends) in reversed(_SPLITS.items()):
        built = _BUILT[name]
        with g.subgraph(name=f"cluster_{name}") as box:
            box.attr(
                label=f"{name} parallelism" + ("" if built else " (theory only: not built here)"),
                style="rounded" if built else "rounded,dashed",
                fontname="Helvetica",
                fontsize="10",
            )
            for r in range(n):
                if name == "pipeline":
                    first = sum(per_stage[:r])
                    part = f"{first}..{first + per_stage[r] - 1}" if per_stage[r] else "(none)"
                else:
                    part = f"{r + 1}/{n}"
                box.node(
                    f"{name}{r}",
                    f"rank {r}\\n" + holds.format(part=part),
                    fillcolor="#D6E4F5" if built else "#EEEEEE",
                )
            for r in range(n - 1):
                box.edge(
                    f"{name}{r}",
                    f"{name}{r + 1}",
                    label=sends if r == 0 else "",
                    style="solid" if built else "dashed",
                )
    return Diagram(g.source)
