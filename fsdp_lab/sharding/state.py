"""`ShardingState`: what the units of one sharded model share, and how to find it on a model.

The process group and this rank's place in it; the order the units ran in on the first step
(a unit of several modules appears once per member call), recorded so that later steps can
prefetch the next unit's all-gather; and the end-of-backward callback that autograd runs once
the whole backward pass is done, which finalizes every unit (FSDP2: ``FSDPState`` and its
``_root_post_backward_final_callback``).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

from fsdp_lab.sharding.mesh import Groups
from fsdp_lab.sharding.unit import ShardedUnit

_STATE = "_fsdp_lab_state"  # on the sharded model
_SHARDED_IN = "_fsdp_lab_sharded_in"  # on each of its submodules: a weak reference to it


class ShardingState:
    """What the units of one sharded model share."""

    def __init__(
        self,
        *,
        groups: Groups,
        prefetch: bool,
        strategy: str,
    ) -> None:
        self.groups = groups
        # The shard group, its size and this rank's place in it (every rank, unless hybrid).
        self.group, self.world, self.rank = groups.group, groups.world, groups.rank
        self.prefetch, self.strategy = prefetch, strategy
        self.units: list[ShardedUnit] = []
        # Unit calls in the order of the first step (repeats: a group unit runs once per member).
        self.forward_order: list[ShardedUnit] = []
        self.backward_order: list[ShardedUnit] = []
        self._forward_calls = 0  # calls so far in this step's forward
        self._backward_calls = 0
        self._forward_recorded = False
        self._backward_recorded = False
        self._backward_queued = False

    @property
    def root(self) -> ShardedUnit:
        return self.units[0]

    def begin_step(self) -> None:
        """Root pre-forward: a new step. Shards may have changed (optimizer step)."""
        if self.forward_order:
            self._forward_recorded = True
        self._forward_calls = 0
        for unit in self.units:
            unit.stale = True

    def record_forward(self, unit: ShardedUnit) -> None:
        if not self._forward_recorded:
            self.forward_order.append(unit)
        self._forward_calls += 1

    def next_in_forward(self, unit: ShardedUnit) -> ShardedUnit | None:
        if not self._forward_recorded:
            return None
        return _next_call(self.forward_order, self._forward_calls, unit)

    def begin_backward(self, unit: ShardedUnit) -> None:
        if not self._backward_queued:
            # Runs once autograd has finished the whole backward pass.
            torch.autograd.Variable._execution_engine.queue_callback(self.finalize_backward)
            self._backward_queued = True
        if not self._backward_recorded:
            self.backward_order.append(unit)
        self._backward_calls += 1

    def next_in_backward(self, unit: ShardedUnit) -> ShardedUnit | None:
        if not self._backward_recorded:
            return None
        return _next_call(self.backward_order, self._backward_calls, unit)

    def finalize_backward(self) -> None:
        """Autograd's final callback (FSDP2's ``_root_post_backward_final_callback``): the
        step's backward is over, so every unit finishes its part, last unit first."""
        self._backward_queued = False
        self._backward_calls = 0
        if self.backward_order:
            self._backward_recorded = True
        for unit in reversed(self.units):
            unit.finalize_backward()


def _next_call(order: list[ShardedUnit], calls: int, unit: ShardedUnit) -> ShardedUnit | None:
    """The unit of call number `calls` (0-based), if this step still follows the recorded order.

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
