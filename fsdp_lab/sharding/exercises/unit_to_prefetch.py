"""Exercise of the sharding lab: which unit to gather while another runs its backward
(`unit_to_prefetch`).

Prefetch hides an all-gather behind compute: while one unit runs its backward, the next one's
parameters are already on their way. The learner's function picks that next unit from the
order in which the units' forwards ended (`ShardingSteps.unit_to_prefetch`), inside the real
sharded GPT; the check measures, on a `Timeline`, which all-gathers backward had to issue on
demand and wait for (nothing else was issued while they ran), counts the all-gathers backward
made, and takes the peak of gathered bytes from a `MemoryTracker`. A wrong pick never changes
the values, only the waits, the messages and the memory, so the verdict says "values right,
but ...". The classic bugs: the forward order's next unit (its backward is already done), and
an off-by-one either way (two units ahead: one more unit held; the unit itself: nothing
prefetched). Position 0 read as -1 (Python's last element, the root) is a bug without a
symptom here: the root's gradient is reduced last, so it is still gathered then.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, WrongOutput, close, series_of
from fsdp_lab.models import MLPStack, synthetic_batch, tiny_gpt
from fsdp_lab.reference import local_slice
from fsdp_lab.sharding import ShardingSteps, shard, sharding_state
from fsdp_lab.sharding.steps import regather
from fsdp_lab.sharding.steps import unit_to_prefetch as _mechanism_step
from fsdp_lab.trace import MemoryTracker, Timeline, category

JOINT = ("tok_emb", "head")


def unit_to_prefetch(forward_order: list[str], position: int) -> str | None:
    """Reference: the mechanism's own step (the unit whose forward ended just before)."""
    return _mechanism_step(forward_order, position)


def _forward_next(forward_order: list[str], position: int) -> str | None:
    return forward_order[position + 1] if position + 1 < len(forward_order) else None


def _two_ahead(forward_order: list[str], position: int) -> str | None:
    return forward_order[position - 2] if position >= 2 else None


def _itself(forward_order: list[str], position: int) -> str | None:
    return forward_order[position]


# -- on every rank ---------------------------------------------------------------------------


def _model(case: Case) -> tuple[torch.nn.Module, list, int]:
    """The case's model, its units and its vocabulary. The MLP's embedding is a unit of its own,
    so its root (the head) finishes its backward first and is freed before the others."""
    layers = case.params["layers"]
    blocks = [f"blocks.{i}" for i in range(layers)]
    if case.params.get("joint"):  # the tied embedding and head: one unit, called twice
        return tiny_gpt(n_layers=layers, dim=16, vocab_size=32, seq_len=4), [*blocks, JOINT], 32
    torch.manual_seed(0)
    return MLPStack(vocab_size=16, dim=8, n_layers=layers), ["emb", *blocks], 16


