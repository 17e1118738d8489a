"""Lab 04, part 2 — is the materialised model right? Ties, buffers, and ranks that agree.

A model materialised from meta on N ranks is only the model if its ties hold (`tie_worker`:
`shard` re-ties what it materialises and refuses what `to_empty` untied), its buffers are
computed (the rotary cache, compared with an ordinary build's), and the ranks agree on its
values. Two ways to agree, measured side by side on the same Llama at several sizes:

    sync_module_states (FSDP1's flag)            deterministic slices (`DeterministicInit`)
    rank 0: to_empty a unit, torch's init,       every rank: allocate its shard, fill it with
            broadcast it (params + buffers)      values(name, shape, start, end) — element i of
    others: receive, keep their slice            a parameter is a function of (seed, name, i)
    bytes per rank: the whole model, once        bytes: none

Each rank seeds torch's generator differently first (seed + 1000 x rank): only the mechanism
can make them agree. Each result is compared bitwise (`torch.equal`, every parameter gathered
with `reference.full_parameters`) with a single process built the same way: for the broadcast,
``manual_seed(seed); materialize(meta_model, units)``; for the slices,
``DeterministicInit(seed).init_module_(model)``. A control run — no broadcast, different seeds —
shows that the check does catch ranks that disagree.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import torch

from fsdp_lab import comm, reference
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    device,
    rank,
    rank_threads,
)
from fsdp_lab.meta_init import DeterministicInit
from fsdp_lab.models import Llama, LlamaConfig, lab_llama, lab_units, llama_bytes
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.materialize import materialize
from fsdp_lab.tying import record_ties, retie, verify_weight_tying

APPROACHES = {
    "sync_module_states": "rank 0 initialises each unit, broadcasts it",
    "deterministic": "each rank computes its slice (DeterministicInit)",
}
MiB = 2**20
CONTROL = "unsynced"  # ordinary init, every rank its own seed, no broadcast: must disagree

# -- on every rank --------------------------------------------------------------------------------


def agree_worker(llama: dict[str, Any], approach: str, seed: int) -> dict[str, Any]:
    """Shard a meta-built Llama with `approach`; time it, count its bytes, gather the result.

    Rank 0 returns the full parameters and buffers (to compare with a single process).
    """
    config = LlamaConfig(**llama)
    with torch.device("meta"):
        model = Llama(config)
    torch.manual_seed(seed + 1000 * rank())  # a different stream on every rank
    if approach == "sync_module_states":
        kwargs: dict[str, Any] = {"sync_module_states": True}
    elif approach == "deterministic":
        kwargs = {"shard_init": DeterministicInit(seed)}
    else:  # the control: ordinary init per unit, nothing to make the ranks agree
        kwargs = {}
    comm.all_reduce(torch.zeros(1, device=device()))  # line the ranks up: one start for all
    with rank_threads(), comm.CommLog() as log:
        start = time.perf_counter()
        shard(model, units=lab_units(config), **kwargs)
        seconds = time.perf_counter() - start
    params = reference.full_parameters(model)  # all-gathers: every rank's shard goes in
    buffers = {k: b.detach().cpu().clone() for k, b in model.named_buffers()}
    first = rank() == 0
    return {
        "time_s": seconds,
        "bytes_moved": sum(log.bytes_by_op().values()),
        "bytes_by_op": log.bytes_by_op(),
        "comm_time_s": sum(r.end - r.start for r in log.records),  # inside the collectives
        "params": params if first else None,
        "buffers": buffers if first else None,
    }


def tie_worker(seed: int) -> dict[str, Any]:
    """On every rank: a tied Llama through `shard` both ways; then one untied by `to_empty`."""
    config = LlamaConfig(tie_embeddings=True)
    out: dict[str, Any] = {}
    for path, init in (
        ("param_init_fn", {}),
        ("shard_init", {"shard_init": DeterministicInit(seed)}),
    ):
        with torch.device("meta"):
            model = Llama(config)
        tied_on_meta = model.output.weight is model.tok_embeddings.weight
        shard(model, units=lab_units(config), device=device(), **init)
        full = reference.full_parameters(model)
        out[path] = {
            "tied_on_meta": tied_on_meta,
            "problems_after_shard": verify_weight_tying(model),
            "output_equals_embedding": torch.equal(
                full["output.weight"], full["tok_embeddings.weight"]
            ),
        }
    with torch.device("meta"):
        model = Llama(config)
    ties = record_ties(model)
    model.to_empty(device=device())  # no retie: each owner gets its own new Parameter
    out["to_empty"] = {
        "tied_after_to_empty": model.output.weight is model.tok_embeddings.weight,
        "problems": verify_weight_tying(model, ties),
    }
    try:
        shard(model, units=lab_units(config))
        out["to_empty"] |= {"shard_refused": False, "shard_error": None}
    except ValueError as exc:
        out["to_empty"] |= {"shard_refused": True, "shard_error": str(exc)}
    return out


# -- in this process: the single-process references ----------------------------------------------


def reference_parameters(
    config: LlamaConfig, approach: str, seed: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One process, no communication, the same scheme: what the ranks must reproduce bitwise.

    `device`: the ranks' device type (torch's init draws from another generator on CUDA).
    """
    with torch.device("meta"):
        model = Llama(config)
    if approach == "deterministic":
        ties = record_ties(model)
        model.to_empty(device=device)
        retie(model, ties)
        DeterministicInit(seed).init_module_(model)
    else:  # sync_module_states (and the control): rank 0's init, unit by unit, in plan order
        with torch.random.fork_rng(devices=[0] if device == "cuda" else []):
            torch.manual_seed(seed)
            materialize(model, lab_units(config), device=device)
    return {k: p.detach().cpu() for k, p in model.named_parameters(remove_duplicate=False)}


