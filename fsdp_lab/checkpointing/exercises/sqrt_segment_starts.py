"""Exercise of the checkpointing lab: where the checkpoints of a chain go (Chen et al. 2016).

`sqrt_segment_starts` — cut a chain of N layers into segments of k = round(√N) layers and
return the first layer of each: the forward sweep keeps those layers' inputs (about N/k), and
backward reruns one segment at a time under grad (k layers' internals). It runs inside the real
executor (`fsdp_lab.checkpointing.schedules.run_chain` with `segments(k)`, whose `starts` it replaces) on
each rank; the judge compares the *measured* peak activation bytes (`fsdp_lab.trace`) and the
*counted* layer calls and kept layer inputs (forward hooks) with the reference's and with
`fsdp_lab.theory.checkpoint_cost`. The classic bugs: every layer its own segment (all N inputs
kept, as many inputs as store-all keeps, for a rerun of every layer), one segment over the whole chain (backward
reruns it all at once and holds every activation, as store-all does), and segment *ends* where
the starts were asked for (off by one segment).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab import theory
from fsdp_lab.checkpointing import schedules
from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, close, series_of
from fsdp_lab.models import Chain
from fsdp_lab.sizes import format_bytes
from fsdp_lab.trace import MemoryTracker

DIM, BATCH = 16, 8


def sqrt_segment_starts(n_layers: int) -> list[int]:
    """Reference: segments of k = round(√N) layers (the last may be shorter), their first
    layers 0, k, 2k, ..."""
    k = max(1, round(math.sqrt(n_layers)))
    return list(range(0, n_layers, k))


def _every_layer(n_layers: int) -> list[int]:
    return list(range(n_layers))


def _one_segment(n_layers: int) -> list[int]:
    return [0]


def _segment_ends(n_layers: int) -> list[int]:
    k = max(1, round(math.sqrt(n_layers)))
    return list(range(k, n_layers + 1, k))


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


def _measure(n: int, starts_fn: Any, schedule: schedules.Schedule) -> dict[str, Any]:
    """One forward + backward of a fresh chain on this rank's batch: what it kept and ran."""
    torch.manual_seed(0)
    layers = list(Chain(n, DIM).layers)
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(dist.get_rank()))
    with MemoryTracker() as mem, schedules.LayerInputCounter(layers) as counter:
        schedules.run_chain(layers, x, schedule, loss_fn=_loss, starts=starts_fn)
    trace = mem.trace()
    return {
        "activation_bytes": trace["bytes"]["activations"],
        "peak": max(trace["bytes"]["activations"]),
        "calls": counter.forward_calls,
        "stored": counter.stored_activations,
        "grads": torch.cat([p.grad.reshape(-1) for m in layers for p in m.parameters()]).tolist(),
    }