def _train(step: Any, case: Case) -> dict:
    picks: list[tuple[str, int, str | None]] = []  # (unit whose backward began, its place, pick)
    own_pre_backward: list[tuple[str, float, float]] = []  # (unit, entered, left)
    label_of: dict[int, str] = {}  # buffer -> its unit's label, once sharded

    def watched(forward_order: list[str], position: int) -> str | None:
        chosen = step(list(forward_order), position)
        if chosen is not None and chosen not in forward_order:
            raise WrongOutput(
                f"unit_to_prefetch returned {chosen!r}: expected one of the names in "
                f"forward_order {forward_order} or None"
            )
        picks.append((forward_order[position], position, chosen))
        return chosen

    def timed_regather(buffer: torch.Tensor, all_gather: Any) -> None:
        entered = time.perf_counter()
        regather(buffer, all_gather)  # the mechanism's own: a gather issued here is on demand
        own_pre_backward.append((label_of[id(buffer)], entered, time.perf_counter()))

    model, units, vocab = _model(case)
    # The injection point: each unit's pre-backward asks the learner's step what to prefetch.
    steps = ShardingSteps(unit_to_prefetch=watched, regather=timed_regather)
    shard(model, units=units, strategy="full", prefetch=True, mesh=dist.group.WORLD, steps=steps)
    state = sharding_state(model)
    label_of.update({id(u.flat.unsharded): u.label for u in state.units})
    x, y = synthetic_batch(vocab, 12, 4, 0)
    me, n = dist.get_rank(), dist.get_world_size()
    x, y = local_slice(x, me, n), local_slice(y, me, n)
    with MemoryTracker() as mem:
        for unit in state.units:
            mem.track(unit.flat.unsharded, "comm_buffers")
        with category("activations"):
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
        mem.mark("backward begins")
        with Timeline() as timeline, category("activations"):
            loss.backward()
    recorded = timeline.to_dict()
    origin = recorded["origin"]
    gathers = sorted(
        (
            s
            for s in recorded["spans"]
            if s["kind"] == "comm" and s["name"] == "all_gather_into_tensor"
        ),
        key=lambda s: s["start"],
    )

    def on_demand(gather: dict) -> bool:
        start = origin + gather["start"]
        return any(unit == gather["tag"] and a <= start <= b for unit, a, b in own_pre_backward)

    trace = mem.trace()
    begin = next(m["t"] for m in trace["markers"] if m["label"] == "backward begins")
    gathered = trace["bytes"]["comm_buffers"]
    during = [b for t, b in zip(trace["t"], gathered, strict=True) if t >= begin]
    return {
        "picks": picks,
        "forward_order": [u.label for u in state.post_forward_order],
        "gathers": [g["tag"] for g in gathers],
        "on_demand": [g["tag"] for g in gathers if on_demand(g)],
        "peak_gathered": max(during),
        "gathered_at_markers": [
            gathered[trace["t"].index(m["t"])] for m in trace["markers"] if m["t"] >= begin
        ],
        "grad": torch.cat([u.flat_shard_grad() for u in state.units]).tolist(),
    }


def trial(fn: Any, case: Case) -> dict:
    return _train(fn, case)


# -- in the notebook -------------------------------------------------------------------------


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


def _extra(got: list[str], expected: list[str]) -> list[str]:
    left = list(expected)
    extra = []
    for tag in got:
        if tag in left:
            left.remove(tag)
        else:
            extra.append(tag)
    return extra


def _said(pick: Any) -> str:
    return "nothing" if pick is None else str(pick)


