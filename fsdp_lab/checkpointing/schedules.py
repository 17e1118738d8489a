"""Activation-checkpointing schedules over a chain of N layers, driven by hand.

Backward needs every layer's input. Keeping them all costs O(N) memory; keeping fewer means
recomputing the rest during the backward sweep. A *schedule* decides which layer inputs to
keep and what to recompute; this module runs one by hand, layer by layer, the way the textbook
schedules are defined: a forward sweep under `torch.no_grad()` keeps a few layer inputs
("checkpoints"), then the backward sweep, from the last layer down, rebuilds a layer's input
from the nearest checkpoint, runs that layer under grad, backpropagates the running gradient
through it with `torch.autograd.backward`, and hands the input gradient down.

    store_all        plain autograd                    N stored      N calls
    full_recompute   every layer from the input        2 stored      N(N+1)/2 calls
    every(C)         C evenly spaced checkpoints (N/C layers apart; "every C layers" would be
                     every(N/C)), each layer rebuilt from its nearest one
                                                       C+1 stored    N^2/(2C) + 3N/2 - N/C calls
    segments(k)      Chen et al. 2016, "Training deep nets with sublinear memory cost": rerun
                     each k-layer segment once under grad    ~N/k + k stored    < 2N calls
    optimal(b)       the fewest calls that keep at most b layer inputs alive, by dynamic
                     programming in this module's units (below) — not revolve's
    revolve(s)       Griewank & Walther's binomial checkpointing (revolve, ACM TOMS Algorithm
                     799, 2000) in *their* units: s stored states, each layer taped alone

Units: *stored activations* = the most layer inputs alive at once (the chain input counts);
*calls* = layer forward calls; *advances* = the calls made under no_grad. All are counted by
forward hooks (`LayerInputCounter`) and must equal `fsdp_lab.theory.checkpoint_cost(schedule,
n)`. Bytes are measured by `MemoryTracker`, never derived; timing and measuring a schedule is
the lab's (`fsdp_lab.checkpointing.lab.measure`).

[Note: two conventions] Griewank–Walther count *advances* (forward steps that store nothing),
give every step exactly one taped forward right before its reverse step, and price memory in
*snapshots*: s stored states, the initial one included, the state being worked on not counted.
Then the longest chain reversible with s snapshots and no step advanced more than r times is
l = C(s + r, s), and the fewest advances are t = r·l − C(s + r, s + 1)
(`theory.revolve_advances`). `optimal(b)` counts differently: a grad-mode forward *doubles as
the advance* (a tape of m layers from a held input replaces m advances), and a tape of m layers
costs m slots (autograd keeps the m inputs), the held input included. Its DP searches a larger
set of plans — every `revolve(s)` plan is one of them, keeping s + 1 inputs in these units (the
s snapshots and the state being taped) — so optimal(s + 1) never makes more calls than
revolve(s), and usually fewer.

[Note: the last layer runs once] The output is first computed by the grad-mode run that
starts the backward sweep, so no schedule forwards the last segment under no_grad just to see
the loss (`torch.utils.checkpoint.checkpoint_sequential` likewise leaves its last segment
alone): segments(k) makes 2N - (length of the last segment) calls, not 2N.

[Note: what a slot costs] optimal(b) is optimal in *kept layer inputs*, not in bytes: it
prices every kept input alike, but a layer run under grad also keeps its internals
(ChainLayer: its GELU input), so in bytes a layer of a tape costs about twice a checkpoint, and
optimal(b) can hold more bytes than segments(k) or revolve(s) at equal kept inputs.

[Note: randomness] Recomputing assumes a deterministic layer. Dropout would need the RNG state
saved with each checkpoint (`preserve_rng_state` in `torch.utils.checkpoint`); not done here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.trace.memory import category

SCHEDULES = ("store_all", "full_recompute", "every", "segments", "optimal", "revolve")
_ARG_NAME = {"every": "C", "segments": "k", "optimal": "budget", "revolve": "s"}


@dataclass(frozen=True)
class Schedule:
    """`name` (one of `SCHEDULES`) and its int argument: C, k, budget or s (None otherwise)."""

    name: str
    arg: int | None = None

    def __post_init__(self) -> None:
        if self.name not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.name!r}; allowed: {', '.join(SCHEDULES)}")
        arg_name, arg = _ARG_NAME.get(self.name), self.arg
        if arg_name is None and arg is not None:
            raise ValueError(f"{self.name} takes no argument, got {arg!r}")
        if arg_name and (isinstance(arg, bool) or not isinstance(arg, int) or arg < 1):
            raise ValueError(f"{self.name}({arg_name}={arg!r}): expected an int >= 1")

    def __str__(self) -> str:
        return self.name if self.arg is None else f"{self.name}({self.arg})"


store_all = Schedule("store_all")
full_recompute = Schedule("full_recompute")


def every(c: int) -> Schedule:
    return Schedule("every", c)


def segments(k: int) -> Schedule:
    return Schedule("segments", k)


def optimal(budget: int) -> Schedule:
    """The fewest calls with at most `budget` layer inputs alive, in this module's units (a
    grad-mode forward doubles as the advance; a tape of m layers holds m inputs)."""
    return Schedule("optimal", budget)


def revolve(snapshots: int) -> Schedule:
    """Griewank–Walther's binomial schedule: `snapshots` stored states (the chain input one of
    them), the fewest advances, every layer taped alone just before its backward."""
    return Schedule("revolve", snapshots)


# -- plans: what the executor runs, and what they cost ----------------------------------------


@dataclass(frozen=True)
class Tape:
    """Run `n` layers under grad from the held input (autograd keeps all n inputs), backprop."""

    n: int


@dataclass(frozen=True)
class Recompute:
    """For each of `n` layers, last first: advance from the held input, run it under grad."""

    n: int


@dataclass(frozen=True)
class Sweep:
    """Advance under no_grad keeping the input of every part, then reverse the parts, last first.

    A two-part Sweep is the move both optimal plans are built of: advance j, store a
    checkpoint, reverse the right part with one slot fewer, free the checkpoint, reverse the
    left part.
    """

    lengths: tuple[int, ...]
    parts: tuple[Plan, ...]


Plan = Tape | Recompute | Sweep


@dataclass(frozen=True)
class ScheduleCost:
    stored_activations: int  # most layer inputs alive at once
    forward_calls: int  # layer forward calls, no_grad and grad together


def min_budget(n: int) -> int:
    """1 for one layer; else 2: recomputing needs the held input and the one being rebuilt."""
    return 1 if n == 1 else 2


def check_range(schedule: Schedule, n: int) -> None:
    """A ValueError unless `schedule`'s argument fits a chain of `n` layers."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"a chain needs N >= 1 layers, got {n!r}")
    lo = min_budget(n) if schedule.name == "optimal" else 1
    if schedule.arg is not None and not lo <= schedule.arg <= n:
        raise ValueError(
            f"{schedule.name}({_ARG_NAME[schedule.name]}={schedule.arg}) is out of range for a "
            f"chain of N={n} layers: allowed {lo}..{n}"
        )


