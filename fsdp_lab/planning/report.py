"""A plan in words: per-rank memory by category against the GPU, bytes by collective and by
link, the step time and its assumptions — and, when it was verified, the fake rank's
measurement beside each number with its relative difference.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes

CATEGORIES = ("parameters", "gradients", "optimizer_state", "gathered", "activations")
MOMENTS = {
    "end_of_forward": "at the end of forward",
    "loss_forward": "in the loss's forward, its fp32 logits alive",
    "optimizer_step": "in the optimizer step, Adam's temporaries alive",
    "loss_backward": "in the loss's backward",
    "block_backward": "as the last block's backward begins",
    "in_backward": "as the last block's gradient is reduced",
    "root_backward": "as the embedding's gradient joins the root unit's",
    "root_reduce": "as the root unit's gradient is reduced, last in backward",
    "end_of_backward": "at the end of backward, where ZeRO-1 reduces every whole gradient",
}


def summary(plan: dict[str, Any]) -> str:
    """Markdown: the verdict, the memory table, the bytes table, the step time, assumptions."""
    mesh = f", mesh {plan['mesh'][0]}x{plan['mesh'][1]}" if plan["mesh"] else ""
    lines = [
        f"**{plan['model']}** ({_count(plan['parameters'])} parameters) on {plan['gpus']} "
        f"{plan['gpu']} ({plan['nodes']} node(s) of {plan['gpus_per_node']}), "
        f"{plan['strategy']}{mesh}, {plan['precision']}, checkpoint {plan['checkpoint']}, "
        f"seq {plan['seq']} x micro-batch {plan['micro_batch']}"
        + (f" x {plan['grad_accumulation']} accumulated" if plan["grad_accumulation"] > 1 else ""),
        "",
        verdict(plan),
        "",
        memory_table(plan),
        "",
        comm_table(plan),
        "",
        f"Step time (a model): {plan['step_time_s'] * 1e3:,.1f} ms — compute "
        f"{plan['step_time_parts']['compute_s'] * 1e3:,.1f} ms, communication "
        f"{plan['step_time_parts']['comm_s'] * 1e3:,.1f} ms, overlapped.",
        "",
        zero_paper_line(plan),
        "",
        "Assumptions:",
        *(f"- {a}" for a in plan["assumptions"]),
    ]
    return "\n".join(lines)


def _count(parameters: float) -> str:
    return f"{parameters / 1e9:.2f}B" if parameters >= 1e8 else f"{parameters / 1e6:.2f}M"


def verdict(plan: dict[str, Any]) -> str:
    """One sentence: fits or not, by how much, and the cheapest change that makes it fit."""
    total, usable = plan["per_rank_bytes"]["total"], plan["usable_bytes"]
    unknown = plan["per_rank_bytes"]["activations"] is None
    head = (
        f"Peak per GPU {format_bytes(total)} ({MOMENTS[plan['peak_moment']]}"
        f"{'; activations not counted: see the assumptions' if unknown else ''}) of "
        f"{format_bytes(usable)} usable: "
    )
    if plan["fits"]:
        reserved = plan.get("reserved_bytes", total)
        tight = (
            f" Tight: PyTorch's allocator would reserve about {format_bytes(reserved)} (an "
            "estimate: the peak and the loss's cached fp32 logits), more than is usable."
            if reserved > usable
            else ""
        )
        return head + "**fits**." + tight
    if plan["to_fit"]:
        best, *others = plan.get("changes_that_fit") or [{"change": plan["to_fit"]}]
        cost = (
            f", {best['gpu_s_per_1k_tokens']:.3g} GPU-seconds per 1,000 tokens, peak "
            f"{format_bytes(best['peak_bytes'])}"
            if "peak_bytes" in best
            else ""
        )
        also = "".join(
            f"; or `{as_flags(o['change'])}` ({o['gpu_s_per_1k_tokens']:.3g} GPU-s per 1k tokens)"
            for o in others[:2]
        )
        return head + (
            f"**does not fit**; the cheapest change that fits: `{as_flags(plan['to_fit'])}` "
            f"(in Python: `{plan['to_fit']}`){cost}{also}."
        )
    if unknown:
        return head + (
            "**does not fit**, and no change of checkpointing, ZeRO stage, micro-batch or GPU "
            "count makes it."
        )
    least = plan.get("least_per_rank_bytes") or {**plan["per_rank_bytes"], "gpus": plan["gpus"]}
    parts = ", ".join(
        f"{name} {format_bytes(least[name])}"
        for name in sorted(CATEGORIES, key=lambda n: -(least.get(n) or 0))[:2]
    )
    return head + (
        "**does not fit**, and no change of checkpointing, ZeRO stage, micro-batch or GPU count "
        f"makes it: even at micro-batch 1, every block recomputed, ZeRO-3 on {least['gpus']:,} "
        f"GPUs, a GPU needs {format_bytes(least['total'])} (most of it {parts}) — tensor or "
        "context parallelism (not modelled here) would split the layers' weights and activations."
    )


def as_flags(change: str) -> str:
    """A change in Python's words (``checkpoint='blocks', gpus=32``) as `fsdp-lab plan`'s
    options (``--checkpoint blocks --gpus 32``)."""
    flags = []
    for part in change.split(", "):
        name, _, value = part.partition("=")
        option = f"--{name.replace('_', '-')}"
        flags.append(f"(no {option})" if value == "None" else f"{option} {value.strip(chr(39))}")
    return " ".join(flags)


def zero_paper_line(plan: dict[str, Any]) -> str:
    """The ZeRO paper's model-state accounting for this Ψ and GPU count, beside what this plan
    holds at its own peak (its numbers, not a claim about every strategy)."""
    # In GB (10^9), as the paper prints them: 7.5B on 64 GPUs reads 120 · 31.4 · 16.6 · 1.88.
    paper = " · ".join(
        f"{k} {v / 1e9:,.0f} GB" if v >= 1e12 else f"{k} {v / 1e9:.3g} GB"
        for k, v in plan["zero_paper_bytes"].items()
    )
    psi, at_peak = plan["parameters"], plan["per_rank_bytes"]
    whole_grads = max(0.0, at_peak["gradients"] - at_peak["parameters"])  # beyond fp32 shards
    return (
        f"The ZeRO paper's accounting for {psi / 1e9:.3g}B parameters on {plan['gpus']} GPUs "
        f"(fp16 parameters and gradients, fp32 Adam and master weights, model state only): "
        f"{paper}. This plan is `fsdp_lab.shard`'s own layout — fp32 shards, gradient shards "
        f"and Adam moments, and compute-dtype copies: at its peak "
        f"({MOMENTS[plan['peak_moment']]}) a GPU holds {at_peak['gathered'] / psi:.3g} bytes "
        f"per parameter of gathered parameters and {whole_grads / psi:.3g} of gradients beyond "
        "its shards, where the paper counts 2 + 2 (ZeRO-1) or 2 + 2/N (ZeRO-2) in fp16."
    )


def memory_table(plan: dict[str, Any]) -> str:
    """Per-rank bytes by category: planned, and measured on a fake rank when verified."""
    verified = plan.get("verified")
    header = ["per GPU", "planned"] + (["measured", "difference"] if verified else [])
    rows = []
    for name in (*CATEGORIES, "total"):
        planned = plan["per_rank_bytes"][name]
        row = [name, "not counted" if planned is None else format_bytes(planned)]
        if verified:
            diff = verified["per_rank_bytes_rel_diff"].get(name)
            row += [
                format_bytes(verified["per_rank_bytes"][name]),
                "-" if diff is None else f"{diff:+.1%}",
            ]
        rows.append(row)
    return table(header, rows) + (f"\n\nmeasured: {verified['how']}" if verified else "")


def comm_table(plan: dict[str, Any]) -> str:
    """Bytes per GPU and step by collective and by link; the fake rank's beside them."""
    verified = plan.get("verified")
    comm = plan["comm_bytes_per_rank"]
    header = ["bytes per GPU per step", "planned"] + (["measured"] if verified else [])
    rows = []
    for kind in ("by_collective", "by_link"):
        for name, value in comm[kind].items():
            row = [name, format_bytes(value)]
            if verified:
                row.append(format_bytes(verified["comm_bytes_per_rank"][kind].get(name, 0.0)))
            rows.append(row)
    return table(header, rows)


