"""Lab 01, in words: markdown tables of agreement, of what fills the model-state peak, of ZeRO-1
two ways, of the one-unit walkthrough's layout and stages (`walkthrough.py`); the sentences on
the peak, the root unit, the owner claim and the timeline, each built from the result. The
figures are in `figures.py`.
"""

from __future__ import annotations

import math
from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import max_diff, table
from fsdp_lab.sharding.lab.analysis import MODEL_STATE, model_state_bytes
from fsdp_lab.sizes import format_bytes


def summary(result: LabResult) -> str:
    """Markdown: agreement with one process and FSDP2, peaks and bytes per collective beside
    their formulas (and DDP + ShardedOptimizer, when it was measured)."""
    lines = [
        f"strategy {result['strategy']} on {result['world_size']} ranks ({result['backend']})",
        "",
        "- " + max_diff("ours", "single process", result["max_abs_diff_vs_single_process"]),
    ]
    if result["max_abs_diff_vs_fsdp2"] is not None:
        lines.append("- " + max_diff("ours", "FSDP2", result["max_abs_diff_vs_fsdp2"]))
        lines.append(
            f"- step time: ours {result['step_time_s'] * 1e3:.1f} ms, "
            f"FSDP2 {result['fsdp2_step_time_s'] * 1e3:.1f} ms"
        )
    peaks = ", ".join(format_bytes(b) for b in result["peak_model_state_bytes_per_rank"])
    lines += [
        f"- peak model state per rank: {peaks} (formula {format_bytes(result['theory_peak_bytes'])})",
        "",
        table(
            ["collective", "measured bytes/step (rank 0)", "theory", "calls/step"],
            (
                [op, format_bytes(result["comm_bytes_per_rank"][0].get(op, 0.0))]
                + [format_bytes(t), f"{result['calls_per_step'].get(op, 0):g}"]
                for op, t in result["theory_comm_bytes"].items()
            ),
        ),
    ]
    lines.append(f"\nmeasured equals theory on every rank: {result['comm_matches_theory']}")
    lines += cuda_memory_lines(result)
    so = result.data.get("sharded_optimizer")
    if so:
        lines += [
            "",
            "DDP + ShardedOptimizer (ZeRO-1 as an optimizer):",
            "",
            "- " + max_diff("it", "single process", so["max_abs_diff_vs_single_process"]),
            "- "
            + max_diff(
                "it", "shard(strategy='optimizer')", so["max_abs_diff_vs_zero1_transformation"]
            ),
        ]
        if so["max_abs_diff_vs_zero_redundancy_optimizer"] is not None:
            zero = so["max_abs_diff_vs_zero_redundancy_optimizer"]
            lines.append("- " + max_diff("it", "PyTorch's ZeroRedundancyOptimizer", zero))
        share = so["theory"]["largest_share_over_even_split"]
        lines += [f"- busiest rank's share of the state / even split: {share:.3f}", ""]
        lines.append(sharded_optimizer_table(result))
    return "\n".join(lines)


def sharded_optimizer_table(result: LabResult) -> str:
    """Markdown: ZeRO-1 two ways, measured — `shard(strategy="optimizer")` and DDP +
    `ShardedOptimizer` — optimizer state per rank and bytes per step, with their formulas."""
    so = result["sharded_optimizer"]
    th = so["theory"]
    state = [
        [r, so["owned_numel_per_rank"][r], format_bytes(measured)]
        + [format_bytes(th["optimizer_state_bytes_per_rank"][r])]
        + [format_bytes(th["optimizer_state_bytes_even_split"])]
        + [format_bytes(result["optimizer_state_bytes_per_rank"][r])]
        for r, measured in enumerate(so["optimizer_state_bytes_per_rank"])
    ]
    columns = [  # rank 0, measured and formula, for each of the two
        result["comm_bytes_per_rank"][0],
        result["theory_comm_bytes"],
        so["comm_bytes_per_rank"][0],
        th["comm_bytes"],
    ]
    ops = [
        [op] + [format_bytes(c[op]) if op in c else "-" for c in columns]
        for op in (*result["theory_comm_bytes"], *th["comm_bytes"])
    ]
    ops.append(["total"] + [format_bytes(sum(c.values())) for c in columns])
    opt = "shard(strategy='optimizer')"
    return "\n".join([
        table(["rank", "elements owned (ShardedOptimizer)", "optimizer state: ShardedOptimizer",
               "formula K·Ψ_r", "even split K·Ψ/N", opt], state),
        "",
        table(["collective", opt, "formula", "DDP + ShardedOptimizer", "formula"], ops),
        "\nDDP + ShardedOptimizer bytes equal their formula on every rank: "
        f"{so['comm_matches_theory']}",
    ])  # fmt: skip


