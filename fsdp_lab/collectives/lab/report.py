"""Lab 00, in words: bytes per rank against the formulas as a table, the all-reduce and the
waiting in sentences built from the result. The figures are in `figures.py`."""

from __future__ import annotations

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.markdown import table
from fsdp_lab.sizes import format_bytes


def summary(result: LabResult) -> str:
    """A markdown table: per op, measured bytes (every rank), theory, median time."""

    def measured(op: str) -> str:
        return ", ".join(map(format_bytes, sorted({m[op] for m in result["comm_bytes_per_rank"]})))

    rows = [
        [op, measured(op), format_bytes(formula), f"{result['time_s'][op] * 1e3:.2f} ms"]
        for op, formula in result["theory_comm_bytes"].items()
    ]
    return (
        f"world size {result['world_size']} on {result['backend']}, shard "
        f"{format_bytes(result['shard_bytes'])} per rank\n\n"
        + table(["op", "measured bytes/rank (all ranks)", "theory", "time/call"], rows)
        + f"\n\nmeasured equals theory on every rank: {result['matches_theory']}"
    )


def all_reduce_sentence(result: LabResult) -> str:
    """Markdown: why the all-reduce bar can be the shorter one although an all-reduce moves twice
    a reduce-scatter's bytes — per byte of input, from rank 0's measured bytes."""
    n, s = result["world_size"], result["shard_bytes"]
    moved = result["comm_bytes_per_rank"][0]
    rs, ar = moved["reduce_scatter_tensor"], moved["all_reduce"]
    per_rs, per_ar = rs / (n * s), ar / s
    ratio = per_ar / per_rs if per_rs else float("nan")
    return (
        f"Measured on rank 0, {n} ranks: the reduce-scatter reduced the {format_bytes(n * s)} full "
        f"vector and moved {format_bytes(rs)} ({per_rs:.3g} bytes per byte of input, (N−1)/N); "
        f"the all-reduce reduced the {format_bytes(s)} shard and moved {format_bytes(ar)} "
        f"({per_ar:.3g} per byte of input, 2(N−1)/N). Per byte of the tensor reduced, the "
        f"all-reduce moved **{ratio:.3g}×** the reduce-scatter's bytes; its bar is "
        + ("shorter" if ar < rs else "not shorter" if ar == rs else "taller")
        + f" only because its tensor was {n}× smaller."
    )


def waiting_sentence(result: LabResult) -> str:
    """Markdown: the longest span inside a collective, split into waiting for the other ranks
    and moving bytes (`trace.timeline.waiting_times`), measured in this run."""
    from fsdp_lab.trace.timeline import common_clock, waiting_times

    timelines = result["timelines"]
    if not common_clock(timelines):
        return "The ranks ran on different hosts: no common clock to tell waiting from transfer."
    waits = waiting_times(timelines)
    spans = [
        (s["end"] - s["start"], r, i)
        for r, tl in enumerate(timelines)
        for i, s in enumerate(tl["spans"])
    ]
    _, r, i = max(spans)  # the longest span of any rank
    span, wait = timelines[r]["spans"][i], waits[r][i]
    length = span["end"] - span["start"]
    return (
        f"The longest span, **{length * 1e3:.1f} ms inside `{span['name']}` on rank "
        f"{timelines[r].get('rank', r)}**, was {wait * 1e3:.1f} ms of waiting for the last rank "
        f"of the group to enter the call and {(length - wait) * 1e3:.1f} ms of moving bytes"
        + (
            " — mostly waiting: a collective cannot start before every rank has called it, so a "
            "rank that arrives early (here, at a different moment than the others) waits inside "
            "it. The timeline draws waiting pale and hatched."
            if wait > length / 2
            else " — mostly moving bytes. The timeline draws waiting pale and hatched."
        )
    )