def every_lengths(n: int, c: int) -> tuple[int, ...]:
    starts = [i * n // c for i in range(c)] + [n]  # evenly spaced; the first is the input
    return tuple(b - a for a, b in zip(starts, starts[1:], strict=False))


def segment_starts(n: int, k: int) -> list[int]:
    """Where segments(k)'s checkpoints sit: the first layer of each k-layer segment (the last
    may be shorter). 0 comes first: the chain input is the first checkpoint."""
    return list(range(0, n, k))


StartsFn = Callable[[int, int], Sequence[int]]
"""``(n layers, k) -> first layer of each segment``: `segment_starts`, or another choice."""


def _lengths_from_starts(starts: Sequence[int], n: int) -> tuple[int, ...]:
    """Segment lengths from their first layers; a ValueError naming the fix if they do not cut
    0..n-1 into non-empty runs."""
    starts = list(starts)
    if not starts or starts[0] != 0:
        raise ValueError(
            f"segment starts {starts}: the first must be 0 (the chain input is the first "
            "checkpoint)"
        )
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)) or starts[-1] >= n:
        raise ValueError(
            f"segment starts {starts}: expected strictly increasing layer indexes below N={n}"
        )
    return tuple(b - a for a, b in zip(starts, [*starts[1:], n], strict=True))


def _optimal_table(n: int, budget: int) -> dict[tuple[int, int], tuple[int, int, int]]:
    """best[length, s] = (calls, stored, j) to reverse `length` layers whose input is held,
    with at most s layer inputs alive (the held one included); j = 0 means "tape them all".

    T(n, s) = n if n <= s (every layer needs one grad call, so a tape is unbeatable), else
    min over j of [j advance calls + T(n - j, s - 1) + T(j, s)]: the checkpoint at j costs
    the right part one slot. s = 1 with n > 1 is infeasible (no entry). Ties: less memory.
    """
    best: dict[tuple[int, int], tuple[int, int, int]] = {}
    for s in range(1, budget + 1):
        for length in range(1, n + 1):
            if length <= s:
                best[length, s] = (length, length, 0)
            elif s > 1:  # s = 1 (only the held input) cannot rebuild anything
                options = []
                for j in range(1, length) if s > 2 else [length - 1]:  # 1 slot: 1 layer
                    left, right = best[j, s], best[length - j, s - 1]
                    options.append((j + left[0] + right[0], max(left[1], 1 + right[1]), j))
                best[length, s] = min(options)
    return best


