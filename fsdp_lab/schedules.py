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
    every(C)         C evenly spaced checkpoints       C+1 stored    ~N^2/(2C) calls
    segments(k)      Chen et al. 2016, "Training deep nets with sublinear memory cost": rerun
                     each k-layer segment once under grad    ~N/k + k stored    < 2N calls
    optimal(b)       Griewank & Walther's revolve (ACM TOMS Algorithm 799, 2000): the fewest
                     calls that keep at most b layer inputs alive, by dynamic programming

Units: *stored activations* = the most layer inputs alive at once (the chain input counts);
*calls* = layer forward calls. Both are counted by forward hooks (`LayerInputCounter`) and
must equal `fsdp_lab.theory.checkpoint_cost(schedule, n)`. Bytes are measured by `MemoryTracker`,
never derived; timing and measuring a schedule is the lab's (`fsdp_lab.labs.checkpoint.measure`).

[Note: the last layer runs once] The output is first computed by the grad-mode run that
starts the backward sweep, so no schedule forwards the last segment under no_grad just to see
the loss (`torch.utils.checkpoint.checkpoint_sequential` likewise leaves its last segment
alone): segments(k) makes 2N - (length of the last segment) calls, not 2N.

[Note: what a slot costs] revolve prices every kept layer input alike. A layer run under grad
also keeps its internals (ChainLayer: its GELU input), so in *bytes* a "taped" layer costs
about twice a checkpoint, and optimal(b) can lose to segments(k) at equal bytes.

[Note: randomness] Recomputing assumes a deterministic layer. Dropout would need the RNG state
saved with each checkpoint (`preserve_rng_state` in `torch.utils.checkpoint`); not done here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.trace.memory import category

SCHEDULES = ("store_all", "full_recompute", "every", "segments", "optimal")
_ARG_NAME = {"every": "C", "segments": "k", "optimal": "budget"}


@dataclass(frozen=True)
class Schedule:
    """`name` (one of `SCHEDULES`) and its int argument: C, k or budget (None otherwise)."""

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
    return Schedule("optimal", budget)


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

    A two-part Sweep is revolve's move: advance j, store a checkpoint, reverse the right part
    with one slot fewer, free the checkpoint, reverse the left part.
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


def _segment_lengths(n: int, k: int) -> tuple[int, ...]:
    return (k,) * (n // k) + ((n % k,) if n % k else ())


def _revolve_table(n: int, budget: int) -> dict[tuple[int, int], tuple[int, int, int]]:
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


def _revolve_plan(best: dict[tuple[int, int], tuple[int, int, int]], n: int, s: int) -> Plan:
    j = best[n, s][2]
    if j == 0:
        return Tape(n)
    return Sweep((j, n - j), (_revolve_plan(best, j, s), _revolve_plan(best, n - j, s - 1)))


def make_plan(schedule: Schedule, n: int) -> Plan:
    """The plan `run_chain` executes for `schedule` on a chain of `n` layers."""
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
        lengths = _segment_lengths(n, arg)
        return Sweep(lengths, tuple(Tape(length) for length in lengths))
    return _revolve_plan(_revolve_table(n, arg), n, arg)


def revolve_cost(n: int, budget: int) -> tuple[int, int]:
    """(layer forward calls, most stored inputs) of revolve's optimal plan for `budget`."""
    calls, stored, _ = _revolve_table(n, budget)[n, budget]
    return calls, stored


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
) -> ChainOutput:
    """Forward and backward of `layers` on `x` under `schedule`; parameter .grad accumulate.

    Args:
        layers: modules mapping a tensor to a tensor, in order (a `Chain`'s `.layers`).
        x: the chain input (B, dim); it is the first stored activation.
        schedule: e.g. `segments(4)`.
        grad_output: the upstream gradient at the chain output — or instead
        loss_fn: a scalar function of the output to backpropagate from.
    """
    if (grad_output is None) == (loss_fn is None):
        raise ValueError("give exactly one of grad_output and loss_fn")
    layers = list(layers)
    plan = make_plan(schedule, len(layers))
    run = _Executor(layers, loss_fn)
    with category("activations"):
        grad_input = run.reverse(plan, 0, x.detach(), grad_output)
    assert run.output is not None  # every plan ends in a tape over the last layer
    return ChainOutput(run.output, run.loss, grad_input)


class LayerInputCounter:
    """Forward hooks on every layer: how many calls, and the most layer inputs alive at once.

    Alive: a storage that was some layer's input and still exists (held as a checkpoint or
    saved by autograd); one weakref per storage tells. A layer's output is no input yet, so
    the count can only grow at a pre-forward hook: sampling there catches the peak.
    """

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        self.layers = list(layers)
        self.forward_calls = self.stored_activations = 0
        self._inputs: dict[int, weakref.ref] = {}
        self._handles: list[Any] = []

    def _pre_forward(self, module: nn.Module, args: tuple) -> None:
        self.forward_calls += 1
        storage = args[0].untyped_storage()  # PyTorch keeps one Python object per storage
        self._inputs = {key: ref for key, ref in self._inputs.items() if ref() is not None}
        self._inputs[id(storage)] = weakref.ref(storage)
        self.stored_activations = max(self.stored_activations, len(self._inputs))

    def __enter__(self) -> LayerInputCounter:
        self._handles = [m.register_forward_pre_hook(self._pre_forward) for m in self.layers]
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
