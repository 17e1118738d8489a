"""What each unit does: its strategy, when it frees, its precision, where its shard lives.

`shard(model, strategy=..., mixed_precision=..., reshard_after_forward=..., offload=...)` sets
the model's defaults; `policies={unit: UnitPolicy(...)}` changes them for some units, and
`resolve_policies` turns both into one `UnitPlan` per unit — every refusal before any message.

    UnitPolicy(strategy="replicate")   whole on every rank, gradient all-reduced (DDP's way,
                                       in the buckets at the end of this file) — a model's
                                       norms inside a ZeRO-3 model
    UnitPolicy(mixed_precision=FP32)   this unit computes in fp32 while the rest runs in bf16
    UnitPolicy(reshard_after_forward=False)   kept gathered between forward and backward
    UnitPolicy(offload=True)           shard, gradient and optimizer state in host memory;
                                       the parameters visit the device for the unit's compute

[Note: policies as one mapping] FSDP2 sets a policy per `fully_shard(module, ...)` call, one call
per unit, innermost first. Here the whole plan is built by one `shard()` call, so the policies
come as one mapping beside it, keyed by unit name (`build_plan`'s names, "" the root) or by
module class (every unit whose first module is one). One call keeps what FSDP2 also needs —
every unit's policy known before the first message — and lets a reader see the whole model's
choices in one place; a unit named both ways takes its name's policy.
"""

from __future__ import annotations

import difflib
import weakref
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.choices import HYBRID_STRATEGIES, REPLICATE, SHARDING_STRATEGIES, Strategy
from fsdp_lab.sharding.wrap import ROOT, WrapPlan
from fsdp_lab.trace import category


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's `MixedPrecisionPolicy`, field for field and default for default.

    The shards, their gradients and the optimizer stay in the parameters' own dtype (fp32);
    only what a unit gathers and computes with changes.

    Args:
        param_dtype: the unit gathers and computes in it; None: the parameters' own dtype.
        reduce_dtype: its gradients are reduced in it; None: in `param_dtype` (FSDP2's rule).
        output_dtype: its floating-point outputs are cast to it; None: left as computed.
        cast_forward_inputs: its floating-point inputs are cast to `param_dtype` before its
            forward — what lets a unit computing in fp32 sit between units computing in bf16.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecision({name}={value!r}): expected a floating torch.dtype or "
                    f"None. Fix: {name}=torch.bfloat16"
                )
        if not isinstance(self.cast_forward_inputs, bool):
            raise ValueError(
                f"MixedPrecision(cast_forward_inputs={self.cast_forward_inputs!r}): expected "
                "True or False"
            )


@dataclass(frozen=True)
class UnitPolicy:
    """One unit's departures from `shard()`'s defaults; None keeps the default.

    Args:
        strategy: "replicate" (whole on every rank, gradients all-reduced), or a strategy of the
            model's mesh ("full", "grad_op", "optimizer" on one dimension; "hybrid",
            "hybrid_zero2" on two).
        reshard_after_forward: free the unit between forward and backward (ZeRO-3 strategies).
        mixed_precision: this unit's compute and reduction dtypes; `MixedPrecision(torch.float32,
            torch.float32)` keeps one unit in fp32 inside a bf16 model.
        offload: keep the unit's shard, gradient and optimizer state in host memory.
    """

    strategy: str | None = None
    reshard_after_forward: bool | None = None
    mixed_precision: MixedPrecision | None = None
    offload: bool | None = None


@dataclass(frozen=True)
class UnitPlan:
    """What one unit does, resolved: the model's defaults with its `UnitPolicy` applied."""

    strategy: Strategy
    reshard_after_forward: bool
    mixed_precision: MixedPrecision | None
    offload: bool

    @property
    def compute_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.param_dtype if self.mixed_precision else None

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        precision = self.mixed_precision
        return (precision.reduce_dtype or precision.param_dtype) if precision else None

    @property
    def input_dtype(self) -> torch.dtype | None:
        """What the unit casts its floating inputs to before its forward (None: no cast)."""
        precision = self.mixed_precision
        return precision.param_dtype if precision and precision.cast_forward_inputs else None

    @property
    def output_dtype(self) -> torch.dtype | None:
        return self.mixed_precision.output_dtype if self.mixed_precision else None


Policies = Mapping[str | type[nn.Module], UnitPolicy] | None


