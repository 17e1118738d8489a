"""Flat parameters: one unit's parameters as one padded 1-D buffer, cut into N equal shards.

This is FSDP1's `FlatParameter` (and DeepSpeed ZeRO-3's partitioned parameters) reduced to
its idea:

    params of the unit      w1 (4x3)   b1 (4)   w2 (2x4)        a tied one appears once
    flatten + concatenate   [ w1 ........ | b1 .. | w2 ...... | pad ]   padded to a multiple of N
    rank r keeps            shard r = flat[r*S : (r+1)*S]               S = padded / N

The shard is the only persistent storage (an `nn.Parameter`, so `model.parameters()` and any
`torch.optim` optimizer see it). Before the unit runs, the shards are all-gathered into the
*unsharded* buffer, and every original parameter becomes a view into it: `w1` is
``unsharded[0:12].view(4, 3)``. Freeing resizes that buffer's storage to 0 bytes — the views
stay valid Python objects (autograd saved some of them), and they come back to life when the
same storage is refilled for backward. FSDP1 and FSDP2 free exactly this way.

Where real FSDP goes further: FSDP2 keeps one DTensor per original parameter (sharded on
dim 0) instead of a flat buffer, so parameters keep their names and shapes, and copies them
in and out of a flat all-gather buffer; it also manages CUDA streams for the overlap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_lab.trace import category


@dataclass(frozen=True)
class Segment:
    """Where one original parameter lives in the flat buffer."""

    name: str  # first fully qualified name
    offset: int
    shape: torch.Size

    @property
    def numel(self) -> int:
        return self.shape.numel()


FILL_CHUNK = 1 << 20  # elements a slice initialiser is asked for at a time
SliceValues = Callable[[str, torch.Size, int, int], torch.Tensor]
"""(name, shape, start, end) -> elements [start, end) of that parameter, flattened (1-D)."""


class FlatParameter:
    """The flat, padded, sharded storage of one unit's parameters.

    Args:
        names: fully qualified names of the unit's parameters (a tied one once).
        params: the parameters, in the same order (their values are copied in). On the meta
            device they give shapes only, and `values` fills this rank's shard.
        shard_rank: this rank's index in the shard group.
        shard_size: ranks the buffer is split over (1 = replicated, as in DDP).
        compute_dtype: dtype of the unsharded buffer (bf16 for mixed precision).
        template: dtype and device to use when `params` is empty.
        values: for meta `params`: produces any slice of a parameter (a deterministic init).
        device: where the shard lives when `params` are on meta.
        requires_grad: whether any of the parameters trains (False: no gradient is built).
        offload: keep the shard in host memory (pinned when CUDA is there); the unsharded
            buffer stays on the compute device.
        compute_device: where the unsharded buffer lives (default: where the shard would).
    """

    def __init__(
        self,
        names: list[str],
        params: list[torch.Tensor],
        shard_rank: int,
        shard_size: int,
        compute_dtype: torch.dtype | None = None,
        template: torch.Tensor | None = None,
        values: SliceValues | None = None,
        device: torch.device | None = None,
        requires_grad: bool = True,
        offload: bool = False,
        compute_device: torch.device | None = None,
    ) -> None:
        # A root unit can be left with no parameters: `template` then gives dtype and device.
        like = params[0] if params else template
        if like is None:
            raise ValueError("a FlatParameter without parameters needs a template tensor")
        dtype = like.dtype
        device = device if device is not None and like.is_meta else like.device
        if device.type == "meta":
            raise ValueError("a FlatParameter from meta parameters needs a real `device`")
        if values is None:
            if any(p.is_meta for p in params):
                raise ValueError(
                    "meta parameters have no values: pass `values` (a slice initialiser)"
                )
            by_name = dict(zip(names, params, strict=True))

            def values(name: str, shape: torch.Size, start: int, end: int) -> torch.Tensor:
                return by_name[name].detach().reshape(-1)[start:end]

        self.segments: list[Segment] = []
        offset = 0
        for name, p in zip(names, params, strict=True):
            self.segments.append(Segment(name, offset, p.shape))
            offset += p.numel()
        self.numel = offset  # real elements
        self.shard_rank, self.shard_size = shard_rank, shard_size
        self.padded_numel = -(-self.numel // shard_size) * shard_size  # ceil to a multiple of N
        self.shard_numel = self.padded_numel // shard_size
        self.compute_dtype = compute_dtype or dtype
        self.device = compute_device or device  # where the unit computes
        self.offload = offload
        host = torch.device("cpu")

        with torch.no_grad(), category("parameters"):
            # The rank's persistent shard, in the parameters' own dtype (fp32 master copy),
            # filled slice by slice: no full-size flat copy of the unit is ever made.
            shard = torch.zeros(self.shard_numel, dtype=dtype, device=host if offload else device)
            if offload and torch.cuda.is_available():
                shard = shard.pin_memory()  # copies to and from the GPU can then overlap
            self._fill(shard, values)
            self.shard = nn.Parameter(shard, requires_grad=requires_grad)

        # Replicated, not cast, not offloaded: the parameter itself is the unsharded buffer (DDP).
        self.aliased = shard_size == 1 and self.compute_dtype == dtype and not offload
        self.split_node: torch.autograd.graph.Node | None = None  # set by `views()`
        if self.aliased:
            self.unsharded: torch.Tensor = self.shard
        else:
            with category("comm_buffers"):
                # Shape (padded,) over a one-element storage (stride 0): a full-size empty
                # buffer here would count a whole unit for a moment, on top of the parameters
                # it is built from. `alloc_unsharded` gives it real, contiguous storage.
                self.unsharded = torch.empty_strided(
                    (self.padded_numel,),
                    (0,),
                    dtype=self.compute_dtype,
                    device=self.device,
                    requires_grad=requires_grad,
                )
            self.free_unsharded()

    # -- the unsharded buffer's storage: allocated for use, resized to 0 to free ---------------

    @property
    def is_allocated(self) -> bool:
        return self.unsharded.untyped_storage().nbytes() > 0

    def alloc_unsharded(self) -> None:
        storage = self.unsharded.untyped_storage()
        size = self.padded_numel * self.unsharded.element_size()
        if self.unsharded.stride() == (0,):  # first use: contiguous from now on
            with torch.no_grad():
                self.unsharded.set_(storage, 0, (self.padded_numel,), (1,))
        if storage.nbytes() != size:
            storage.resize_(size)

    def free_unsharded(self) -> None:
        if not self.aliased:
            self.unsharded.untyped_storage().resize_(0)

    # -- views ---------------------------------------------------------------------------------

    def views(self) -> list[torch.Tensor]:
        """The original parameters as views into the unsharded buffer (autograd flows back)."""
        # One split, not a slice per parameter: autograd then builds the unit's gradient with
        # a single cat (SplitWithSizesBackward) instead of a zero-filled full-size buffer per
        # parameter (SliceBackward) summed into the accumulator — as FSDP1 does.
        if not self.segments:
            return []
        sizes = [s.numel for s in self.segments]
        parts = torch.split(self.unsharded, sizes + [self.padding] if self.padding else sizes)
        self.split_node = parts[0].grad_fn  # builds the unit's gradient (None: no autograd)
        return [part.view(s.shape) for part, s in zip(parts, self.segments, strict=False)]

    def _fill(self, shard: torch.Tensor, values: SliceValues) -> None:
        """Copy into `shard` the part of each parameter that falls in this rank's range."""
        start = self.shard_rank * self.shard_numel
        stop = start + self.shard_numel
        for seg in self.segments:
            lo, hi = max(seg.offset, start), min(seg.offset + seg.numel, stop)
            # This segment's overlap with the shard, [lo, hi) in flat coordinates, in chunks:
            # an initialiser's temporaries then stay small however large the shard is.
            for a in range(lo, hi, FILL_CHUNK):
                b = min(a + FILL_CHUNK, hi)
                piece = values(seg.name, seg.shape, a - seg.offset, b - seg.offset)
                if piece.shape != (b - a,):
                    raise ValueError(
                        f"the initialiser returned shape {tuple(piece.shape)} for elements "
                        f"[{a - seg.offset}, {b - seg.offset}) of {seg.name!r}; expected "
                        f"({b - a},)"
                    )
                shard[a - start : b - start].copy_(piece)

    def local_range(self, segment: Segment) -> tuple[int, int]:
        """Where `segment`'s elements on this rank sit in the shard: [a, b), maybe empty."""
        start = self.shard_rank * self.shard_numel
        a = min(max(segment.offset - start, 0), self.shard_numel)
        b = min(max(segment.offset + segment.numel - start, 0), self.shard_numel)
        return a, b

    def slice_lengths(self, segment: Segment) -> list[int]:
        """How many of `segment`'s elements each rank of the shard group holds."""
        return [
            max(
                0,
                min(segment.offset + segment.numel, (r + 1) * self.shard_numel)
                - max(segment.offset, r * self.shard_numel),
            )
            for r in range(self.shard_size)
        ]

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a full (unpadded or padded) flat tensor into named, shaped tensors."""
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.segments}

    def flatten(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Inverse of `unflatten`: a padded flat tensor from named full tensors."""
        flat = torch.zeros(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        for s in self.segments:
            flat[s.offset : s.offset + s.numel].copy_(tensors[s.name].reshape(-1))
        return flat

    def shard_of(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a padded flat tensor."""
        start = self.shard_rank * self.shard_numel
        return flat[start : start + self.shard_numel]

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel
