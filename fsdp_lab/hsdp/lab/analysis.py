"""Lab 06, the verdicts: does HSDP train like one process and like PyTorch's HSDP; do its bytes
per group and op, and its model state per rank, equal `theory.hybrid_step`; what crosses a
node's NIC; what the capacity argument and the network model say for a real model.

Pure functions of what `measure.py` brought back; no rank is needed to run or test them.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from fsdp_lab import netsim, theory
from fsdp_lab.hsdp.lab.config import NODES, SYSTEMS, HsdpConfig
from fsdp_lab.hsdp.lab.measure import TWINS
from fsdp_lab.reference import max_abs_diff
from fsdp_lab.sharding.lab.analysis import model_state_bytes, same_bytes


def _nonzero(by_group: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """Groups and ops that moved bytes: one rank (or a one-rank group) sends nothing, and
    whether it makes a 0-byte call is not what the formulas count."""
    kept = {g: {op: b for op, b in ops.items() if b} for g, ops in by_group.items()}
    return {g: ops for g, ops in kept.items() if ops}


def _same(
    measured: dict[str, dict[str, float]], formula_bytes: dict[str, dict[str, float]]
) -> bool:
    """Every group's bytes per op equal the formula's (ops and groups of 0 bytes aside)."""
    m, t = _nonzero(measured), _nonzero(formula_bytes)
    return set(m) == set(t) and all(same_bytes(m[g], t[g]) for g in t)


def formula(
    system: str, units: list[dict[str, Any]], mesh: tuple[int, int], precision: Any
) -> dict:
    """`theory`'s bytes per step by group kind, and peak model state, of one system."""
    if system == "full":
        step = theory.sharding_step("full", units, mesh[0] * mesh[1], precision)
        return {"comm_bytes": {"world": step["comm_bytes"]}, "peak": step["peak_model_state_bytes"]}
    step = theory.hybrid_step(system, units, mesh, precision)
    comm_bytes = {g: ops for g, ops in step["comm_bytes"].items() if ops}
    return {"comm_bytes": comm_bytes, "peak": step["peak_model_state_bytes"]}


def node_nic_bytes(
    system: str, per_rank: dict[str, dict[str, float]], mesh: tuple[int, int]
) -> float:
    """Bytes per step through one node's NIC, a node being one shard group (S ranks), from one
    rank's measured bytes by the network model's ring rule (`netsim.node_nic_bytes`)."""
    r, s = mesh
    if system == "full":  # one world group: netsim's mesh (1, N), every rank in the "shard"
        return netsim.node_nic_bytes({"shard": per_rank.get("world", {})}, (1, r * s), s)
    return netsim.node_nic_bytes(per_rank, mesh, s)


def capacity(params: float, vram_bytes: float, gpus: int, s: int) -> dict[str, Any]:
    """The capacity argument in numbers (mixed-precision Adam, 16 bytes of model state per
    parameter): per-GPU model state of full FSDP over `gpus` GPUs vs HSDP sharded over a node
    of `s`, and the largest model each fits — N×VRAM vs S×VRAM."""
    k = theory.MIXED_ADAM
    per_param = k.p + k.g + k.k
    return {
        "params": params,
        "vram_bytes": vram_bytes,
        "gpus": gpus,
        "shard_group": s,
        "bytes_per_parameter": per_param,
        "per_gpu_full": theory.model_state_bytes(params, gpus, "full", k),
        "per_gpu_hybrid": theory.model_state_bytes(params, s, "full", k),
        "largest_params_full": gpus * vram_bytes / per_param,
        "largest_params_hybrid": s * vram_bytes / per_param,
    }


def network_model(
    params_b: float,
    inter_node_gbit: float,
    gpus_per_node: int = 8,
    overlap: float = 1.0,
    shard: int | None = None,
    intra_gb_s: float = 450.0,
    nodes: tuple[int, ...] = NODES,
) -> dict[str, Any]:
    """`netsim.scaling` for FSDP and HSDP at `nodes`, with the workload and network it used."""
    workload = netsim.Workload(parameters=params_b * 1e9, overlap=overlap)
    network = netsim.Network(gpus_per_node=gpus_per_node, intra_bandwidth=intra_gb_s * 1e9)
    network = netsim.with_bandwidth(network, inter_node_gbit)
    return {
        "workload": asdict(workload),
        "network": asdict(network),
        "nodes": list(nodes),
        "shard": shard or gpus_per_node,
        "scaling": netsim.scaling(workload, network, list(nodes), shard),
    }


