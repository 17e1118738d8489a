"""A plan beside a measurement of it: the fake rank that simulates it (`fake_run`), and each
planned figure set beside the measured one with their relative difference (`compare`) — for a
fake rank (`fake_ranks`) and for real ranks here (`twin`) alike.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab import netsim


def fake_run(planned: dict[str, Any]) -> Any:
    """The `fake_ranks.Run` that simulates rank 0 of `planned`'s world."""
    from fsdp_lab.planning.fake_ranks import Run

    return Run(
        model=planned["model"],
        world=planned["gpus"],
        strategy=planned["shard_strategy"],
        mesh=tuple(planned["mesh"]) if planned["mesh"] else None,
        precision=planned["precision"],
        checkpoint=planned["checkpoint"],
        seq=planned["seq"],
        micro_batch=planned["micro_batch"],
        grad_accumulation=planned["grad_accumulation"],
    )


def compare(predicted: dict[str, Any], measured: dict[str, Any]) -> dict:
    """The fake rank's measurement beside the plan: per category, total and bytes per
    collective, each with its relative difference (measured − planned) / planned."""
    peak = measured["peak_by_category"]
    got = {
        "parameters": peak["parameters"],
        "gradients": peak["gradients"],
        "optimizer_state": peak["optimizer_state"],
        "gathered": peak["comm_buffers"],
        "activations": peak["activations"],
        "other": peak["other"],
    }
    got["total"] = measured["peak_bytes"]
    plan_bytes = predicted["per_rank_bytes"]
    by_link = netsim.bytes_by_link(
        (
            ([int(r) for r in label.removeprefix("ranks ").split(",")], sum(ops.values()))
            for label, ops in measured["comm_bytes_per_step_by_group"].items()
        ),
        predicted["gpus_per_node"],
    )
    comm = {"by_collective": measured["comm_bytes_per_step"], "by_link": by_link}
    return {
        "per_rank_bytes": got,
        "per_rank_bytes_rel_diff": {k: _rel(got[k], plan_bytes.get(k, 0.0)) for k in plan_bytes},
        "comm_bytes_per_rank": comm,
        "comm_bytes_rel_diff": {
            op: _rel(comm["by_collective"].get(op, 0.0), b)
            for op, b in predicted["comm_bytes_per_rank"]["by_collective"].items()
        },
        "wall_s": measured.get("wall_s"),
        "peak_rss_bytes": measured.get("peak_rss_bytes"),
        "how": "one rank of the world under PyTorch's fake process group and FakeTensorMode: "
        "fsdp_lab.shard at full size, two Adam steps, MemoryTracker and comm.CommLog",
    }


def _rel(measured: float, planned: float | None) -> float | None:
    if planned is None or planned == 0:
        return None if measured else 0.0
    return (measured - planned) / planned
