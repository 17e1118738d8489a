"""The root-unit spike of lab 03: what leaving a tied embedding/head to the root unit costs.

[Note: the root-unit spike] Left to the root unit, the tied V x d matrix is gathered when the
forward starts and stays until the backward ends: it sits in memory while every block runs.
(Like FSDP2, the spike's `shard` keeps the root unit after forward: its backward comes next.)
As our joint unit `("tok_emb", "head")` it is gathered for the embedding, freed, and gathered
again for the head (our prefetch fetches it during the last block). FSDP2's group
``fully_shard([model.tok_emb, model.head])`` frees only after its last module has run, so it
holds the matrix through the blocks too, and differs from the root unit after forward. The
*peak* need not change: the head needs the full matrix either way, and in backward its
gradient is held too. What changes is the memory under the peak — the lab measures where.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab import reference
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank, world_size
from fsdp_lab.labs.tying_config import TyingConfig
from fsdp_lab.models import tiny_gpt
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.trace import MemoryTracker, mark
from fsdp_lab.wrap import build_plan

WRAPPINGS = ("root_unit", "joint_unit")
SYSTEMS = ("fsdp_lab", "fsdp2")
PHASES = {  # what the spike records per rank -> how the summary says it
    "peak_bytes": "peak",
    "blocks_start_bytes": "when the blocks start",
    "blocks_max_bytes": "most while the blocks run",
    "end_of_forward_bytes": "end of forward",
}


def plans(layers: int) -> dict[str, list]:
    """The lab's wrap plans as JSON (a list inside the list is one unit of several modules)."""
    blocks = [f"blocks.{i}" for i in range(layers)]
    return {
        "root_unit": blocks,  # valid: the tied pair is left to the root unit
        "joint_unit": [*blocks, ["tok_emb", "head"]],  # valid: the tied pair is one unit
        "split_tie": ["head"],  # invalid: head in a unit, the embedding in the root
    }


def as_units(spec: list) -> list:
    """A JSON plan -> the `units` argument of `shard` / `build_plan` / `wrap_diagram`."""
    return [tuple(u) if isinstance(u, list) else u for u in spec]


# -- measuring ---------------------------------------------------------------------


def _wrap(model: torch.nn.Module, system: str, wrapping: str, layers: int) -> None:
    if system == "fsdp_lab":
        plan = build_plan(model, as_units(plans(layers)[wrapping]))
        # Like FSDP2, the root unit is not freed after forward: its backward comes right next.
        shard(model, units=plan, strategy="full", reshard_after_forward=plan.units[1:])
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    if wrapping == "joint_unit":
        fully_shard([model.tok_emb, model.head], mesh=mesh)
    fully_shard(model, mesh=mesh)


def spike_worker(config: TyingConfig, system: str, wrapping: str) -> dict[str, Any]:
    """On every rank: wrap the large-vocabulary TinyGPT, train `spike_steps` steps, traced."""
    model = tiny_gpt(**config.gpt()).to(device())
    _wrap(model, system, wrapping, config.layers)
    # Registered after wrapping: "embedding done" comes after a joint unit is freed, and
    # (prepended) "head start" before it is gathered again — the window where the blocks run.
    model.tok_emb.register_forward_hook(lambda *_: mark("embedding done"))
    model.head.register_forward_pre_hook(lambda *_: mark("head start"), prepend=True)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    with MemoryTracker(device(), rank=rank()) as mem:
        mem.track(model)
        mem.track(opt)
        if system == "fsdp_lab":  # its resize_ (gather/free) is seen only on a tracked buffer
            for unit in sharding_state(model).units:
                mem.track(unit.flat.unsharded, "comm_buffers")
        mem.mark("wrapped")
        reference.train_steps(
            model,
            opt,
            config.spike_steps,
            global_batch=config.batch * world_size(),
            seq_len=config.seq_len,
            rank=rank(),
            world=world_size(),
            device=device(),
        )
    trace = mem.trace()
    return {"trace": trace, **phase_bytes(trace, config.spike_steps - 1)}