def _hint(order: list[str], picks: list[tuple], reference: list[tuple]) -> str:
    """Names the bug that explains every pick differing from the reference's, if one does."""
    rules = {
        "itself": lambda p: order[p],
        "next": lambda p: order[p + 1] if p + 1 < len(order) else None,
        "two": lambda p: order[p - 2] if p >= 2 else None,
    }
    fits = set(rules)
    for (_, position, chosen), (*_, right) in zip(picks, reference, strict=False):
        if chosen != right:
            fits &= {name for name, rule in rules.items() if rule(position) == chosen}
    hints = {
        "itself": "you picked the unit whose backward is running (already gathered): pick the "
        "one backward needs next, forward_order[position - 1].",
        "next": "that is the forward order's next unit, whose backward is already done: "
        "backward runs the forward ends in reverse — take position - 1.",
        "two": "off by one: position - 2 skips the unit backward needs next (it is then "
        "gathered on demand) and holds one unit more: take position - 1.",
    }
    for name in rules:  # the first rule that explains every wrong pick
        if name in fits:
            return hints[name]
    return (
        "backward needs next the unit whose forward ended just before this one: "
        "forward_order[position - 1], and None at position 0."
    )


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, (got, exp) in enumerate(zip(got_all, expected, strict=True)):
        if not close(got["grad"], exp["grad"]):
            return Mismatch(
                f"rank {r}'s gradients differ from the reference: a prefetch only moves an "
                "all-gather earlier, it must never change a value.",
                hint="return a unit's name or None, and do not touch the model or the order.",
            )
        extra = _extra(got["gathers"], exp["gathers"])
        late = _extra(got["on_demand"], exp["on_demand"])
        if not extra and not late and got["peak_gathered"] <= exp["peak_gathered"]:
            continue
        parts = []
        if late:
            parts.append(
                f"backward waited for {len(late)} all-gather(s) nobody prefetched "
                f"({', '.join(late)})"
            )
        if extra:
            parts.append(
                f"it gathered {len(extra)} unit(s) it did not need ({', '.join(extra)}: their "
                "backward was done)"
            )
        if got["peak_gathered"] > exp["peak_gathered"]:
            parts.append(
                f"it held {_kib(got['peak_gathered'])} of gathered parameters at the peak, "
                f"the reference {_kib(exp['peak_gathered'])}"
            )
        rows = [
            (f"prefetch when {unit} begins backward", _said(right), _said(chosen))
            for (unit, _, chosen), (*_, right) in zip(got["picks"], exp["picks"], strict=False)
        ]
        rows += [
            ("all-gathers in backward", str(len(exp["gathers"])), str(len(got["gathers"]))),
            (
                "of them on demand (waited for)",
                str(len(exp["on_demand"])),
                str(len(got["on_demand"])),
            ),
        ]
        return Mismatch(
            f"values right, but on rank {r} " + "; ".join(parts) + ".",
            rows=rows,
            hint=_hint(exp["forward_order"], got["picks"], exp["picks"]),
            series=series_of(
                f"gathered parameters during backward, rank {r}",
                "event of backward, in order: each unit's all-gather, free and reduce-scatter",
                "memory",
                {"reference": exp["gathered_at_markers"], "yours": got["gathered_at_markers"]},
                in_bytes=True,
            ),
        )
    return None


UNIT_TO_PREFETCH = Exercise(
    name="unit_to_prefetch",
    lab="shard",
    title="Prefetch the unit whose backward comes next",
    statement=(
        "While a unit runs its backward, the next unit's all-gather can already travel, so "
        "backward never waits for parameters. Which unit is next? The mechanism records, in "
        "each forward, the order in which the units' forwards **ended** (the root, which "
        "encloses the others, ends last; a unit of several modules appears once per call). "
        "Write `unit_to_prefetch(forward_order, position)`: `forward_order` is that list of "
        "unit names, `position` the index in it of the unit whose backward has just started; "
        "return the name of the unit to gather now, or `None` if no unit's backward follows. "
        "The check trains a sharded GPT one step with prefetch on and measures which "
        "all-gathers backward had to wait for."
    ),
    stub=(
        "def unit_to_prefetch(forward_order, position):\n"
        '    """The name of the unit whose backward comes after that of\n'
        '    forward_order[position], or None."""\n'
    ),
    hints=(
        "Autograd runs backward in the reverse order of the forward: the last forward to end "
        "is the first backward.",
        "So after the unit at `position`, backward needs the unit whose forward ended just "
        "before it.",
        "`forward_order[position - 1]`, and None at position 0 (Python would read index -1 as "
        "the last element).",
    ),
    solution=unit_to_prefetch,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, an MLP: embedding and 3 blocks a unit each, 1 step", 2, {"layers": 3}),
        Case(
            "2 ranks, the tied embedding and head as one unit, called twice",
            2,
            {"layers": 2, "joint": True},
        ),
    ),
    bugs=(
        Bug(
            "forward-next",
            "the forward order's next unit",
            _forward_next,
            "values right, but every unit backward needs is gathered on demand, and units whose "
            "backward is done are gathered again",
        ),
        Bug(
            "two-ahead",
            "off by one: two units ahead",
            _two_ahead,
            "values right, but some units are gathered on demand and one unit more is held "
            "at a time",
        ),
        Bug(
            "itself",
            "off by one: the unit itself",
            _itself,
            "values right, but nothing is prefetched (the unit picked is the one already "
            "gathered): backward waits for every all-gather",
        ),
    ),
    points=2,
    minutes=10,
    replayed=True,  # its answers are plain data: the grader replays them (grading)
)