def ordinary_buffers(config: LlamaConfig, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The buffers (rotary cache) of a Llama built the ordinary way on `device`."""
    with torch.random.fork_rng(devices=[0] if device == "cuda" else []), torch.device(device):
        model = Llama(config)
    return {k: b.detach().cpu() for k, b in model.named_buffers()}


def mismatches(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or are missing on either side)."""
    names = sorted(set(got) | set(expected))
    return [
        k
        for k in names
        if k not in got or k not in expected or not torch.equal(got[k], expected[k])
    ]


def measure_size(
    model_mb: int, seed: int, cluster: Cluster | AttachedCluster, control: bool = False
) -> dict[str, Any]:
    """Both approaches (and the control) on `lab_llama(model_mb)`: one row of the table."""
    config = lab_llama(model_mb)
    sizes = llama_bytes(config)
    row: dict[str, Any] = {"model_mb": model_mb, "model": asdict(config), **sizes}
    on = "cuda" if cluster.backend == "nccl" else "cpu"  # references where the ranks computed
    buffers = ordinary_buffers(config, on)
    for approach in (*APPROACHES, CONTROL) if control else APPROACHES:
        ranks = cluster.run(agree_worker, asdict(config), approach, seed)
        expected = reference_parameters(config, approach, seed, on)
        wrong = mismatches(ranks[0]["params"], expected)
        n = len(ranks)
        row[approach] = {
            "time_s": max(r["time_s"] for r in ranks),
            "time_s_per_rank": [r["time_s"] for r in ranks],
            "bytes_moved": ranks[0]["bytes_moved"],
            "bytes_moved_per_rank": [r["bytes_moved"] for r in ranks],
            "bytes_by_op": ranks[0]["bytes_by_op"],
            "comm_time_s_per_rank": [r["comm_time_s"] for r in ranks],
            # Broadcast, ring convention: every rank moves the tensor once (nothing alone).
            "theory_bytes_moved": (
                sizes["parameter_bytes"] + sizes["buffer_bytes"]
                if approach == "sync_module_states" and n > 1
                else 0
            ),
            "bitwise_equal_to_reference": not wrong,
            "mismatched_parameters": wrong,
            "buffers_equal_to_ordinary": not mismatches(ranks[0]["buffers"], buffers),
        }
    return row


def measure_agreement(
    sizes_mb: tuple[int, ...], seed: int, cluster: Cluster | AttachedCluster
) -> dict[str, Any]:
    """The table (one row per size, the control at the smallest) and one entry per approach."""
    rows = [measure_size(mb, seed, cluster, control=i == 0) for i, mb in enumerate(sizes_mb)]
    approaches = {}
    for approach, how in APPROACHES.items():
        last = rows[-1][approach]
        approaches[approach] = {
            "how": how,
            "model_mb": rows[-1]["model_mb"],  # bytes_moved and time_s: the largest size
            "bytes_moved": last["bytes_moved"],
            "theory_bytes_moved": last["theory_bytes_moved"],
            "time_s": last["time_s"],
            "bitwise_equal_to_reference": all(
                r[approach]["bitwise_equal_to_reference"] for r in rows
            ),
            "buffers_equal_to_ordinary": all(
                r[approach]["buffers_equal_to_ordinary"] for r in rows
            ),
        }
    return {"rows": rows, "approaches": approaches, "control": rows[0][CONTROL]}


# -- pictures -------------------------------------------------------------------------------------


def agreement_figure(rows: list[dict[str, Any]]) -> Any:
    """Start-up time and bytes moved per rank against model size, one line per approach."""
    from matplotlib.figure import Figure

    from fsdp_lab.sizes import format_bytes

    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_time, ax_bytes = fig.subplots(1, 2)
    x = [r["parameter_bytes"] / MiB for r in rows]
    for approach, color in zip(APPROACHES, ("#C44E52", "#4C72B0"), strict=True):
        ax_time.plot(x, [r[approach]["time_s"] for r in rows], "o-", color=color, label=approach)
        moved = [r[approach]["bytes_moved"] / MiB for r in rows]
        ax_bytes.plot(x, moved, "o-", color=color, label=f"{approach} (measured)")
    theory = [r["sync_module_states"]["theory_bytes_moved"] / MiB for r in rows]
    ax_bytes.plot(x, theory, ":", color="black", lw=1.5, label="theory: parameters + buffers")
    for r, xi in zip(rows, x, strict=True):
        ax_bytes.annotate(
            format_bytes(r["sync_module_states"]["bytes_moved"]),
            (xi, r["sync_module_states"]["bytes_moved"] / MiB),
            textcoords="offset points",
            xytext=(0, 6),
            ha="center",
            fontsize=7,
        )
    ax_time.set_ylabel("shard() time, slowest rank (s)")
    ax_bytes.set_ylabel("bytes moved per rank (MiB)")
    for ax in (ax_time, ax_bytes):
        ax.set_xlabel("model parameters (MiB, fp32)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax_time.set_title("time to a sharded, initialised model", fontsize=10)
    ax_bytes.set_title("communication to make the ranks agree", fontsize=10)
    return fig


def agreement_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: per size and approach, time, bytes moved (theory), bitwise and buffer checks."""
    from fsdp_lab.sizes import format_bytes as fb

    lines = [
        "| parameters | approach | time (slowest rank) | rank 0 in collectives "
        "| bytes moved per rank (theory) | bitwise = reference | buffers = ordinary |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        for a in APPROACHES:
            r = row[a]
            lines.append(
                f"| {fb(row['parameter_bytes'])} | {a} | {r['time_s']:.3f} s "
                f"| {r['comm_time_s_per_rank'][0]:.3f} s "
                f"| {fb(r['bytes_moved'])} ({fb(r['theory_bytes_moved'])}) "
                f"| {r['bitwise_equal_to_reference']} | {r['buffers_equal_to_ordinary']} |"
            )
    return "\n".join(lines)


def agreement_notes(control: dict[str, Any], kaiming: dict[str, Any]) -> str:
    """The control run and `kaiming_on_a_shard_differs`'s numbers, one line each."""
    k, alone = kaiming, len(control["time_s_per_rank"]) == 1
    return "\n".join(
        [
            f"- control ({CONTROL}: ordinary init, a different seed per rank, no broadcast): "
            f"bitwise equal {control['bitwise_equal_to_reference']}, "
            f"{len(control['mismatched_parameters'])} parameters differ"
            + (" (one rank: no other stream to disagree with)" if alone else ""),
            f"- kaiming_uniform_ on row shards of {k['shape']} over {k['world_size']} ranks: "
            f"equal to their own rows {k['row_shards_equal_own_rows']}, to the first rows "
            f"{k['row_shards_equal_first_rows']}; a column shard's bound "
            f"{k['bound_column_shard']:.4f} vs {k['bound_full']:.4f}; DeterministicInit's "
            f"slices equal its full tensor: {k['deterministic_slices_equal_full']}",
        ]
    )