def resolve_policies(
    model: nn.Module,
    plan: WrapPlan,
    strategy: Strategy,
    policies: Policies = None,
    mixed_precision: MixedPrecision | None = None,
    reshard_after_forward: bool | Iterable[str] | None = None,
    offload: bool = False,
) -> dict[str, UnitPlan]:
    """Each unit's `UnitPlan`, root first (`plan.units`' order); a ValueError naming the key,
    what was expected and the fix for a policy that names no unit or asks for the impossible."""
    policies = dict(policies or {})
    if not isinstance(offload, bool):
        raise ValueError(f"offload={offload!r}: expected True or False. Fix: offload=True")
    asked = [
        mixed_precision,
        *(p.mixed_precision for p in policies.values() if isinstance(p, UnitPolicy)),
    ]
    for precision in asked:
        if precision is not None and not isinstance(precision, MixedPrecision):
            raise ValueError(
                f"mixed_precision={precision!r}: expected a MixedPrecision. Fix: "
                "mixed_precision=MixedPrecision(torch.bfloat16, torch.float32)"
            )
    by_key = _policy_of_each_unit(model, plan, policies)
    free_after = _freed_after_forward(plan.units, reshard_after_forward)
    resolved = {}
    for name in plan.units:
        own = by_key.get(name, UnitPolicy())
        unit_strategy = _unit_strategy(own.strategy, strategy, name)
        frees = own.reshard_after_forward
        if frees is None:
            frees = name in free_after
        elif frees and not unit_strategy.reshard_after_forward:
            raise ValueError(
                f"policies[{_label(name)}]: reshard_after_forward=True under strategy "
                f"{unit_strategy.name!r}, which keeps its parameters between the passes. "
                "Fix: strategy='full' (or 'hybrid') for this unit, or drop reshard_after_forward"
            )
        resolved[name] = UnitPlan(
            strategy=unit_strategy,
            reshard_after_forward=bool(frees) and unit_strategy.reshard_after_forward,
            mixed_precision=own.mixed_precision or mixed_precision,
            offload=offload if own.offload is None else own.offload,
        )
    return resolved


