"""DDP's gradient buckets: a replicated unit's gradients all-reduced while backward still runs.

A replicated unit ("none", or `UnitPolicy(strategy="replicate")`) could wait for its whole
backward and all-reduce its gradient in one message — nothing to overlap it with. DDP instead
cuts the parameters into buckets (25 MiB, the first 1 MiB so that a message starts early), in
the reverse of the parameters' order, roughly the order backward produces their gradients:

    backward    ... grad(w4) ready   grad(w3) ready   grad(w2) ready   grad(w1) ready
    bucket      [ w4 w3 ]  full -> all_reduce starts   [ w2 w1 ] full -> all_reduce starts
    end         wait for every bucket; each parameter's .grad is its slice of its bucket

Each parameter computes with its own registered tensor (no view of a flat buffer), so autograd
accumulates its gradient in ``p.grad`` and `register_post_accumulate_grad_hook` says when it is
final for this backward; the hook copies it into its slot of the bucket, divided by the number
of ranks as DDP does (multiplied by 1/N, the same rounding), and drops it. A bucket whose
parameters did not all get a gradient (a branch not taken) is sent at the end with zeros in
their place; their ``.grad`` stays None, as the unit's other paths leave it. The wait is
autograd's final callback (`ShardingState.finalize_backward`): before any optimizer step.

The buckets live as long as the model, as DDP's do, and each parameter's slot is made once
(nothing is allocated or sliced per gradient). Each ``.grad`` handed out is its slot (DDP's
``gradient_as_bucket_view=True``): the next backward writes it again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.trace import category

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