def phase_bytes(trace: dict[str, Any], step: int) -> dict[str, Any]:
    """Peak (and the markers around it); in `step`: bytes when the blocks start, the most
    while they run (from the embedding's end to the head's start), at the end of forward."""

    def at(label: str, after: float = -1.0) -> dict[str, Any]:
        return next(m for m in trace["markers"] if m["label"] == label and m["t"] > after)

    forward_done = at(f"step {step} forward done")
    start = at(f"step {step - 1} optimizer step")["t"] if step else -1.0
    first, last = at("embedding done", start), at("head start", start)["t"]
    samples = list(zip(trace["t"], trace["total"], strict=True))
    window = [b for t, b in samples if first["t"] <= t <= last]
    t_peak = max(samples, key=lambda s: s[1])[0]  # CPU: the peak itself; CUDA: the highest sample
    before = [m["label"] for m in trace["markers"] if m["t"] <= t_peak]
    after = [m["label"] for m in trace["markers"] if m["t"] > t_peak]
    return {
        "peak_between": [before[-1] if before else "start", after[0] if after else "end"],
        "peak_bytes": trace["peak_bytes"],
        "blocks_start_bytes": first["total"],
        "blocks_max_bytes": max(window),
        "end_of_forward_bytes": forward_done["total"],
    }


def measure_spike(config: TyingConfig, cluster: Cluster | AttachedCluster) -> dict[str, Any]:
    systems = SYSTEMS if config.compare_fsdp2 else SYSTEMS[:1]
    runs = {s: {w: cluster.run(spike_worker, config, s, w) for w in WRAPPINGS} for s in systems}
    out: dict[str, Any] = {
        "model": config.gpt(),
        "batch_per_rank": config.batch,
        "steps": config.spike_steps,
        "tied_matrix_bytes": config.vocab * config.dim * 4,  # fp32
    }
    for system, by_wrapping in runs.items():
        out[system] = {
            w: {key: [r[key] for r in ranks] for key in (*PHASES, "peak_between")}
            | {"traces": [r["trace"] for r in ranks]}
            for w, ranks in by_wrapping.items()
        }
        prefix = "" if system == "fsdp_lab" else "fsdp2_"
        for w in WRAPPINGS:
            out[f"{prefix}peak_bytes_{w}"] = out[system][w]["peak_bytes"]
    return out


SYSTEM_NAMES = {"fsdp_lab": "fsdp_lab shard", "fsdp2": "FSDP2 fully_shard"}


def spike_bars(spike: dict[str, Any]) -> Any:
    """Rank 0's figures per system, root unit beside joint unit."""
    from matplotlib.figure import Figure

    systems = [s for s in SYSTEMS if s in spike]
    fig = Figure(figsize=(6.5 * len(systems), 4), layout="constrained")
    for ax, system in zip(fig.subplots(1, len(systems), squeeze=False)[0], systems, strict=True):
        for j, (w, color) in enumerate(zip(WRAPPINGS, ("#C44E52", "#4C72B0"), strict=True)):
            heights = [spike[system][w][k][0] / 2**20 for k in PHASES]
            bars = ax.bar(
                [i + 0.4 * j for i in range(len(PHASES))], heights, 0.4, label=w, color=color
            )
            ax.bar_label(bars, [f"{h:.1f}" for h in heights], fontsize=7)
        names = [
            p.replace("the blocks", "blocks").replace("most while", "most while\n")
            for p in PHASES.values()
        ]
        ax.set_xticks([i + 0.2 for i in range(len(PHASES))], names, fontsize=8)
        ax.set_ylabel("MiB (rank 0)")
        ax.set_title(SYSTEM_NAMES[system], fontsize=10)
        ax.legend(fontsize=8)
    return fig


def verdict(root: int, joint: int) -> str:
    from fsdp_lab.sizes import format_bytes

    if root == joint:
        return f"equal ({format_bytes(root)})"
    higher = "root unit" if root > joint else "joint unit"
    return (
        f"{higher} higher by {format_bytes(abs(root - joint))} "
        f"(root {format_bytes(root)}, joint {format_bytes(joint)})"
    )