def _policy_of_each_unit(
    model: nn.Module, plan: WrapPlan, policies: dict[str | type[nn.Module], UnitPolicy]
) -> dict[str, UnitPolicy]:
    found: dict[str, UnitPolicy] = {}
    for key, policy in policies.items():
        if not isinstance(policy, UnitPolicy):
            raise ValueError(
                f"policies[{key!r}] is a {type(policy).__name__}: expected a UnitPolicy. "
                f"Fix: policies={{{key!r}: UnitPolicy(strategy='replicate')}}"
            )
        for name in ("reshard_after_forward", "offload"):
            value = getattr(policy, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(
                    f"policies[{key!r}]: {name}={value!r}: expected True, False or None (the "
                    f"default). Fix: UnitPolicy({name}=True)"
                )
        if isinstance(key, nn.Module):
            name = next((n for n, m in model.named_modules() if m is key), None)
            raise ValueError(
                f"policies is keyed by a module ({type(key).__name__}), not by a unit's name or "
                f"a module class. Fix: policies[{name!r}] if that module is a unit's, or "
                f"policies[{type(key).__name__}] for every unit that starts with one"
            )
        if isinstance(key, type):
            names = [
                u for u in plan.units if isinstance(model.get_submodule(plan.members_of(u)[0]), key)
            ]
            if not names:
                raise ValueError(
                    f"policies[{key.__name__}]: no unit's first module is a {key.__name__} "
                    f"(units: {_units(plan)}). Fix: key it by a unit's name, or add the class to "
                    "`units`"
                )
            for name in names:
                found.setdefault(name, policy)  # a name's own policy wins over its class's
        elif key in plan.units:
            found[key] = policy
        else:
            near = difflib.get_close_matches(str(key), plan.units, n=1)
            fix = f"policies[{near[0]!r}]" if near else "a name `build_plan(model, units)` gives"
            raise ValueError(
                f"policies[{key!r}] names no unit: expected one of {_units(plan)} or a module "
                f"class ('' is the root). Fix: {fix}"
            )
    return found


def _unit_strategy(asked: str | None, model_strategy: Strategy, unit: str) -> Strategy:
    if asked is None:
        return model_strategy
    if asked == REPLICATE.name:
        return REPLICATE
    same_mesh = HYBRID_STRATEGIES if model_strategy.replicated else SHARDING_STRATEGIES
    if asked in same_mesh and asked != "none":
        return same_mesh[asked]
    allowed = [REPLICATE.name, *(s for s in same_mesh if s != "none")]
    raise ValueError(
        f"policies[{_label(unit)}]: strategy={asked!r} on a model sharded with "
        f"{model_strategy.name!r}: expected one of {allowed} (a unit's strategy must suit the "
        "model's mesh). Fix: strategy='replicate' to keep this unit whole on every rank"
    )


def _freed_after_forward(units: tuple[str, ...], asked: bool | Iterable[str] | None) -> set[str]:
    """The units freed after forward, if their strategy frees at all. [Note: the root stays
    gathered] The root unit is the first to be gathered in forward and, holding the loss-side
    modules (a GPT's head), the first needed in backward: freeing it between the two passes
    and gathering it again costs one all-gather of the root per step and saves its bytes only
    for the instant between forward and backward. FSDP2 (`FSDPState._lazy_init`: the root's
    post-forward mesh is None) and FSDP1 (`_post_forward_reshard` skips the root) both keep
    it; so do we by default. notebooks/01_sharding.ipynb measures both choices."""
    if asked is False:
        return set()
    if asked is None or asked is True:
        return set(units[1:])  # units[0] is the root
    free_after = set(asked)
    unknown = free_after - set(units)
    if unknown:
        raise ValueError(
            f"reshard_after_forward names unknown units {sorted(unknown)}: expected some of "
            f"{list(units)} (the root is ''). Fix: use the names `build_plan` gives, or True/False"
        )
    return free_after


def _label(unit: str) -> str:
    return repr(unit) + (" (the root)" if unit == ROOT else "")


def _units(plan: WrapPlan) -> list[str]:
    return list(plan.units)


# --------------------------------------------------------------------------------------------
# DDP's gradient buckets: a replicated unit's gradients all-reduced while backward still runs.
#
# A replicated unit ("none", or `UnitPolicy(strategy="replicate")`) could wait for its whole
# backward and all-reduce its gradient in one message — nothing to overlap it with. DDP instead
# cuts the parameters into buckets (25 MiB, the first 1 MiB so that a message starts early), in
# the reverse of the parameters' order, roughly the order backward produces their gradients:
#
#     backward    ... grad(w4) ready   grad(w3) ready   grad(w2) ready   grad(w1) ready
#     bucket      [ w4 w3 ]  full -> all_reduce starts   [ w2 w1 ] full -> all_reduce starts
#     end         wait for every bucket; each parameter's .grad is its slice of its bucket
#
# Each parameter computes with its own registered tensor (no view of a flat buffer), so autograd
# accumulates its gradient in ``p.grad`` and `register_post_accumulate_grad_hook` says when it is
# final for this backward; the hook copies it into its slot of the bucket, divided by the number
# of ranks as DDP does (multiplied by 1/N, the same rounding), and drops it. A bucket whose
# parameters did not all get a gradient (a branch not taken) is sent at the end with zeros in
# their place; their ``.grad`` stays None, as the unit's other paths leave it. The wait is
# autograd's final callback (`ShardingState.finalize_backward`): before any optimizer step.
#
# The buckets live as long as the model, as DDP's do, and each parameter's slot is made once
# (nothing is allocated or sliced per gradient). Each ``.grad`` handed out is its slot (DDP's
# ``gradient_as_bucket_view=True``): the next backward writes it again.


FIRST_BUCKET_BYTES = 2**20  # DDP's `_DEFAULT_FIRST_BUCKET_BYTES`
DEFAULT_CAP_BYTES = 25 * 2**20  # DDP's default `bucket_cap_mb=25`


@dataclass
class _Bucket:
    params: list[nn.Parameter]
    numel: int = 0
    buffer: torch.Tensor | None = None  # made once, when the bucket is complete
    slots: list[torch.Tensor] = field(default_factory=list)  # per parameter: a view, its shape
    ready: list[bool] = field(default_factory=list)  # per parameter: got its gradient
    waiting: int = 0  # parameters still to get their gradient in this backward
    work: comm.CommWork | None = None


class GradBuckets:
    """The buckets of one replicated unit; `finish()` waits and hands out the gradients."""

    def __init__(
        self,
        params: list[nn.Parameter],
        group: dist.ProcessGroup | None,
        ranks: int,
        cap_bytes: int,
        label: str,
        when_all_sent: Callable[[], None] = lambda: None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self.group, self.label, self.when_all_sent = group, label, when_all_sent
        self.scale = 1.0 / ranks  # DDP multiplies by 1/N: the same rounding as its buckets
        trainable = [p for p in dict.fromkeys(params) if p.requires_grad]  # a tied one once
        self.buckets: list[_Bucket] = []
        self._where: dict[nn.Parameter, tuple[_Bucket, int]] = {}
        # DDP's rule: a parameter joins the open bucket, which closes once it holds `limit`
        # bytes; the first limit is 1 MiB under the default cap, else the cap itself.
        limit = FIRST_BUCKET_BYTES if cap_bytes == DEFAULT_CAP_BYTES else cap_bytes
        bucket = None
        for p in reversed(trainable):
            if bucket is None:
                bucket = _Bucket([])
                self.buckets.append(bucket)
            self._where[p] = (bucket, len(bucket.params))
            bucket.params.append(p)
            bucket.numel += p.numel()
            if bucket.numel * p.element_size() >= limit:
                bucket, limit = None, cap_bytes
        for bucket in self.buckets:
            first = bucket.params[0]
            with category("gradients"):
                # in the reduction's dtype (`MixedPrecision.reduce_dtype`), else the parameters'
                kind = dtype or first.dtype
                bucket.buffer = torch.zeros(bucket.numel, dtype=kind, device=first.device)
            bucket.slots = [
                piece.view(p.shape)
                for p, piece in zip(
                    bucket.params,
                    bucket.buffer.split([p.numel() for p in bucket.params]),
                    strict=True,
                )
            ]
            bucket.ready, bucket.waiting = [False] * len(bucket.params), len(bucket.params)
        self._sent = 0  # buckets sent in this backward
        hook = _Ready(self)  # on the C++ side: holds the buckets weakly, see `_Ready`
        for p in trainable:
            p.register_post_accumulate_grad_hook(hook)

    def _on_grad(self, param: nn.Parameter) -> None:
        bucket, i = self._where[param]
        torch.mul(param.grad, self.scale, out=bucket.slots[i])  # a gradient wants no gradient
        param.grad = None  # its bucket holds it now; given back by finish()
        bucket.ready[i] = True
        bucket.waiting -= 1
        if bucket.waiting == 0:
            self._send(bucket)

    def _send(self, bucket: _Bucket) -> None:
        with comm.tagged(self.label):
            bucket.work = comm.all_reduce(bucket.buffer, group=self.group, async_op=True)
        self._sent += 1
        if self._sent == len(self.buckets):  # every gradient of the unit is in: its backward
            self.when_all_sent()  # is over (the unit marks its compute span's end)

    def finish(self) -> bool:
        """Backward is over: send what is left, wait for every bucket, hand out the slices.
        True if any bucket was sent in this backward."""
        sent = False
        for bucket in self.buckets:
            if bucket.work is None and bucket.waiting < len(bucket.params):  # some got none
                for param, slot, got in zip(bucket.params, bucket.slots, bucket.ready, strict=True):
                    if not got:
                        if param.grad is not None:  # kept from an earlier backward: its own copy
                            param.grad = param.grad.clone()
                        slot.zero_()
                self._send(bucket)
        for bucket in self.buckets:
            if bucket.work is None:
                continue
            bucket.work.wait()
            sent = True
            for param, slot, got in zip(bucket.params, bucket.slots, bucket.ready, strict=True):
                if got:  # a view of the bucket, in the parameter's shape (and dtype)
                    param.grad = slot if slot.dtype == param.dtype else slot.to(param.dtype)
            bucket.work, bucket.ready = None, [False] * len(bucket.params)
            bucket.waiting = len(bucket.params)
        self._sent = 0
        return sent


class _Ready:
    """The hook on each parameter. PyTorch keeps it on the C++ side, out of sight of Python's
    cycle collector: holding the buckets (and through them the parameters) strongly, it would
    keep every model sharded this way alive for the life of the process."""

    def __init__(self, buckets: GradBuckets) -> None:
        self.buckets = weakref.ref(buckets)

    def __call__(self, param: nn.Parameter) -> None:
        alive = self.buckets()
        if alive is not None:
            alive._on_grad(param)