def _binomial_table(n: int, snapshots: int) -> dict[tuple[int, int], tuple[int, int, int, int]]:
    """best[length, s] = (advances, repetitions, stored, j): Griewank–Walther's recursion, to
    reverse `length` steps from a state held in one of s snapshots; j = 0: tape the one step.

    G(1, s) = 0 advances: tape the step from the state in hand. Else advance j steps, keep the
    state reached (one more snapshot, unless only one step is left of it: then it is the state
    in hand), reverse the right part, free it, reverse the left part with the s snapshots:
    G(l, s) = min over j of [j + G(l - j, s - 1) + G(j, s)]. The left part's steps are advanced
    once more (repetitions + 1). Ties: fewer repetitions, then less memory — so the plan also
    shows the binomial law's r (Griewank 1992: the advance-optimal plans reach it).
    """
    best: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    for s in range(1, snapshots + 1):
        best[1, s] = (0, 0, 1, 0)
        for length in range(2, n + 1):
            options = []
            for j in range(1, length) if s > 1 else [length - 1]:  # 1 snapshot: one step right
                left = best[j, s]
                right = best[length - j, s - 1] if length - j > 1 else best[1, s]
                reps = max(left[1] + 1, right[1])
                options.append((j + left[0] + right[0], reps, max(left[2], 1 + right[2]), j))
            best[length, s] = min(options)
    return best


def _split_plan(best: dict[tuple[int, int], Any], n: int, s: int) -> Plan:
    """The plan a DP table chose: a tape (j = 0) or a two-part Sweep, recursively."""
    j = best[n, s][-1]
    if j == 0:
        return Tape(n)
    right = Tape(1) if n - j == 1 else _split_plan(best, n - j, s - 1)
    return Sweep((j, n - j), (_split_plan(best, j, s), right))


def make_plan(schedule: Schedule, n: int, starts: StartsFn = segment_starts) -> Plan:
    """The plan `run_chain` executes for `schedule` on a chain of `n` layers.

    Args:
        starts: where segments(k) puts its checkpoints (course mode swaps in a learner's
            choice here); the other schedules ignore it.
    """
    check_range(schedule, n)
    name, arg = schedule.name, schedule.arg or 0
    if name == "store_all":
        return Tape(n)
    if name == "full_recompute":
        return Recompute(n)
    if name == "every":
        lengths = every_lengths(n, arg)
        return Sweep(lengths, tuple(Recompute(length) for length in lengths))
    if name == "segments":
        lengths = _lengths_from_starts(starts(n, arg), n)
        return Sweep(lengths, tuple(Tape(length) for length in lengths))
    if name == "revolve":
        return _split_plan(_binomial_table(n, arg), n, arg)
    return _split_plan(_optimal_table(n, arg), n, arg)


def optimal_cost(n: int, budget: int) -> tuple[int, int]:
    """(layer forward calls, most stored inputs) of `optimal(budget)`'s plan, from its DP."""
    calls, stored, _ = _optimal_table(n, budget)[n, budget]
    return calls, stored


def revolve_cost(n: int, snapshots: int) -> tuple[int, int, int]:
    """(advances, most advances of one layer, most stored inputs) of `revolve(snapshots)`'s
    plan, from Griewank–Walther's recursion (the binomial closed form is `theory`'s)."""
    advances, repetitions, stored, _ = _binomial_table(n, snapshots)[n, snapshots]
    return advances, repetitions, stored


# -- the executor ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainOutput:
    output: torch.Tensor  # (B, dim), detached
    loss: torch.Tensor | None  # detached; None when an upstream gradient was given
    grad_input: torch.Tensor  # d(loss)/d(x), (B, dim); x.grad is left alone