def peak_table(results: dict[str, Any], rank: int = 0) -> str:
    """Markdown: per run (lab results by label), the categories at the moment the model state
    peaked on `rank`, the formula, and the last marker before that moment."""
    rows = []
    for label, result in results.items():
        trace = result["memory_traces"][rank]
        totals = model_state_bytes(trace)
        i = max(range(len(totals)), key=totals.__getitem__)
        parts = [format_bytes(trace["bytes"][c][i]) for c in MODEL_STATE]
        before = [m["label"] for m in trace["markers"] if m["t"] <= trace["t"][i]][-1:] or ["-"]
        peak = [format_bytes(result["theory_peak_bytes"]), format_bytes(totals[i])]
        rows.append([label, *peak, *parts, before[0]])
    return table(["run", "formula", "measured", *MODEL_STATE, "last event before"], rows)


# -- the one-unit walkthrough ------------------------------------------------------------------


def stage_table(walk: dict[str, Any]) -> str:
    """Markdown: per stage, rank 0's unsharded storage bytes and bytes moved (all measured)."""
    head = ["stage", "elements held (rank 0)", "unsharded storage (rank 0)", "bytes moved (rank 0)"]
    return table(
        head,
        (
            [name, len(s["rows"][0]), f"{s['unsharded_storage_bytes'][0]} B"]
            + [f"{s['comm_bytes'][0]:g} B"]
            for name, s in walk["stages"].items()
        ),
    )


def root_kept_report(kept: LabResult, freed: LabResult) -> str:
    """Markdown: the root unit kept gathered from forward into backward (our default, FSDP2's
    and FSDP1's) against freed after forward too (`free_root=True`), both measured: the
    all-gather bytes and calls per step on rank 0, and the peak model state over the ranks.
    The sentences under the table are written from these numbers."""
    op = "all_gather_into_tensor"
    root = kept["units"][0]  # `shard` lists the root unit first
    n, b = kept["world_size"], root["element_size"]
    rows, peaks = [], {}
    for label, r in (("root kept (default)", kept), ("root freed after forward", freed)):
        peaks[label] = max(r["peak_model_state_bytes_per_rank"])
        rows.append(
            [
                label,
                format_bytes(r["comm_bytes_per_rank"][0][op]),
                f"{r['calls_per_step'][op]:g}",
                format_bytes(r["theory_comm_bytes"][op]),
                format_bytes(peaks[label]),
            ]
        )
    header = ["", "all-gather / step (rank 0)", "all-gathers / step", "formula", "peak model state"]
    extra = freed["comm_bytes_per_rank"][0][op] - kept["comm_bytes_per_rank"][0][op]
    calls = freed["calls_per_step"][op] - kept["calls_per_step"][op]
    one_root = (n - 1) / n * root["padded_numel"] * b
    lines = [table(header, rows), ""]
    lines.append(
        f"Freeing the root after forward cost **{format_bytes(extra)} more all-gather per step** "
        f"({calls:g} more call{'s' if calls != 1 else ''}); (N−1)/N of the root unit is "
        f"{format_bytes(one_root)}" + (" — exactly that." if math.isclose(extra, one_root) else ".")
    )
    saved = peaks["root kept (default)"] - peaks["root freed after forward"]
    if saved > 0:
        lines.append(f"It lowered the peak model state by {format_bytes(saved)}.")
    elif saved == 0:
        lines.append(
            "It did **not** lower the peak model state: the root is needed again at the very "
            "start of backward, so the bytes it freed came straight back."
        )
    else:
        lines.append(f"The peak model state was even {format_bytes(-saved)} higher.")
    last = [u["name"] for u in kept["units"] if u["name"] not in ("", "root")][-1:]
    freed_last = [u for u in kept["units"] if u["name"] in last and u["reshard_after_forward"]]
    if freed_last:
        lines.append(
            f'What stays gathered is the root unit, not "the last layer": the last block, '
            f"`{last[0]}`, was freed after forward and gathered again for backward in both runs."
        )
    return "\n".join(lines)


