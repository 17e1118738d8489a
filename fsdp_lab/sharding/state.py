"""`ShardingState`: what the units of one sharded model share, and how to find it on a model.

The process group and this rank's place in it; the order the units ran in (a unit of several
modules appears once per member call), recorded so that the next unit's all-gather can start
early: forward follows the order of the first step's forward; backward runs the units in the
reverse order of this step's forward *ends* (FSDP2's ``post_forward_order``), so the unit to
prefetch is the one whose forward ended just before (the step `unit_to_prefetch`); and the
end-of-backward callback that autograd runs once the whole backward pass is done, which
finalizes every unit (FSDP2: ``FSDPState`` and its ``_root_post_backward_final_callback``).

The steps a learner writes (`steps.py`) arrive here as one frozen `ShardingSteps`, given to
`shard(..., steps=...)`; the units call them through it. This module needs of a unit only its
label and `finalize_backward` (`_Unit`), so `unit.py` builds on it and not the other way round.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
import torch.nn as nn

from fsdp_lab.choices import Strategy
from fsdp_lab.sharding.mesh import Groups
from fsdp_lab.sharding.steps import ShardingSteps

_STATE = "_fsdp_lab_state"  # on the sharded model
_SHARDED_IN = "_fsdp_lab_sharded_in"  # on each of its submodules: a weak reference to it


class _Unit(Protocol):
    """What the state needs of a unit (`unit.ShardedUnit`)."""

    label: str
    stale: bool

    def finalize_backward(self) -> None: ...


class ShardingState:
    """What the units of one sharded model share."""

    def __init__(
        self,
        *,
        groups: Groups,
        prefetch: bool,
        strategy: Strategy,
        steps: ShardingSteps,
    ) -> None:
        self.groups = groups
        # The shard group, its size S and this rank's place in it (every rank, unless hybrid).
        self.group, self.shard_size, self.shard_rank = (
            groups.group,
            groups.shard_size,
            groups.shard_rank,
        )
        self.prefetch, self.strategy, self.steps = prefetch, strategy, steps
        self.units: list[_Unit] = []
        # Unit calls in the order of the first step (repeats: a group unit runs once per member).
        self.forward_order: list[_Unit] = []
        self._forward_calls = 0  # calls so far in this step's forward
        self._forward_recorded = False
        # This step's forward ends, and per unit its places there not yet used by a backward.
        self.post_forward_order: list[_Unit] = []
        self._positions: dict[_Unit, list[int]] = {}
        self._backward_queued = False

    @property
    def root(self) -> _Unit:
        return self.units[0]

    def begin_step(self) -> None:
        """Root pre-forward: a new step. Shards may have changed (optimizer step)."""
        if self.forward_order:
            self._forward_recorded = True
        self._forward_calls = 0
        self.post_forward_order, self._positions = [], {}
        for unit in self.units:
            unit.stale = True

    def record_forward(self, unit: _Unit) -> None:
        if not self._forward_recorded:
            self.forward_order.append(unit)
        self._forward_calls += 1

    def next_in_forward(self, unit: _Unit) -> _Unit | None:
        if not self._forward_recorded:
            return None
        return _next_call(self.forward_order, self._forward_calls, unit)

    def record_post_forward(self, unit: _Unit) -> None:
        """`unit`'s forward has ended (with a backward to come)."""
        if self._backward_queued:  # a forward inside backward (a checkpoint's recompute)
            return
        self._positions.setdefault(unit, []).append(len(self.post_forward_order))
        self.post_forward_order.append(unit)

    def begin_backward(self, unit: _Unit) -> None:
        if not self._backward_queued:
            # Runs once autograd has finished the whole backward pass.
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)
            self._backward_queued = True

    def next_in_backward(self, unit: _Unit) -> _Unit | None:
        """The unit whose backward comes after `unit`'s, which has just started: the step
        `unit_to_prefetch` picks it from this step's forward ends (FSDP2 pops the latest
        post-forward index of the group, as here)."""
        positions = self._positions.get(unit)
        if not positions:
            return None  # its forward ran without a graph: no place to start from
        names = [u.label for u in self.post_forward_order]
        chosen = self.steps.unit_to_prefetch(names, positions.pop())
        if chosen is None:
            return None
        for candidate in self.post_forward_order:
            if candidate.label == chosen:
                return candidate
        raise ValueError(
            f"unit_to_prefetch returned {chosen!r}; expected one of {sorted(set(names))} or None"
        )

    def finalize_backward(self) -> None:
        """Autograd's final callback (FSDP2's ``_root_post_backward_final_callback``): the
        step's backward is over, so every unit finishes its part, last unit first."""
        self._backward_queued = False
        for unit in reversed(self.units):
            unit.finalize_backward()


def _next_call(order: list[_Unit], calls: int, unit: _Unit) -> _Unit | None:
    """The unit of call number `calls` (0-based), if this step still follows the recorded order
    of the first step's forward.

    `unit` has just made call `calls - 1`; if the recording disagrees (the model took another
    path this step), nothing is prefetched rather than the wrong unit.
    """
    if not 0 < calls < len(order) or order[calls - 1] is not unit:
        return None
    return order[calls]


def attach_state(model: nn.Module, state: ShardingState) -> None:
    """Mark `model` as sharded by `state`, and each submodule as part of it (so that sharding
    ``model.blocks[0]`` later is refused: its parameters are already views into flat shards)."""
    setattr(model, _STATE, state)
    for module in model.modules():
        if module is not model:
            setattr(module, _SHARDED_IN, weakref.ref(model))


def sharding_state(model: nn.Module, required: bool = True) -> ShardingState | None:
    """The state `shard` attached to `model`; if it is not sharded, a ValueError (or None with
    ``required=False``)."""
    state = getattr(model, _STATE, None)
    if state is None and required:
        raise ValueError("this model is not sharded: call fsdp_lab.shard(model, ...) first")
    return state


def sharded_root(module: nn.Module) -> nn.Module | None:
    """The sharded model `module` is a submodule of, if any (and still alive)."""
    ref = getattr(module, _SHARDED_IN, None)
    return ref() if ref is not None else None