def verification_sentence(plan: dict[str, Any]) -> str:
    """In words: what the measurement (fake rank or real ranks) agreed with, and by how much."""
    v = plan["verified"]
    exact = set(v["comm_bytes_rel_diff"].values()) == {0.0}
    diff = v["per_rank_bytes_rel_diff"]
    state = [k for k in ("parameters", "optimizer_state", "gathered") if diff.get(k) == 0.0]
    cost = (
        f" It took {v['wall_s']:.1f} s and {format_bytes(v['peak_rss_bytes'])} of resident "
        "memory on this machine."
        if v.get("wall_s") is not None
        else ""
    )
    return (
        f"Measured ({v['how']}): the bytes per collective "
        f"{'equal the plan exactly' if exact else 'differ from the plan: ' + str(v['comm_bytes_rel_diff'])}"
        f"; {', '.join(state) or 'no category'} equal the plan exactly; the peak is "
        f"{format_bytes(v['per_rank_bytes']['total'])}, {diff['total']:+.1%} from the planned "
        f"{format_bytes(plan['per_rank_bytes']['total'])}"
        + (
            " — gradients and activations at the peak are a snapshot of one moment of the "
            "step, which the plan approximates."
            if abs(diff["total"]) >= 0.005
            else "."
        )
        + cost
    )


def twin_time_sentence(twin: dict[str, Any]) -> str:
    """The twin's measured step time beside the plan's, as a ratio, with what the plan omits."""
    ratio = twin["step_time_ratio"]
    parts = twin["step_time_parts"]
    return (
        f"Step time: measured {twin['measured_step_time_s'] * 1e3:.1f} ms, planned "
        f"{twin['step_time_s'] * 1e3:.2f} ms (compute {parts['compute_s'] * 1e3:.2f} ms at this "
        f"machine's measured matmul rate, communication {parts['comm_s'] * 1e3:.2f} ms at its "
        f"measured all-gather bandwidth): the real step takes {ratio:.1f}x the plan. "
        + (
            "The plan counts FLOPs and bytes only; on a model this small, the time of each "
            "operator call, hook and message start — which no roofline counts — is most of a "
            "step here."
            if ratio > 2
            else "At this size FLOPs and bytes already account for most of the step."
        )
    )
