"""One wrap unit's life in a training step, in the order it happens.

(Over 450 lines on purpose: a unit's hooks are one state machine — gather, views, free,
reduction and the states between them call each other in the order a step runs them, read
top to bottom as one step.)

    forward     pre-forward   unshard: all-gather the shards into the unsharded buffer,
                              point the module's parameters at views of it
                              (and start gathering the next unit: prefetch)
                compute       the module's own forward
                post-forward  reshard: free the buffer (ZeRO-3), or keep it (ZeRO-1/2)
    backward    pre-backward  unshard again if it was freed (a hook on the unit's output)
                              (and start gathering the unit whose backward comes next)
                compute       autograd: gradients of the views accumulate in the buffer's .grad
                post-backward reshard (the gradient is a tensor of its own), then
                              reduce-scatter it into the shard's .grad (mean over ranks)

Five steps are plain functions in `steps.py` — `cast_floats` (pre- and post-forward),
`free_unsharded`, `regather`, `unit_to_prefetch`, `reduce_grad_shard` — which
the units call through their state's `ShardingSteps`, so a course exercise runs a learner's
version of one inside this very mechanism, passed to `shard(..., steps=...)`.

A replicated unit computes with its own parameters and sends its gradients in DDP's buckets
while backward runs (`policy.py`) — and so does every uncast unit in a world of one, with
nothing to send: one rank then runs the plain model's operators. An offloaded unit copies its
shard from host memory before each gather and its gradient shard back after the reduction
(`policy.py`).

The names are FSDP2's (`unshard`, `reshard`, `TrainingState`); every collective goes through
`fsdp_lab.comm` (counted) and every gather/free is a marker on the memory trace.

[Note: a unit of several modules] A plan may group sibling modules into one unit, e.g. the tied
embedding and head of a GPT (FSDP2: ``fully_shard([model.tok_emb, model.head])``). The hooks
then sit on every member: each member call gathers the unit and frees it after (ZeRO-3), so
the tied matrix is not held while the blocks in between run — which it would be in the root
unit. In backward the gradients of all members' views meet in one accumulator, so the
reduce-scatter (post-backward) fires once, after the last member's backward; between member
backwards the unit is freed as soon as a member call's gradients are computed (a pre-hook on
that call's split) and gathered again by the next member's pre-backward.

[Note: per-parameter views] By default (`use_orig_params=True`, FSDP2's behaviour) each original
parameter stays registered under its own name as an `nn.Parameter` holding this rank's slice of
it: a 1-D view into the flat shard (its full shape when replicated, as DDP keeps it). So
`named_parameters()` keeps names, order and `requires_grad`, optimizer groups work, and an
optimizer step on a slice writes the flat shard in place. While the unit runs, the module's
attribute — and what `module.parameters()` yields, as under FSDP2 — is the gathered view instead
(put in the module's `_parameters`); outside forward and backward it is the slice again.
Gradients: post-backward reduce-scatters the unit's whole gradient in one message, then hands
each parameter its slice of it — except a frozen parameter (`requires_grad=False`: its view is
detached, so autograd never computes it) and a parameter that got no gradient in this backward
(a hook on its view never fired): their `.grad` stays None, so no optimizer moves them, weight
decay included. FSDP1 needs a uniform `requires_grad` per flat parameter; here one unit mixes
them, since the choice is made per view. Like `fully_shard`, the unit decides from its own
backward which parameters got a gradient: every rank must take the same path through the model.
With `use_orig_params=False` the unit's one flat parameter is what the optimizer sees (FSDP1's
default, which the sharding lab draws): one `requires_grad` per unit, and a parameter with no
gradient gets zeros there, as in FSDP1.
"""

from __future__ import annotations

import time
import weakref
from enum import Enum, auto
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fsdp_lab import comm
from fsdp_lab.sharding.flat_param import FlatParameter
from fsdp_lab.sharding.policy import GradBuckets, UnitPlan
from fsdp_lab.sharding.state import ShardingState
from fsdp_lab.trace import category, mark
from fsdp_lab.trace.timeline import active_timeline


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()
    PRE_BACKWARD = auto()
    POST_BACKWARD = auto()