def checkpoints(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Per system: the rank files written and their bytes (rank 0's listing), whether every
    rank reloaded the saved values bitwise, and the control (the step after the save moved
    them)."""
    out = {}
    for system, ranks in runs.items():
        files = ranks[0]["files"]
        shards = {f: b for f, b in files.items() if f.endswith(".pt")}
        out[system] = {
            "rank_files": len(shards),
            "rank_file_bytes": sum(shards.values()),
            "files": sorted(files),
            "bitwise_after_reload": all(r["diff_after_reload"] == 0.0 for r in ranks),
            "moved_after_save": min(r["moved_after_save"] for r in ranks),
        }
    return out


def emulated(raw: dict[str, Any], mesh: tuple[int, int]) -> dict[str, Any]:
    """The emulated nodes' measured step times beside `netsim`'s prediction for the link as
    measured (bandwidth and latency inside a node and across), the model's parameters and
    units, and the measured compute time, with no overlap (prefetch on 2 CPU cores hides little:
    compute and communication share the cores)."""
    if "skipped" in raw:
        return raw
    ranks = raw["ranks"]
    inter = next(r["inter"] for r in ranks if r["inter"])
    intra = next(r["intra"] for r in ranks if r["intra"])
    compute = max(statistics.median(r["compute_s"]) for r in ranks)  # the slowest rank
    r, s = mesh
    network = netsim.Network(
        gpus_per_node=s,
        intra_bandwidth=intra["bandwidth"],
        intra_latency=intra["latency"],
        inter_bandwidth=inter["bandwidth"],
        inter_latency=inter["latency"],
    )
    out: dict[str, Any] = {
        "rate": raw["rate"],
        "netem": raw["netem"],
        "probe_bytes": raw["probe_bytes"],
        "model": raw["model"],
        "link": {"inter": inter, "intra": intra},
        "compute_s": compute,
    }
    for system, model_system in (("full", "fsdp"), ("hybrid", "hsdp")):
        row = ranks[0][system]
        tokens = 4 * raw["model"]["seq_len"]  # 4 sequences per rank
        workload = netsim.Workload(
            parameters=row["parameters"],
            bytes_per_parameter=4,
            tokens_per_gpu=tokens,
            tflops=6 * row["parameters"] * tokens / compute / 1e12,  # compute_s = measured
            overlap=0.0,
            units=row["units"],
        )
        predicted = netsim.predict(model_system, r * s, workload, network, shard=s)
        measured = max(statistics.median(rank[system]["step_s"]) for rank in ranks)
        out[system] = {
            "parameters": row["parameters"],
            "measured_step_s": measured,
            "predicted_step_s": predicted["step_s"],
            "predicted_comm_s": predicted["comm_s"],
            "predicted_node_nic_bytes": predicted["node_nic_bytes"],
            "measured_bytes_per_rank": row["bytes_per_step"],
        }
    return out


def analyse(config: HsdpConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The runs' raw results -> the lab's result (JSON types only)."""
    mesh, ours, single = config.mesh, measured["ours"], measured["single_process"]
    precision = theory.FP32_ADAM if config.optimizer == "adam" else theory.FP32_SGD
    systems: dict[str, Any] = {}
    for system in SYSTEMS:
        runs = ours[system]
        f = formula(system, runs[0]["units"], mesh, precision)
        by_group = [r["comm_bytes_per_step_by_group"] for r in runs]
        systems[system] = {
            "comm_bytes_per_rank": by_group,
            "theory_comm_bytes": f["comm_bytes"],
            "comm_matches_theory": all(_same(g, f["comm_bytes"]) for g in by_group),
            "peak_model_state_bytes_per_rank": [
                max(model_state_bytes(r["memory_trace"])) for r in runs
            ],
            "theory_peak_bytes": f["peak"],
            "node_nic_bytes_per_step": node_nic_bytes(system, by_group[0], mesh),
            "max_abs_diff_vs_single_process": max_abs_diff(runs[0]["params"], single),
            "units": runs[0]["units"],
        }
    twins = measured["pytorch"]
    from_single = {t: max_abs_diff(p, single) for t, p in twins.items()}
    versus = {
        twin: max_abs_diff(ours[ours_system][0]["params"], twins[twin])
        for twin, ours_system in TWINS.items()
        if twin in twins
    }
    nodes_gpus = 16 * config.gpus_per_node  # the capacity argument on 16 nodes
    hybrid = systems["hybrid"]
    return {
        "config": {**asdict(config), "mesh": list(mesh)},
        "mesh": list(mesh),
        "world_size": mesh[0] * mesh[1],
        "backend": measured["backend"],
        "systems": systems,
        "comm_bytes_per_rank": hybrid["comm_bytes_per_rank"],
        "theory_comm_bytes": hybrid["theory_comm_bytes"],
        "peak_bytes_per_rank": {s: systems[s]["peak_model_state_bytes_per_rank"] for s in SYSTEMS},
        "max_abs_diff_vs_single_process": hybrid["max_abs_diff_vs_single_process"],
        "max_abs_diff_vs_fsdp2": versus.get("fully_shard"),
        "max_abs_diff_vs_pytorch": versus,
        "pytorch_max_abs_diff_vs_single_process": from_single,
        # PyTorch's twins that leave single-process training where ours does not (the lab
        # names them; e.g. FSDP1's HYBRID_SHARD with one rank per node, which becomes NO_SHARD
        # over that one rank and never all-reduces across the replicas).
        "pytorch_departs": sorted(
            t
            for t, d in from_single.items()
            if d > 1e3 * max(hybrid["max_abs_diff_vs_single_process"], 1e-7)
        ),
        "checkpoint": checkpoints(measured["checkpoint"]),
        "capacity": capacity(
            config.params_b * 1e9, config.vram_gb * 1e9, nodes_gpus, config.gpus_per_node
        ),
        "network_model": network_model(
            config.params_b, config.inter_node_gbit, config.gpus_per_node, config.overlap
        ),
        "emulated": emulated(measured["emulated"], mesh),
    }