OWNER_CLAIM = (
    "In FSDP the GPU that owns layer i *broadcasts* W_i to the others, keeps its copy, "
    "receives all gradients and updates the weights."
)


def owner_claim_report(walk: dict[str, Any]) -> str:
    """Markdown: the course-note picture of FSDP (`OWNER_CLAIM`: one owner broadcasts, keeps,
    receives every gradient, updates) checked point by point against the walkthrough's
    measurements: which collectives moved bytes, what every rank held after each stage."""
    stages, n = walk["stages"], walk["world_size"]
    called = sorted({op for s in stages.values() for ops in s["collectives"] for op in ops})
    shard = stages["shard"]["rows"]
    disjoint = len({tuple(r) for r in shard}) == n and len({len(r) for r in shard}) == 1
    freed = [b == 0 for b in stages["free"]["unsharded_storage_bytes"]]
    grads = stages["reduce-scatter"]["rows"]
    full = len(stages["compute"]["rows"][0])
    before, after = stages["shard"]["rows"], stages["optimizer step"]["rows"]
    stepped = [a != b for a, b in zip(before, after, strict=True)]

    def verdict(ok: bool, yes: str, no: str) -> str:
        return f"{'✓' if ok else '✗'} {yes if ok else no}"

    points = [
        verdict(
            "broadcast" not in called and called != [],
            f"no rank broadcast: the only collectives were {', '.join(f'`{c}`' for c in called)}"
            " — an all-gather rebuilds the unit from every rank's shard",
            f"collectives called: {called}",
        ),
        verdict(
            disjoint,
            f"no owner keeps the layer: after `shard` each of the {n} ranks held a different "
            f"{len(shard[0])}-element slice",
            "the ranks did not hold distinct equal slices after `shard`",
        ),
        verdict(
            all(freed),
            "every rank freed the gathered unit (its storage measured 0 bytes after `free`)",
            f"storage after `free`, per rank: {stages['free']['unsharded_storage_bytes']}",
        ),
        verdict(
            all(len(g) < full for g in grads),
            f"no rank received all gradients: after the reduce-scatter each held {len(grads[0])} "
            f"of the {full} gradient elements — its own shard, already summed over ranks",
            "some rank held the whole gradient after the reduce-scatter",
        ),
        verdict(
            all(stepped),
            "every rank updated its own shard in the optimizer step, with no message",
            f"shards changed by the optimizer step, per rank: {stepped}",
        ),
    ]
    right = all(p.startswith("✓") for p in points)
    head = (
        f"**The claim:** “{OWNER_CLAIM}” **Measured on {n} ranks above:**"
        if right
        else f"**The claim:** “{OWNER_CLAIM}” **Measured (some points did not hold):**"
    )
    tail = (
        "So the claim is wrong on every point: it describes a parameter server, not FSDP."
        if right
        else "The walkthrough did not show FSDP's pattern; see the points marked ✗."
    )
    return "\n".join([head, "", *(f"- {p}" for p in points), "", tail])


def layout_table(walk: dict[str, Any]) -> str:
    """Markdown: the walkthrough unit's flat buffer — its parameters, sizes and padding."""
    lay = walk["layout"]
    rows = [
        [
            ", ".join(f"`{n}`" for n in lay["names"]),
            lay["numel"],
            lay["padding"],
            lay["padded_numel"],
            lay["shard_numel"],
            f"{lay['element_size']} B",
        ]
    ]
    header = ["parameters", "elements", "padding", "padded", "per shard", "per element"]
    return table(header, rows)


