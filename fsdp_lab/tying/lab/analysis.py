"""Lab 03, the verdicts: per-rank results regrouped, and the spike's memory read off its traces.

[Note: the root-unit spike] Left to the root unit, the tied V x d matrix is gathered when the
forward starts and, if the root unit is not freed after forward, stays until the backward ends:
it sits in memory while every block runs — a plateau, not a spike at the embedding's gather and
another at the head's. (Like FSDP2, the spike's `shard` keeps the root unit after forward, its
backward comes next; `measure.freed_after_forward` reads what each run did.)
As our joint unit `("tok_emb", "head")` it is gathered for the embedding, freed, and gathered
again for the head (our prefetch fetches it during the last block). FSDP2's group
``fully_shard([model.tok_emb, model.head])`` frees only after its last module has run, so it
holds the matrix through the blocks too, and differs from the root unit after forward. The
*peak* need not change: the head needs the full matrix either way, and in backward its
gradient is held too. What changes is the memory under the peak — `phase_bytes` reads where.

Torch-free: everything here works on the plain data `measure.py` returns.
"""

from __future__ import annotations

import re
from dataclasses import asdict
from typing import Any

from fsdp_lab.tying.lab.config import TyingConfig

PHASES = {  # what the spike reads per rank -> how the summary says it
    "peak_bytes": "peak",
    "blocks_start_bytes": "when the blocks start",
    "blocks_max_bytes": "most while the blocks run",
    "end_of_forward_bytes": "end of forward",
}
# What `to_empty_worker` measures the same way on every rank: said once, at the top.
_TO_EMPTY_ONCE = ("torch", "ties", "tied_on_meta")
_AS_MEASURED = ("world_size", "backend", "model", "vocab_size", "tie_plans", "ties", "plans")
_STEP_MARKER = re.compile(r"step (\d+) (forward done|backward done|optimizer step)")
_PHASE_OF = {
    "forward done": "forward",
    "backward done": "backward",
    "optimizer step": "optimizer step",
}


def phase_at(markers: list[dict[str, Any]], t: float) -> dict[str, Any]:
    """Where in training time `t` falls: the first step marker at or after it says which step
    and phase (``forward``, ``backward``, ``optimizer step``); after the last: ``after training``."""
    for m in sorted(markers, key=lambda m: m["t"]):
        found = _STEP_MARKER.fullmatch(m["label"])
        if found and m["t"] >= t:
            return {"step": int(found.group(1)), "phase": _PHASE_OF[found.group(2)]}
    return {"step": None, "phase": "after training"}


def phase_bytes(trace: dict[str, Any], step: int) -> dict[str, Any]:
    """Peak (the markers around it, the step and phase it fell in); in `step`: bytes when the
    blocks start, the least and the most while they run (from the embedding's end to the
    head's start), at the end of forward."""

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
        "peak_phase": phase_at(trace["markers"], t_peak),
        "peak_bytes": trace["peak_bytes"],
        "blocks_start_bytes": first["total"],
        "blocks_min_bytes": min(window),
        "blocks_max_bytes": max(window),
        "end_of_forward_bytes": forward_done["total"],
    }


def spike(config: TyingConfig, runs: dict[str, dict[str, list[dict]]]) -> dict[str, Any]:
    """`runs[system][wrapping]` (one `spike_worker` result per rank) -> each phase per rank,
    the units freed after forward (rank 0's), the traces, and the peaks per wrapping at the
    top (``peak_bytes_root_unit``, ``fsdp2_peak_bytes_...``)."""
    first = next(iter(next(iter(runs.values())).values()))[0]["model"]
    out: dict[str, Any] = {
        "model": config.gpt(),
        "batch_per_rank": config.batch,
        "seq_len": config.seq_len,
        "steps": config.spike_steps,
        "tied_matrix_bytes": first["tied_bytes"],  # read off the built model: V x d x 4 (fp32)
        "block_bytes": first["block_bytes"],
        "layers": first["layers"],
    }
    keys = (*PHASES, "blocks_min_bytes", "peak_between", "peak_phase")
    for system, by_wrapping in runs.items():
        out[system] = {}
        for w, per_rank in by_wrapping.items():
            traces = [r["trace"] for r in per_rank]
            phases = [phase_bytes(tr, config.spike_steps - 1) for tr in traces]
            out[system][w] = {key: [p[key] for p in phases] for key in keys}
            out[system][w]["freed_after_forward"] = per_rank[0]["freed_after_forward"]
            out[system][w]["traces"] = traces
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
        "sections": measured["sections"],
        "verification": verification,
        "audit": measured["audit"],
        "to_empty": to_empty,
        "spike": spike(config, measured["spike"]),
    }