class ShardedUnit:
    """The hooks and collectives of one unit; `flat` holds its storage."""

    def __init__(
        self,
        *,
        name: str,
        modules: list[nn.Module],
        flat: FlatParameter,
        owners: list[list[tuple[nn.Module, str]]],
        aliases: list[tuple[str, ...]],
        plan: UnitPlan,
        state: ShardingState,
        params: list[nn.Parameter] | None = None,
        frozen: list[bool] | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        self.name, self.module, self.flat, self.owners = name, modules[0], flat, owners
        self.grouped = len(modules) > 1  # a unit of several modules (see the Note above)
        self.aliases = aliases  # per flat segment: every original name (2+ when tied)
        self.plan, self.strategy, self.state = plan, plan.strategy, state
        self.reshard_after_forward = plan.reshard_after_forward
        self.reduce_dtype = plan.reduce_dtype or flat.shard.dtype
        self.training_state = TrainingState.IDLE
        self.stale = True  # the shard changed (optimizer step) since the last gather
        self._gather: comm.CommWork | None = None  # an all-gather in flight (prefetch)
        self._gather_input: torch.Tensor | None = None  # kept alive until the gather ends
        self._grad_ready = False
        self._graphs = 0  # forward graphs of this step whose gradient is not built yet
        self._recomputing = False
        self._compute_start = 0.0
        self.label = "root" if name == "" else name
        # Per-parameter views (see the Note): each segment's sharded Parameter; None: flat.
        self.params = params
        self.frozen = frozen or [False] * len(flat.segments)
        self._got_grad = [False] * len(flat.segments)  # in this backward, per segment
        # Replicated, not cast, per-parameter, over one group of 2+ ranks: DDP's buckets, sent
        # during backward (`policy.py`).
        self.buckets: GradBuckets | None = None
        one_group = state.groups.replicas == 1 and state.groups.shard_size > 1
        if flat.aliased and params is not None and bucket_bytes > 0 and one_group:
            each = (state.groups.shard_size, bucket_bytes, self.label, self._all_gradients_sent)
            self.buckets = GradBuckets(params, state.group, *each, self.reduce_dtype)
        # DDP's way — each module computes with its own registered parameters, autograd fills
        # their .grad — with buckets to send, or in a world of one with nothing to gather, cast
        # or send: the step then runs the plain model's operators.
        self.world = state.groups.shard_size * state.groups.replicas
        same_dtype = self.reduce_dtype == flat.shard.dtype
        alone = flat.aliased and params is not None and self.world == 1 and same_dtype
        self.own_parameters = self.buckets is not None or alone
        # The views set while the unit runs: made by each forward, set again by its backward.
        self._views_made: list[torch.Tensor] | None = None
        self._views_set: list[torch.Tensor] = []
        # Hooks live on the C++ side, unseen by Python's cycle collector: a bound method there
        # (buffer -> hook -> unit -> buffer) would keep the model alive. So: the unit, weakly.
        unit = weakref.ref(self)

        def post_backward(unsharded: torch.Tensor) -> None:
            alive = unit()
            if alive is not None:
                alive._post_backward(unsharded)

        if flat.unsharded.requires_grad:  # an all-frozen unit builds no gradient
            flat.unsharded.register_post_accumulate_grad_hook(post_backward)
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
            module.register_forward_hook(self._post_forward)

    # -- unshard / reshard ----------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> None:
        """Start gathering the full parameters (no-op if they are already there or on the way)."""
        there = self._gather is not None or (self.flat.is_allocated and not self.stale)
        if there or self.flat.padded_numel == 0:  # (0: a root unit left with no parameters)
            return
        flat = self.flat
        flat.alloc_unsharded()
        self.stale = False
        with torch.no_grad():
            if flat.aliased:  # DDP: the parameter is the buffer
                return
            with category("comm_buffers"):
                # Mixed precision: the fp32 shard is cast before it travels (half the bytes).
                # Offload: the shard comes from host memory first, cast on its way.
                if flat.offload:
                    inp = comm.host_to_device(flat.shard.detach(), flat.device, flat.compute_dtype)
                elif flat.shard_size == 1:  # copied below, cast on the way: one operator
                    inp = flat.shard
                else:
                    inp = flat.shard.detach().to(flat.compute_dtype)
            # Written through `.data`: a refill for backward must not bump the version counter
            # autograd checks on the views it saved in forward (same storage, same values).
            if flat.shard_size == 1:  # replicated, or a group of one: a local copy, no message
                flat.unsharded.data.copy_(inp)
                return
            self._gather_input = inp
            with comm.tagged(self.label):
                self._gather = comm.all_gather_into_tensor(
                    flat.unsharded.data, inp, group=self.state.group, async_op=True
                )
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if self._gather is not None:
            self._gather.wait()
            self._gather, self._gather_input = None, None
            mark(f"all-gather {self.label}")

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded buffer for real: its storage goes to 0 bytes (after forward, by
        the step `free_unsharded`)."""
        if self.flat.aliased or not self.flat.is_allocated:
            return
        self.wait_unshard()
        if after_forward:
            self.state.steps.free_unsharded(self.flat.unsharded)
        else:
            self.flat.free_unsharded()
        if self.params is not None:
            self._use_sharded()  # the attributes are this rank's slices again
        else:
            # The views now point at 0 bytes; reading one would touch freed memory. The modules
            # get shape-only stand-ins (autograd keeps its own references to the views).
            for segment, owners in zip(self.flat.segments, self.owners, strict=True):
                stand_in = torch.empty(segment.shape, dtype=self.flat.compute_dtype, device="meta")
                for module, attr in owners:  # tied: one stand-in shared, as the view was
                    setattr(module, attr, stand_in)
        mark(f"free {self.label}")

    def _use_views(self, fresh: bool = True) -> None:
        if self.own_parameters:
            return  # DDP's way: each module computes with its own parameters (`policy.py`)
        views = self.flat.views(fresh)
        if views is not self._views_made:  # new views: prepared once, kept with them
            self._views_made, self._views_set = views, []
            if self.params is not None:  # frozen or unfrozen since the wrap, as in FSDP2
                self.frozen = [not p.requires_grad for p in self.params]
            unit = weakref.ref(self)
            for i, view in enumerate(views):
                if self.frozen[i]:
                    view = view.detach()  # no gradient is computed for a frozen parameter
                elif self.params is not None and view.requires_grad:
                    view.register_hook(_GotGrad(unit, i))
                self._views_set.append(view)
        for view, owners in zip(self._views_set, self.owners, strict=True):
            for module, attr in owners:  # tied: every owner gets the very same view
                if self.params is not None:  # what module.parameters() yields, as in FSDP2
                    module._parameters[attr] = view  # type: ignore[assignment]
                else:
                    setattr(module, attr, view)

    def _use_sharded(self) -> None:
        """Per-parameter views: each attribute is its registered slice again (see the Note)."""
        if self.params is None or self.own_parameters:  # (none were set)
            return
        for param, owners in zip(self.params, self.owners, strict=True):
            for module, attr in owners:
                module._parameters[attr] = param

    # -- forward --------------------------------------------------------------------------------

    def _pre_forward(self, module: nn.Module, args: Any, kwargs: Any) -> tuple[Any, Any]:
        if self.plan.input_dtype is not None:
            args, kwargs = self.state.steps.cast_floats((args, kwargs), self.plan.input_dtype)
        if self.training_state is TrainingState.PRE_BACKWARD:
            # A recompute inside this unit's backward: gathered, views set; no message, no free
            self._recomputing = True
            return args, kwargs
        self._recomputing = False  # a recompute stopped early never reached post-forward
        state = self.state
        if self is state.root:
            state.begin_step()
        state.record_forward(self)
        self.training_state = TrainingState.FORWARD
        self.unshard()
        self.wait_unshard()
        self._use_views()
        self._free_before_the_gradient_is_built()
        if state.prefetch:  # the next unit's all-gather overlaps this unit's compute
            nxt = state.next_in_forward(self)
            if nxt is not None:
                nxt.unshard(async_op=True)
        self._compute_start = time.perf_counter()
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        if self._recomputing:
            self._recomputing = False
            return self._cast_output(output)
        self._record_compute("forward")
        if self.reshard_after_forward:
            self.reshard(after_forward=True)
        self._use_sharded()  # kept gathered or not: between passes, the slices show
        if torch.is_grad_enabled():
            self.state.record_post_forward(self)  # where this unit's backward prefetch starts
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._pre_backward)
        self.training_state = TrainingState.IDLE
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
        dtype = self.plan.output_dtype
        return output if dtype is None else self.state.steps.cast_floats(output, dtype)

    def _free_before_the_gradient_is_built(self) -> None:
        """ZeRO-2/3: free the gathered parameters once this forward's backward has computed
        every gradient of the unit, before autograd concatenates them into its whole gradient
        (a pre-hook on this forward's split): the two are never held together. Of several
        forwards before one backward only the last graph frees; a unit of several modules
        frees after each member's (see the Note above)."""
        node = self.flat.split_node
        if node is None or not self.strategy.reshard_after_backward or self.own_parameters:
            return
        self._graphs += 1
        unit = weakref.ref(self)

        def before_cat(grad_outputs: Any) -> None:
            alive = unit()
            if alive is None or alive._graphs == 0:
                return
            alive._graphs -= 1
            between = alive.grouped and alive.reshard_after_forward
            if alive._graphs == 0 or between:
                alive.reshard()
            if between and alive.training_state is TrainingState.PRE_BACKWARD:
                alive.training_state = TrainingState.IDLE  # the next member's pre-backward

        node.register_prehook(before_cat)

    # -- backward -------------------------------------------------------------------------------

    def _pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        # Once per backward, even if several outputs of the unit get gradients.
        if self.training_state is TrainingState.IDLE:
            self.training_state = TrainingState.PRE_BACKWARD
            self.state.begin_backward(self)
            # Gathered again if post-forward freed it (or already here, or on its way).
            self.state.steps.regather(self.flat.unsharded, self.unshard)
            self.wait_unshard()
            # Live again for a rerun (checkpointing), in grad mode as in forward: a view that
            with torch.enable_grad():  # wants no gradient makes ``x * weight`` save no x
                self._use_views(fresh=False)  # forward's, unless made without autograd
            if self.state.prefetch:
                nxt = self.state.next_in_backward(self)
                if nxt is not None:
                    nxt.unshard(async_op=True)
            self._compute_start = time.perf_counter()
        return grad

    def _post_backward(self, unsharded: torch.Tensor) -> None:
        """All gradient contributions of this unit are summed in ``unsharded.grad``."""
        self.training_state = TrainingState.POST_BACKWARD
        self._record_compute("backward")
        if self.strategy.reduce_at_end:
            self._grad_ready = True  # ZeRO-1: reduced by finalize_backward, all at once
            return
        if self.strategy.reshard_after_backward:  # first, as FSDP2: the gradient is its own
            self.reshard()  # tensor, so the parameters need not wait for its reduction
        self.reduce_grad()

    def _record_compute(self, phase: str) -> None:
        """A compute span on the timeline, from this unit's pre-hook to now. Not the root's
        unless it is the one unit (DDP's): its span would enclose the others'."""
        timeline = active_timeline()
        if timeline is not None and (self is not self.state.root or len(self.state.units) == 1):
            timeline.add(
                "compute", f"{phase} {self.label}", self._compute_start, time.perf_counter()
            )

    def _all_gradients_sent(self) -> None:
        """DDP's buckets sent this unit's last bucket: its backward is over."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            self._record_compute("backward")
            self.training_state = TrainingState.POST_BACKWARD

    def finalize_backward(self) -> None:
        """The step's backward is over (FSDP2's ``FSDPParamGroup.finalize_backward``): ZeRO-1
        reduces the gradient it kept whole until now; a prefetch whose backward never came is
        waited for; the unit is resharded and its parameters show their slices again."""
        if self._grad_ready:  # ZeRO-1 kept the full gradient until here
            self._grad_ready = False
            self.reduce_grad()
        if self.own_parameters and self.training_state is TrainingState.PRE_BACKWARD:
            self._record_compute("backward")  # a bucket never filled, or none to fill
        if self.buckets is not None and self.buckets.finish():  # sent during backward, waited
            mark(f"all-reduce {self.label}")  # for here
        self.wait_unshard()
        if self.strategy.reshard_after_backward:
            self.reshard()
        self._use_sharded()  # views set by a pre-backward: the slices show again
        self._graphs = 0  # a forward whose graph got no backward frees at the next one's end
        self.training_state = TrainingState.IDLE

    def reduce_grad(self) -> None:
        """Average the gradient over ranks into the shard's .grad; free the full gradient.

        Hybrid: reduce-scattered inside the shard group, then the shard's gradient all-reduced
        across the replicas (FSDP1's HYBRID_SHARD and FSDP2's 2-D mesh do the same two steps).
        """
        flat, groups, world = self.flat, self.state.groups, self.world  # all in the average
        reduce_shard = self.state.steps.reduce_grad_shard
        full_grad = flat.unsharded.grad
        if full_grad is None or flat.padded_numel == 0:
            return
        with torch.no_grad(), comm.tagged(self.label):
            if flat.aliased:  # DDP (or S = 1): all-reduce the parameter's gradient in place
                grad = full_grad.to(self.reduce_dtype)  # itself, unless reduced in another dtype
                if groups.shard_size > 1:  # (S = 1: a group of one has nothing to add)
                    comm.all_reduce(grad, group=self.state.group)
                if groups.replicate_group is not None:
                    comm.all_reduce(grad, group=groups.replicate_group)
                if world > 1:
                    grad.div_(world)
                if grad is not full_grad:  # reduced in another dtype
                    full_grad.copy_(grad)
                if self.params is not None:
                    flat.shard.grad = None  # handed to the parameters below
                    self._hand_out(full_grad)
                return
            with category("gradients"):
                grad = full_grad.to(self.reduce_dtype)
                if world == 1:  # nothing to send, nothing to average
                    out = grad
                elif self.strategy.sharded:  # and, hybrid, the shard across the replicas
                    out = reduce_shard(grad, self.state.group, groups.replicate_group)
                else:  # replicated, cast for the reduction: the whole gradient
                    comm.all_reduce(grad, group=self.state.group)
                    if groups.replicate_group is not None:
                        comm.all_reduce(grad, group=groups.replicate_group)
                    out = grad.div_(world)
                if flat.offload:  # the gradient shard goes to host memory, where the step runs
                    host = torch.empty(out.shape, dtype=flat.shard.dtype, device=flat.shard.device)
                    out = comm.device_to_host(out, host)
                else:
                    out = out.to(flat.shard.dtype)
                flat.unsharded.grad = None  # the full gradient is freed here
                del grad, full_grad
                if self.params is not None:
                    self._hand_out(out)
                elif flat.shard.grad is None:
                    flat.shard.grad = out
                else:  # gradient accumulation over several backwards
                    flat.shard.grad += out
        mark(f"{'reduce-scatter' if self.strategy.sharded else 'all-reduce'} {self.label}")

    def _hand_out(self, grad: torch.Tensor) -> None:
        """Give each parameter that got a gradient its slice of the unit's shard gradient."""
        assert self.params is not None
        for i, (piece, param) in enumerate(zip(self.flat.pieces(grad), self.params, strict=False)):
            got, self._got_grad[i] = self._got_grad[i], False
            if self.frozen[i] or not got:
                continue  # stays None: no optimizer touches it (weight decay included)
            if piece.shape != param.shape:  # replicated: the parameter's own shape
                piece = piece.view(param.shape)
            piece = comm.same_marks(piece, param)
            if param.grad is None:
                param.grad = piece  # a view: the unit's gradient is one allocation
            else:  # gradient accumulation over several backwards
                param.grad += piece

    def flat_shard_grad(self) -> torch.Tensor | None:
        """This rank's gradient of the unit as one flat shard (zeros where a parameter has none)."""
        if self.params is None:
            return self.flat.shard.grad
        if all(p.grad is None for p in self.params):
            return None
        grad = torch.zeros_like(self.flat.shard)
        for piece, param in zip(self.flat.pieces(grad), self.params, strict=False):
            if param.grad is not None:
                piece.copy_(param.grad.reshape(-1))
        return grad

    def shard_grads(self) -> list[torch.Tensor]:
        """This rank's gradients of the unit, each element once (for norms and clipping)."""
        if self.params is None:
            return [] if self.flat.shard.grad is None else [self.flat.shard.grad]
        return [p.grad for p in self.params if p.grad is not None]


class _GotGrad:
    """Hook on one parameter's view: records that a gradient reached it in this backward."""

    def __init__(self, unit: weakref.ref[ShardedUnit], index: int) -> None:
        self.unit, self.index = unit, index  # weakly: the hook lives on the C++ side

    def __call__(self, grad: torch.Tensor) -> None:
        alive = self.unit()
        if alive is not None:
            alive._got_grad[self.index] = True