def units_table(result: LabResult) -> str:
    """Markdown: the wrap units of a run — sizes in elements, and whether each is freed after
    forward (gathered again for backward) or kept gathered (the root, by default)."""
    rows = [
        [
            f"`{u['name']}`",
            u["numel"],
            u["padded_numel"],
            u["shard_numel"],
            "freed, gathered again" if u.get("reshard_after_forward", True) else "kept gathered",
        ]
        for u in result["units"]
    ]
    header = ["unit", "elements", "padded to a multiple of N", "per shard", "after forward"]
    return table(header, rows)


def cuda_memory_lines(result: LabResult) -> list[str]:
    """Markdown lines, on CUDA only: each rank's process beside its tensors — the allocator's
    peak, what it keeps reserved, and the CUDA context every rank pays for itself."""
    lines = []
    for rank, trace in enumerate(result["memory_traces"]):
        cuda = trace.get("cuda")
        if cuda is None:
            continue
        context = (
            f"CUDA context {format_bytes(cuda['context_bytes'])} ({cuda['context_source']})"
            if cuda["context_bytes"] is not None
            else f"CUDA context {cuda['context_source']}"
        )
        lines.append(
            f"- rank {rank} on {trace['device']}: tensors peak {format_bytes(trace['peak_bytes'])}"
            f", allocator reserved {format_bytes(cuda['reserved_bytes'])} (peak "
            f"{format_bytes(cuda['peak_reserved_bytes'])}), {context}"
        )
    return (
        ["", "Each rank's GPU memory (CUDA's allocator and driver):", "", *lines] if lines else []
    )


def peak_sentence(result: LabResult, rank: int = 0) -> str:
    """Markdown: the measured model-state peak of `rank` beside its formula, in words."""
    peak = result["peak_model_state_bytes_per_rank"][rank]
    formula = result["theory_peak_bytes"]
    diff = peak - formula
    where = (
        f"**{format_bytes(diff)} above** the formula ({format_bytes(formula)})"
        if diff > 0
        else f"{format_bytes(-diff)} below the formula ({format_bytes(formula)})"
        if diff < 0
        else f"exactly the formula ({format_bytes(formula)})"
    )
    return f"Measured on rank {rank}: the model state (everything but activations) peaks at {format_bytes(peak)}, {where}."


def ordering_sentence(runs: dict[str, LabResult]) -> str:
    """Markdown: do the measured peaks of the strategies fall in the order their formulas do?
    And how far above or below its formula each one stands."""
    measured = {s: max(r["peak_model_state_bytes_per_rank"]) for s, r in runs.items()}
    formula = {s: r["theory_peak_bytes"] for s, r in runs.items()}
    by_measured = sorted(measured, key=measured.get, reverse=True)
    by_formula = sorted(formula, key=formula.get, reverse=True)
    order = " > ".join(f"`{s}`" for s in by_measured)
    verdict = (
        f"Measured peaks, largest first: {order} — the order the formulas predict."
        if by_measured == by_formula
        else f"Measured peaks, largest first: {order}; the formulas' order is "
        + " > ".join(f"`{s}`" for s in by_formula)
        + " — they disagree."
    )
    gaps = ", ".join(
        f"`{s}` {'+' if measured[s] >= formula[s] else '−'}{format_bytes(abs(measured[s] - formula[s]))}"
        for s in runs
    )
    return f"{verdict} Measured minus formula (busiest rank): {gaps}."


def timeline_report(result: LabResult) -> str:
    """Markdown: the run's timelines as numbers — compute, transfer, waiting, hidden transfer."""
    from fsdp_lab.markdown import timeline_sentence
    from fsdp_lab.trace.timeline import time_shares

    return timeline_sentence(time_shares(result["timelines"]))


def _versus(x: float, ref: float, name: str) -> str:
    """`x` against `ref` in words: "exactly 4Ψ (208.75 KiB)", "192.23 KiB, 16.52 KiB under 4Ψ"."""
    if x == ref:
        return f"exactly {name} ({format_bytes(ref)})"
    side = "under" if x < ref else "over"
    return f"{format_bytes(x)}, {format_bytes(abs(x - ref))} {side} {name} ({format_bytes(ref)})"


