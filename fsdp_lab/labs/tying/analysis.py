"""Lab 03, the verdicts: per-rank results regrouped, and the spike's memory read off its traces.

[Note: the root-unit spike] Left to the root unit, the tied V x d matrix is gathered when the
forward starts and stays until the backward ends: it sits in memory while every block runs.
(Like FSDP2, the spike's `shard` keeps the root unit after forward: its backward comes next.)
As our joint unit `("tok_emb", "head")` it is gathered for the embedding, freed, and gathered
again for the head (our prefetch fetches it during the last block). FSDP2's group
``fully_shard([model.tok_emb, model.head])`` frees only after its last module has run, so it
holds the matrix through the blocks too, and differs from the root unit after forward. The
*peak* need not change: the head needs the full matrix either way, and in backward its
gradient is held too. What changes is the memory under the peak — `phase_bytes` reads where.

Torch-free: everything here works on the plain data `measure.py` returns.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fsdp_lab.labs.tying.config import TyingConfig

PHASES = {  # what the spike reads per rank -> how the summary says it
    "peak_bytes": "peak",
    "blocks_start_bytes": "when the blocks start",
    "blocks_max_bytes": "most while the blocks run",
    "end_of_forward_bytes": "end of forward",
}
# What `to_empty_worker` measures the same way on every rank: said once, at the top.
_TO_EMPTY_ONCE = ("torch", "ties", "tied_on_meta")
_AS_MEASURED = ("world_size", "backend", "model", "vocab_size", "tie_plans", "ties", "plans")


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


def spike(config: TyingConfig, traces: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """`traces[system][wrapping]` (one per rank) -> each phase per rank, the traces, and the
    peaks per wrapping at the top (``peak_bytes_root_unit``, ``fsdp2_peak_bytes_...``)."""
    out: dict[str, Any] = {
        "model": config.gpt(),
        "batch_per_rank": config.batch,
        "steps": config.spike_steps,
        "tied_matrix_bytes": config.vocab * config.dim * 4,  # one fp32 V x d matrix
    }
    for system, by_wrapping in traces.items():
        out[system] = {}
        for w, per_rank in by_wrapping.items():
            phases = [phase_bytes(tr, config.spike_steps - 1) for tr in per_rank]
            out[system][w] = {key: [p[key] for p in phases] for key in (*PHASES, "peak_between")}
            out[system][w]["traces"] = per_rank
        prefix = "" if system == "fsdp_lab" else "fsdp2_"
        for w in by_wrapping:
            out[f"{prefix}peak_bytes_{w}"] = out[system][w]["peak_bytes"]
    return out


def analyse(config: TyingConfig, measured: dict[str, Any]) -> dict[str, Any]:
    """The ranks' raw measurements -> the lab's result (JSON types only)."""
    n = measured["world_size"]
    verification = {
        name: {
            "units": v["per_rank"][0]["units"],
            "steps": config.steps,
            "right_after_shard": [r["right_after_shard"] for r in v["per_rank"]],
            "after_steps": [r["after_steps"] for r in v["per_rank"]],
            "max_abs_diff_vs_single_process": v["max_abs_diff_vs_single_process"],
            "head_equals_embedding": v["head_equals_embedding"],
        }
        for name, v in measured["verification"].items()
    }
    rank0 = measured["to_empty"][0]
    to_empty = {
        **{k: rank0[k] for k in (*_TO_EMPTY_ONCE, "tied_after_to_empty", "tied_after_retie")},
        "per_rank": [
            {k: v for k, v in r.items() if k not in _TO_EMPTY_ONCE} for r in measured["to_empty"]
        ],
    }
    return {
        "config": {**asdict(config), "world_size": n},
        **{k: measured[k] for k in _AS_MEASURED},
        "verification": verification,
        "audit": measured["audit"],
        "to_empty": to_empty,
        "spike": spike(config, measured["spike"]),
    }
