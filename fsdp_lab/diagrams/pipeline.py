"""Who owns which layers of a pipeline, and where the seed, the file or the RNG state travels.

One box per pipeline stage (its ranks in the label) holding the modules it owns, in forward
order, and the edges of one initialisation strategy of `fsdp_lab.pipeline.rng`:

- ``seed_checkpoint``: rank 0 seeds and initialises the whole model, writes the checkpoint
  file, and every stage loads its own keys from it.
- ``same_seed``: the same seed into every stage; every stage's first draws are stage 0's
  first draws (red: the bug).
- ``per_stage_seed``: rank 0 draws one seed per stage and broadcasts them.
- ``rng_replay``: the seed starts the stream at the first module of the *recorded* init order
  (`record_init_order` on a meta model); each change of owner along that order is one edge,
  the generator state sent from the stage that drew last to the stage that draws next.
"""

from __future__ import annotations

import graphviz
import torch

from fsdp_lab.diagrams.base import Diagram
from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig
from fsdp_lab.pipeline.rng import CHECKPOINT_NAME, STRATEGIES, record_init_order, stage_of_module
from fsdp_lab.pipeline.stages import stage_module_names

_WHAT = {
    "seed_checkpoint": "rank 0 initialises the whole model once and saves it; stages load",
    "same_seed": "every stage seeds alike: later stages repeat stage 0's draws (the bug)",
    "per_stage_seed": "one seed per stage, broadcast by rank 0: distinct, not the unsplit init",
    "rng_replay": "the recorded init order replayed; the generator state follows the owner",
}
HANDOFF_COLOR = "#C44E52"


def _top(name: str) -> str:
    """A recorded module name -> the node that shows it ("layers.3.attn.qkv" -> "layers.3")."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def pipeline_diagram(
    config: PipeGPTConfig,
    stages: int,
    layers_per_stage: list[int] | None = None,
    strategy: str = "rng_replay",
    dp: int = 1,
    *,
    model_cls: type[PipeGPT] = PipeGPT,
) -> Diagram:
    """The stages of a `PipeGPT` pipeline, and how `strategy` initialises them.

    Args:
        config: the model split into stages.
        stages: S, 1..n_layers.
        layers_per_stage: explicit layer counts per stage (default: balanced, extras first).
        strategy: one of `fsdp_lab.pipeline.rng.STRATEGIES`.
        dp: pipelines side by side (each stage's ranks: s, s + S, ...); every edge happens in
            each pipeline.
        model_cls: the model whose `init_weights` order is recorded (on meta).
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r} is unknown: allowed {list(STRATEGIES)}")
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp={dp!r} is out of range: allowed an int >= 1")
    owned = [stage_module_names(config, s, stages, layers_per_stage) for s in range(stages)]
    with torch.device("meta"):
        model = model_cls(config)
        order = record_init_order(model)  # submodule names, in the order values are drawn
    sizes = {
        name: sum(p.numel() for p in model.get_submodule(name).parameters())
        for o in owned
        for name in o
    }
    label = f"{strategy}: S={stages} stages x dp={dp} on {stages * dp} ranks\\n{_WHAT[strategy]}"
    g = graphviz.Digraph(
        "fsdp_lab_pipeline",
        graph_attr={
            "rankdir": "TB",
            "label": label,
            "labelloc": "t",
            "fontname": "Helvetica",
            "compound": "true",
            "nodesep": "0.3",
        },
    )
    g.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica")
    g.attr("node", fontsize="10")
    g.attr("edge", fontname="Helvetica", fontsize="9", color="#999999", arrowsize="0.7")

    for s, names in enumerate(owned):
        ranks = ", ".join(str(d * stages + s) for d in range(dp))
        with g.subgraph(name=f"cluster_stage_{s}") as c:
            c.attr(
                label=f"stage {s} · rank{'s' if dp > 1 else ''} {ranks}",
                style="rounded,filled",
                fillcolor="#E3ECF7",
                color="#4C72B0",
                fontsize="10",
            )
            for name in names:
                kind = type(model.get_submodule(name)).__name__
                c.node(name, f"{name}\\n{kind}\\n{sizes[name]:,} params")
    for names in owned:  # forward order, top to bottom (invisible: layout only)
        for a, b in zip(names, names[1:], strict=False):
            g.edge(a, b, style="invis")
    firsts = [names[0] for names in owned]
    first_layers = [next(n for n in names if n.startswith("layers.")) for names in owned]
    total = sum(sizes.values())

    if strategy == "seed_checkpoint":
        g.node(
            "rank 0 init",
            f"rank 0: PipeGPT(config) whole\\nmanual_seed(s); init_weights()\\n{total:,} params",
            fillcolor="#FCE8B2",
        )
        g.node(
            "checkpoint", f"{CHECKPOINT_NAME}\\n{4 * total:,} B", shape="cylinder", ordering="out"
        )
        g.edge("rank 0 init", "checkpoint", label="torch.save", color="#B07A00")
        for s, first in enumerate(firsts):
            own = sum(sizes[n] for n in owned[s])
            g.edge(
                "checkpoint",
                first,
                lhead=f"cluster_stage_{s}",
                label=f"load own keys\\n{4 * own:,} B",
                color="#B07A00",
            )
    elif strategy == "same_seed":
        g.node("seed", "manual_seed(s)\\non every rank", fillcolor="#FCE8B2", ordering="out")
        for s, first in enumerate(firsts):
            g.edge("seed", first, lhead=f"cluster_stage_{s}", color="#B07A00")
        red = {"color": "red", "fontcolor": "red", "style": "dashed", "constraint": "false"}
        if stages > 1:  # stage 1 reads the stream from its start, as stage 0 did for tok_emb
            label = "stage 1's first draws\\n= stage 0's first draws"
            g.edge(firsts[0], first_layers[1], label=label, **red)
        for s in range(2, stages):  # no embeddings: they all start their first layer alike
            g.edge(first_layers[1], first_layers[s], label="identical", dir="none", **red)
    elif strategy == "per_stage_seed":
        g.node(
            "seeds",
            f"rank 0: {stages} seeds drawn\\nfrom manual_seed(s)",
            fillcolor="#FCE8B2",
            ordering="out",
        )
        for s, first in enumerate(firsts):
            g.edge(
                "seeds",
                first,
                lhead=f"cluster_stage_{s}",
                label=f"broadcast: seed {s}\\n(8 B of {8 * stages})",
                color="#B07A00",
            )
    else:
        stage_of = stage_of_module(config, stages, layers_per_stage)
        state_bytes = torch.get_rng_state().numel()
        g.node("seed", "manual_seed(s)\\non the first owner", fillcolor="#FCE8B2", ordering="out")
        for first in firsts:  # invisible: they only keep the stages in order, left to right
            g.edge("seed", first, style="invis")
        g.edge("seed", _top(order[0]), label=f"draws {order[0]} first", color="#B07A00")
        k = 0
        for prev, name in zip(order, order[1:], strict=False):
            if stage_of(prev) != stage_of(name):
                k += 1
                g.edge(
                    _top(prev),
                    _top(name),
                    label=f"handoff {k}: generator state\\n({state_bytes:,} B on CPU)",
                    color=HANDOFF_COLOR,
                    fontcolor=HANDOFF_COLOR,
                    penwidth="2",
                    constraint="false",
                )
    return Diagram(g.source)