def _at_peak(result: LabResult, rank: int) -> tuple[dict[str, float], str]:
    """The model-state categories at the moment the model state peaked on `rank`, and the last
    marker before that moment."""
    trace = result["memory_traces"][rank]
    totals = model_state_bytes(trace)
    i = max(range(len(totals)), key=totals.__getitem__)
    before = [m["label"] for m in trace["markers"] if m["t"] <= trace["t"][i]][-1:] or ["-"]
    return {c: trace["bytes"][c][i] for c in MODEL_STATE}, before[0]


def peak_explanations(runs: dict[str, LabResult], rank: int = 0) -> str:
    """Markdown bullets, one per strategy: what rank `rank` held at its peak beside what the
    formula counts — every clause a comparison of two numbers from the run."""
    bullets = []
    for strategy, r in runs.items():
        at, event = _at_peak(r, rank)
        t, n = r["theory"], r["world_size"]
        whole = t["psi"] * t["bytes_per_element"]  # 4Ψ: the unsharded parameters
        gathered = t["psi_padded"] * t["bytes_per_element"]  # a gathered copy, padding too
        own = gathered / n  # this rank's shard, 4Ψ/N
        state = 2 * (whole if strategy == "none" else own)  # Adam's two moments
        p, g, o, c = (at[k] for k in ("parameters", "gradients", "optimizer_state", "comm_buffers"))
        copy = "4Ψ" if gathered == whole else "4Ψ and its padding"
        extra = o - state
        adam = (
            f"optimizer state {format_bytes(o)}, {format_bytes(extra)} beyond 8Ψ"
            + ("" if strategy == "none" else "/N")
            + " (Adam's `step` counters: a 4-byte scalar per parameter tensor)"
            if 0 < extra < 0.01 * state
            else f"optimizer state {_versus(o, state, '8Ψ' if strategy == 'none' else '8Ψ/N')}"
        )
        if strategy == "none":
            held = (
                f"its `parameters` are the whole model, {_versus(p, whole, '4Ψ')}, its own "
                "storage"
                + (
                    ", and nothing is gathered (`comm_buffers` 0 B)"
                    if c == 0
                    else f", and `comm_buffers` holds {format_bytes(c)}"
                )
            )
            grads = f"gradients {_versus(g, whole, '4Ψ')}"
        elif strategy in ("optimizer", "grad_op"):
            held = (
                f"its `parameters` are this rank's shard, {_versus(p, own, '4Ψ/N')}, kept beside "
                f"the gathered full copy in `comm_buffers`, {_versus(c, gathered, copy)}: the "
                "formula counts the replicated weights once, the rank holds both"
            )
            counted = (whole, "4Ψ") if strategy == "optimizer" else (own, "4Ψ/N")
            grads = f"gradients {_versus(g, *counted)}"
            if g < counted[0]:
                grads += (
                    f" — at the moment of the peak (after {event}) some units' gradients had "
                    "already been reduce-scattered to their shards"
                )
        else:
            units = {u["name"]: u["padded_numel"] * u["element_size"] for u in r["units"]}
            root = units.get("root", 0)
            block = max((b for name, b in units.items() if name != "root"), default=0)
            k = (c - root) / block if block else 0
            if block and k == int(k) and k >= 1:
                what = f"the root unit ({format_bytes(root)}) and {int(k)} block(s) of "
                what += f"{format_bytes(block)}: the block computing"
                prefetched = int(k) == 2 and r["config"]["prefetch"]
                what += ", and the next one, prefetched" if prefetched else ""
            else:
                what = f"{c / max(block, 1):.2f}× the largest block ({format_bytes(block)})"
            held = (
                f"`comm_buffers` holds {format_bytes(c)} at the peak (after {event}): {what}; "
                f"the formula counts one gathered unit, {format_bytes(t['largest_unit_bytes'])}"
            )
            grads = f"gradients {_versus(g, own, '4Ψ/N')}"
        bullets.append(f"- **{strategy}**: {held}; {grads}; {adam}.")
    return "\n".join(bullets)