def trial(fn: Any, case: Case) -> dict[str, Any]:
    n = case.params["layers"]
    k = max(1, round(math.sqrt(n)))
    starts = fn(n)
    if isinstance(starts, range):
        starts = list(starts)
    if not isinstance(starts, list | tuple) or not all(isinstance(s, int) for s in starts):
        return {"invalid": f"expected a list of ints, got {type(starts).__name__} {starts!r:.60}"}
    starts = [int(s) for s in starts]

    def given(n_layers: int, _: int) -> list[int]:
        return starts

    try:  # the executor's own check of the starts: 0 first, increasing, below N
        schedules.make_plan(schedules.segments(k), n, given)
    except ValueError as exc:
        return {"invalid": str(exc), "starts": starts}
    return {
        "store_all": _measure(n, schedules.segment_starts, schedules.store_all),
        "segments": _measure(n, given, schedules.segments(k)),
        "starts": starts,
    }


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    n = case.params["layers"]
    k = max(1, round(math.sqrt(n)))
    first = got_all[0]
    if "invalid" in first:
        starts = first.get("starts")
        looks_like_ends = bool(starts) and starts[-1] == n
        return Mismatch(
            f"your segment starts do not cut the {n} layers into segments: {first['invalid']}.",
            rows=[("starts", str(sqrt_segment_starts(n)), str(starts))],
            hint=(
                "Off by one segment: these are the segments' ends; return their first "
                f"layers 0, k, 2k, ... (all below N={n})."
                if looks_like_ends
                else f"Return a list of layer indexes: 0 first, increasing, all below N={n}."
            ),
        )
    for r, (mine, reference) in enumerate(zip(got_all, expected, strict=True)):
        if not close(mine["segments"]["grads"], reference["store_all"]["grads"]):
            return Mismatch(
                f"rank {r}: with your segments the gradients differ from store-all's.",
                hint="Every layer must belong to exactly one segment: starts 0, k, 2k, ...",
            )
    plain, exp, got = expected[0]["store_all"], expected[0]["segments"], first["segments"]
    if got["peak"] <= exp["peak"] and got["calls"] <= exp["calls"]:
        return None
    starts = first["starts"]
    lengths = [b - a for a, b in zip(starts, [*starts[1:], n], strict=True)]
    predicted = theory.checkpoint_cost(schedules.segments(k), n)
    rows = [
        ("segment starts", str(expected[0]["starts"]), str(starts)),
        ("peak activation bytes (measured)", format_bytes(exp["peak"]), format_bytes(got["peak"])),
        ("kept layer inputs (counted)", f"{exp['stored']} (theory {predicted.stored_activations})", str(got["stored"])),
        ("layer calls (counted)", f"{exp['calls']} (theory {predicted.forward_calls})", str(got["calls"])),
        ("store-all, for scale", f"{format_bytes(plain['peak'])}, {plain['calls']} calls", ""),
    ]  # fmt: skip
    if len(starts) == n:
        hint = (
            f"Every layer is its own segment: all {n} layer inputs stay kept, as many as "
            "store-all keeps, and every layer but the last is rerun — group about "
            f"√N = {k} layers per segment."
        )
    elif len(starts) == 1:
        hint = (
            "One segment over the whole chain: backward reruns it all at once and holds every "
            f"activation, as store-all does — cut it into segments of about √N = {k} layers."
        )
    else:
        hint = (
            f"Segments of {lengths} layers: segments of k = round(√N) = {k} balance the "
            "checkpoints kept (about N/k) against one segment's activations (k layers)."
        )
    what = "more activation memory" if got["peak"] > exp["peak"] else "more layer calls"
    return Mismatch(
        f"your segments ({len(starts)} of them) take {what} than segments of √N: peak "
        f"{format_bytes(got['peak'])} and {got['calls']} layer calls, against "
        f"{format_bytes(exp['peak'])} and {exp['calls']}.",
        rows=rows,
        hint=hint,
        series=series_of(
            "activation memory over one forward + backward",
            "tensor allocated or freed, in order: forward, then backward with its recomputes",
            "activation memory",
            {
                f"segments of {k} (reference)": exp["activation_bytes"],
                "yours": got["activation_bytes"],
                "store-all": plain["activation_bytes"],
            },
            in_bytes=True,
        ),
    )


SQRT_SEGMENT_STARTS = Exercise(
    name="sqrt_segment_starts",
    lab="checkpoint",
    title="Put the checkpoints of a chain √N layers apart",
    statement=(
        "Checkpointing a chain of N layers in segments of k keeps the input of each segment "
        "through the forward (about N/k of them) and, in backward, reruns one segment at a "
        "time under grad, holding its k layers' activations: memory grows like N/k + k, least "
        "at k ≈ √N (Chen et al. 2016), for about one extra forward. Write "
        "`sqrt_segment_starts(n_layers)`: return the list of the first layer of each segment, "
        "for segments of k = round(√N) layers in order (the last may be shorter) — `[0, 3, 6]` "
        "for 9 layers. The executor `fsdp_lab.checkpointing.schedules.run_chain` keeps the inputs of exactly "
        "those layers; the check measures its peak activation memory and counts its layer "
        "calls, which must be no worse than the √N plan's."
    ),
    stub=(
        "def sqrt_segment_starts(n_layers):\n"
        '    """The first layer of each segment of round(sqrt(n_layers)) layers: [0, k, ...]."""\n'
    ),
    setup="import math",
    hints=(
        "Both ends cost memory: many short segments keep many inputs, one long segment keeps "
        "all of its activations when it is rerun.",
        "k = round(math.sqrt(n_layers)); the chain input (layer 0's) is always the first "
        "checkpoint, and no start may be N or beyond.",
        "return list(range(0, n_layers, k))",
    ),
    solution=sqrt_segment_starts,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, 9 layers (k = 3)", 2, {"layers": 9}),
        Case("2 ranks, 16 layers (k = 4)", 2, {"layers": 16}),
        Case("3 ranks, 10 layers (k = 3, the last segment 1 layer)", 3, {"layers": 10}),
    ),
    bugs=(
        Bug(
            "every-layer",
            "checkpointing every layer",
            _every_layer,
            "every layer input is kept, as with store-all: the peak activation memory is "
            "above the √N plan's and there is one recompute per layer",
        ),
        Bug(
            "one-segment",
            "one segment over the whole chain",
            _one_segment,
            "backward reruns the whole chain at once and holds every activation: the peak is "
            "store-all's",
        ),
        Bug(
            "segment-ends",
            "segment ends instead of starts (off by one)",
            _segment_ends,
            "the chain input is missing and the last 'start' is N itself: the executor "
            "refuses the segments",
        ),
    ),
    points=2,
    minutes=10,
    replayed=True,  # its answers are plain data: the grader replays them (grading)
)