class _Executor:
    def __init__(self, layers: list[nn.Module], loss_fn: Callable | None) -> None:
        self.layers, self.loss_fn = layers, loss_fn
        self.output: torch.Tensor | None = None
        self.loss: torch.Tensor | None = None

    def call(self, i: int, a: torch.Tensor) -> torch.Tensor:
        out = self.layers[i](a)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"layer {i} returned a {type(out).__name__}, expected a Tensor")
        return out

    def advance(self, lo: int, hi: int, a: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():  # nothing saved: each input dies as soon as the next exists
            for i in range(lo, hi):
                a = self.call(i, a)
        return a

    def tape(self, lo: int, n: int, a: torch.Tensor, grad: torch.Tensor | None) -> torch.Tensor:
        leaf = a.detach().requires_grad_()  # same storage as `a`: no copy, just a graph root
        y = leaf
        with torch.enable_grad():
            for i in range(lo, lo + n):
                y = self.call(i, y)  # (B, dim); autograd keeps each layer's input
            if lo + n == len(self.layers):  # every plan's first tape: the chain's output
                self.output = y.detach()
                if grad is None:
                    y = self.loss_fn(y)
                    self.loss = y.detach()
        # Backward allocates gradients: the tracker's "activations" keep only forward's bytes.
        with category("gradients"):
            torch.autograd.backward(y, grad)  # frees this tape's saved tensors; params' .grad +=
        return leaf.grad

    def reverse(
        self, plan: Plan, lo: int, a: torch.Tensor, grad: torch.Tensor | None
    ) -> torch.Tensor:
        """Given the held input `a` of the plan's layers (from `lo`) and the gradient at their
        output (None: the loss's), accumulate parameter grads and return the gradient at `a`."""
        if isinstance(plan, Tape):
            return self.tape(lo, plan.n, a, grad)
        if isinstance(plan, Recompute):
            for i in reversed(range(lo, lo + plan.n)):
                grad = self.tape(i, 1, self.advance(lo, i, a), grad)
            return grad
        starts = [lo]
        for length in plan.lengths[:-1]:
            starts.append(starts[-1] + length)
        checkpoints = [a]
        for start, length in zip(starts[1:], plan.lengths, strict=False):  # the forward sweep
            checkpoints.append(self.advance(start - length, start, checkpoints[-1]))
        for part, start in zip(reversed(plan.parts), reversed(starts), strict=True):
            grad = self.reverse(part, start, checkpoints.pop(), grad)  # popped: freed when done
        return grad


def run_chain(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    schedule: Schedule,
    *,
    grad_output: torch.Tensor | None = None,
    loss_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    starts: StartsFn = segment_starts,
) -> ChainOutput:
    """Forward and backward of `layers` on `x` under `schedule`; parameter .grad accumulate.

    Args:
        layers: modules mapping a tensor to a tensor, in order (a `Chain`'s `.layers`).
        x: the chain input (B, dim); it is the first stored activation.
        schedule: e.g. `segments(4)`.
        grad_output: the upstream gradient at the chain output — or instead
        loss_fn: a scalar function of the output to backpropagate from.
        starts: where segments(k) puts its checkpoints (see `make_plan`).
    """
    if (grad_output is None) == (loss_fn is None):
        raise ValueError("give exactly one of grad_output and loss_fn")
    layers = list(layers)
    plan = make_plan(schedule, len(layers), starts)
    run = _Executor(layers, loss_fn)
    with category("activations"):
        grad_input = run.reverse(plan, 0, x.detach(), grad_output)
    assert run.output is not None  # every plan ends in a tape over the last layer
    return ChainOutput(run.output, run.loss, grad_input)


class LayerInputCounter:
    """Forward hooks on every layer: how many calls (and how many of them under no_grad, the
    *advances*, per layer), and the most layer inputs alive at once.

    Alive: a storage that was some layer's input and still exists (held as a checkpoint or
    saved by autograd); one weakref per storage tells. A layer's output is no input yet, so
    the count can only grow at a pre-forward hook: sampling there catches the peak.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.forward_calls = self.stored_activations = 0
        self.advances_per_layer = [0] * len(self.layers)  # no_grad calls of layer i
        self._inputs: dict[int, weakref.ref] = {}
        self._handles: list[Any] = []

    @property
    def advances(self) -> int:
        """Calls that stored nothing for backward (under no_grad): Griewank–Walther's t."""
        return sum(self.advances_per_layer)

    @property
    def repetitions(self) -> int:
        """The most advances of any one layer: Griewank–Walther's r."""
        return max(self.advances_per_layer, default=0)

    def _pre_forward(self, i: int, module: nn.Module, args: tuple) -> None:
        self.forward_calls += 1
        if not torch.is_grad_enabled():
            self.advances_per_layer[i] += 1
        storage = args[0].untyped_storage()  # PyTorch keeps one Python object per storage
        self._inputs = {key: ref for key, ref in self._inputs.items() if ref() is not None}
        self._inputs[id(storage)] = weakref.ref(storage)
        self.stored_activations = max(self.stored_activations, len(self._inputs))

    def __enter__(self) -> LayerInputCounter:
        self._handles = [
            m.register_forward_pre_hook(functools.partial(self._pre_forward, i))
            for i, m in enumerate(self.layers)
        ]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
