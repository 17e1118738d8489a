"""Lab 04, the verdicts: the ranks' measurements regrouped per mode and per approach, beside the
formulas of `fsdp_lab.theory` (model state per ZeRO stage, peak bytes while materialising, the
bytes of ``sync_module_states``), and the parent-init ways against one process. Pure functions
of plain data: no torch, no ranks."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fsdp_lab import theory
from fsdp_lab.meta_init.lab.config import APPROACHES, CONTROL, MODES, PARENT_INIT, MetaInitConfig

WORLD_SIZES_70B = (1, 8, 64, 512)  # the 70B model state is tabled for these ranks


def materialisation(measured: dict[str, Any]) -> dict[str, Any]:
    """The host-memory picture: per mode, every rank's figures as lists; beside them the theory
    of tensor bytes per rank (buffers and padding aside)."""
    memory = {k: v for k, v in measured.items() if k != "runs"}
    n = len(measured["runs"]["ordinary"])
    full, largest = memory["full_model_bytes"], memory["largest_unit_bytes"]
    memory["theory_peak_bytes"] = theory.materialise_peak_bytes(full, largest, n)
    memory["modes"] = {
        mode: {"how": MODES[mode], **{key: [r[key] for r in ranks] for key in ranks[0]}}
        for mode, ranks in measured["runs"].items()
    }
    return memory


def agreement_row(measured: dict[str, Any]) -> dict[str, Any]:
    """One model size: per approach, time (the slowest rank: the model is ready when it is),
    bytes moved against theory, and the bitwise verdicts."""
    row = {k: v for k, v in measured.items() if k != "runs"}
    for approach, run in measured["runs"].items():
        ranks = run["per_rank"]
        model = theory.sync_module_states_bytes(
            row["parameter_bytes"], row["buffer_bytes"], len(ranks)
        )
        row[approach] = {
            "time_s": max(r["time_s"] for r in ranks),
            "bytes_moved": ranks[0]["bytes_moved"],
            "bytes_by_op": ranks[0]["bytes_by_op"],
            **{
                f"{k}_per_rank": [r[k] for r in ranks]
                for k in ("time_s", "bytes_moved", "comm_time_s")
            },
            # Only the broadcast moves anything: the slices and the control move nothing.
            "theory_bytes_moved": model if approach == "sync_module_states" else 0,
            "bitwise_equal_to_reference": not run["mismatched_parameters"],
            "parameter_names": run.get("parameter_names"),  # how many were compared
            "mismatched_parameters": run["mismatched_parameters"],
            "buffers_equal_to_ordinary": not run["mismatched_buffers"],
        }
    return row


def agreement(measured: list[dict[str, Any]]) -> dict[str, Any]:
    """The table (one row per size), one entry per approach (its figures: the largest size's;
    its verdicts: every size's), and the control (run at the smallest size)."""
    rows = [agreement_row(m) for m in measured]
    approaches = {
        approach: {
            "how": how,
            "model_mb": rows[-1]["model_mb"],
            **{k: rows[-1][approach][k] for k in ("bytes_moved", "theory_bytes_moved", "time_s")},
            **{
                verdict: all(r[approach][verdict] for r in rows)
                for verdict in ("bitwise_equal_to_reference", "buffers_equal_to_ordinary")
            },
        }
        for approach, how in APPROACHES.items()
    }
    return {"rows": rows, "approaches": approaches, "control": rows[0][CONTROL]}


def parent_init(measured: dict[str, Any]) -> dict[str, Any]:
    """Per `PARENT_INIT` way: the names that differ from one process on any rank, and whether
    every rank matched it bitwise."""
    out = {}
    for how, m in measured.items():
        per_rank = m["mismatched_per_rank"]
        mismatched = sorted({name for names in per_rank for name in names})
        out[how] = {
            "how": PARENT_INIT[how],
            "parameter_names": m["parameter_names"],
            "mismatched": mismatched,
            "ranks_that_differ": [r for r, names in enumerate(per_rank) if names],
            "bitwise_equal_to_one_process": not mismatched,
        }
    return out


def analyse(config: MetaInitConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The lab's result (JSON types only); its top-level keys are the issue's headline figures."""
    seventy = measured["seventy_b"]
    if seventy:  # what the measured parameter count costs per rank, per ZeRO stage
        params = seventy["summary"]["parameters"]
        costs = {str(n): theory.zero_table(params, n) for n in WORLD_SIZES_70B}
        seventy = {**seventy, "per_rank_model_state_bytes": costs}
    memory = materialisation(measured["materialise"])
    agree = agreement(measured["agreement"])
    n = measured["world_size"]
    return {
        "config": {**asdict(config), "world_size": n},
        "world_size": n,
        "backend": measured["backend"],
        "build_time_s_70b": seventy["build_time_s"] if seventy else None,
        "rss_growth_bytes_70b": seventy["rss_growth_bytes"] if seventy else None,
        "parameters_70b": seventy["summary"]["parameters"] if seventy else None,
        "seventy_b": seventy,
        "peak_bytes_per_rank": memory["modes"]["meta_param_init_fn"]["peak_bytes"],
        "full_model_bytes": memory["full_model_bytes"],
        "materialise": memory,
        "ties": measured["ties"],
        "approaches": agree["approaches"],
        "agreement": agree,
        "kaiming_on_a_shard": measured["kaiming_on_a_shard"],
        "parent_init": parent_init(measured["parent_init"]) if "parent_init" in measured else None,
    }
