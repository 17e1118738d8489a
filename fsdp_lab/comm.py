"""Collectives with byte and time accounting: every message a lab sends goes through here.

Each wrapper calls the real `torch.distributed` collective and, while a `CommLog` is active,
records one `CommRecord`: the op, the process group, the bytes this rank moved and how long it
took. While a `fsdp_lab.trace.Timeline` is active it also adds a "comm" span, so compute and
communication can be drawn side by side.

Bytes moved per rank follow the bandwidth-optimal (ring) algorithms, the convention of
nccl-tests' "bus bandwidth" and of `fsdp_lab.theory`, with N the group size:

    all_gather_into_tensor   (N-1)/N x output bytes     each rank receives N-1 shards
    reduce_scatter_tensor    (N-1)/N x input bytes      each rank sends N-1 partial shards
    all_reduce             2 (N-1)/N x tensor bytes     = a reduce-scatter then an all-gather
    broadcast, send, recv            tensor bytes
    host_to_device, device_to_host   tensor bytes over the host link (CPU offload; PCIe on a
                                     GPU, a copy in host memory on a CPU-only machine)

Async ops (``async_op=True``) return a `CommWork`; its ``wait()`` closes the record. The
recorded duration runs from issue to completion — what a prefetching mechanism overlaps — where
completion is when the backend's future for the op resolved (gloo and NCCL have one), else the
wait: DDP's buckets, all waited for at the end of backward, each end when their bytes arrived.
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab.trace.timeline import Recorder, active_timeline

_ACTIVE: contextvars.ContextVar[CommLog | None] = contextvars.ContextVar(
    "fsdp_lab_comm_log", default=None
)
_TAG: contextvars.ContextVar[str] = contextvars.ContextVar("fsdp_lab_comm_tag", default="")


@contextlib.contextmanager
def tagged(tag: str) -> Iterator[None]:
    """Label the collectives issued inside with what they are for (a unit's name): the
    timeline shows "all-gather blocks.0", not just "all-gather"."""
    token = _TAG.set(tag)
    try:
        yield
    finally:
        _TAG.reset(token)


# torch 2.13 renamed the tensor-in/tensor-out collectives; the old names warn.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


@dataclass
class CommRecord:
    op: str
    group: str  # e.g. "ranks 0,1,2,3"
    group_size: int
    bytes: float  # moved by this rank, see the module docstring
    payload_bytes: int  # size of the tensor argument the formula scales
    dtype: str
    start: float  # perf_counter seconds relative to the log's origin
    end: float
    async_op: bool


class CommLog(Recorder):
    """Records the collectives run on this rank while active (``with CommLog() as log:``)."""

    _active = _ACTIVE

    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []

    def bytes_by_op(self) -> dict[str, float]:
        """Total bytes this rank moved, per op name."""
        return bytes_by_op(self.records)

    def calls_by_op(self) -> dict[str, int]:
        return calls_by_op(self.records)

    def to_dict(self) -> dict[str, Any]:
        return {"records": [asdict(r) for r in self.records], "bytes_by_op": self.bytes_by_op()}


def bytes_by_op(records: list[CommRecord]) -> dict[str, float]:
    """Total bytes of `records` (e.g. a stretch of a log), per op name."""
    totals: dict[str, float] = {}
    for r in records:
        totals[r.op] = totals.get(r.op, 0.0) + r.bytes
    return totals


def calls_by_op(records: list[CommRecord]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in records:
        counts[r.op] = counts.get(r.op, 0) + 1
    return counts


def bus_bytes(op: str, payload_bytes: int, group_size: int) -> float:
    """Bytes one rank moves for `op` on a tensor of `payload_bytes` (ring algorithms)."""
    n = group_size
    factors = {
        "all_gather_into_tensor": (n - 1) / n,
        "reduce_scatter_tensor": (n - 1) / n,
        "all_reduce": 2 * (n - 1) / n,
        "broadcast": 1.0 if n > 1 else 0.0,
        "send": 1.0,
        "recv": 1.0,
        "host_to_device": 1.0,
        "device_to_host": 1.0,
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {sorted(factors)}")
    return payload_bytes * factors[op]


def group_label(group: dist.ProcessGroup | None) -> str:
    """How a `CommRecord` names `group` (None: the world): "ranks 0,2"."""
    return _group_label(group)[0]


def _group_label(group: dist.ProcessGroup | None) -> tuple[str, int]:
    ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
    return "ranks " + ",".join(map(str, ranks)), len(ranks)


class CommWork:
    """Handle of an async collective; `wait()` blocks and closes its record."""

    def __init__(self, work: Any, finish: Any) -> None:
        self._work = work
        self._finish = finish
        self._done = False

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
        if not self._done:
            self._done = True
            self._finish()


def _run(
    op: str,
    call: Any,
    tensor: torch.Tensor,
    payload_bytes: int,
    group: dist.ProcessGroup | None,
    async_op: bool,
    link: str | None = None,
) -> CommWork | None:
    log, timeline = _ACTIVE.get(), active_timeline()
    start = time.perf_counter()
    work = call()
    if log is None and timeline is None:
        return CommWork(work, lambda: None) if async_op else None
    label, size = (link, 1) if link else _group_label(group)
    moved = bus_bytes(op, payload_bytes, size)
    tag = _TAG.get()
    done: list[float] = []  # when an async op really completed, if its backend says so
    if async_op and hasattr(work, "get_future"):
        with contextlib.suppress(RuntimeError):  # a backend without futures: wait() it is
            work.get_future().add_done_callback(lambda _: done.append(time.perf_counter()))

    def finish() -> None:
        end = done[0] if done else time.perf_counter()
        if log is not None:
            log.records.append(
                CommRecord(
                    op,
                    label,
                    size,
                    moved,
                    payload_bytes,
                    str(tensor.dtype).removeprefix("torch."),
                    start - log._origin,
                    end - log._origin,
                    async_op,
                )
            )
        if timeline is not None:
            timeline.add("comm", op, start, end, int(moved), group=label, tag=tag)

    if async_op:
        return CommWork(work, finish)
    finish()
    return None


_UNEVEN = "_fsdp_lab_uneven"  # on a flat shard's storage: {(offset, numel): what that slice is}


def mark_uneven(tensor: torch.Tensor, name: str, lengths: list[int], unit: str) -> None:
    """`tensor` is this rank's slice of parameter `name` (of wrap unit `unit`), and the ranks'
    slices have these `lengths`: every collective here refuses it, and every tensor that is the
    same slice of the same storage (``p.data``, ``p.detach()``, a view) — see `_refuse_uneven`.
    The mark lives on the storage, so it dies with it."""
    storage = tensor.untyped_storage()  # one Python object per storage, shared by its views
    mark = (name, lengths, unit)
    setattr(tensor, _UNEVEN, mark)  # this very tensor, by name (empty slices share offsets)
    if tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == storage.nbytes():
        return  # this rank's slice is its whole shard: the shard itself (gathered, saved) is none
    marks = getattr(storage, _UNEVEN, None)
    if marks is None:
        marks = {}
        setattr(storage, _UNEVEN, marks)
    marks[(tensor.storage_offset(), tensor.numel())] = mark


def same_marks(tensor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`tensor` (a parameter's gradient) marked as `like` is; returns it."""
    mark = _mark_of(like)
    if mark is not None:
        mark_uneven(tensor, *mark)
    return tensor


def _mark_of(tensor: torch.Tensor) -> tuple[str, list[int], str] | None:
    if hasattr(tensor, _UNEVEN):
        return getattr(tensor, _UNEVEN)
    marks = getattr(tensor.untyped_storage(), _UNEVEN, None)
    return marks.get((tensor.storage_offset(), tensor.numel())) if marks else None


def _refuse_uneven(op: str, *tensors: torch.Tensor) -> None:
    """A collective over tensors whose sizes differ across ranks never completes on gloo (each
    rank waits for bytes the others will not send); NCCL may corrupt or hang. Refuse it here,
    on every rank alike — every rank holds a slice of the same parameter — before any message.
    (A copy, ``p.grad.clone()``, has storage of its own and is not seen: see docs/labs.md.)"""
    for t in tensors:
        mark = _mark_of(t)
        if mark is not None:
            name, lengths, unit = mark
            raise ValueError(
                f"comm.{op} over {name!r}: this is a sharded parameter's slice (or its "
                f"gradient), and the ranks hold {lengths} of its elements — a collective over "
                "slices of unequal size would wait forever. Fix: compare whole values "
                "(`fsdp_lab.sharding.full_state_dict(model)`), or keep this parameter whole on "
                f"every rank (`shard(..., policies={{{unit!r}: UnitPolicy(strategy='replicate')}})`"
                " or `ignored_params`). For raw torch.distributed calls, run the ranks with "
                "TORCH_DISTRIBUTED_DEBUG=DETAIL: mismatched collectives then fail at once"
            )


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather_into_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Concatenate every rank's `input` into `output` (N x input.numel() elements)."""
    _refuse_uneven("all_gather_into_tensor", input, output)
    return _run(
        "all_gather_into_tensor",
        lambda: _all_gather_single(output, input, group=group, async_op=async_op),
        output,
        _nbytes(output),
        group,
        async_op,
    )


def reduce_scatter_tensor(
    output: torch.Tensor,
    input: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce `input` (N x output.numel() elements) over ranks; rank r keeps chunk r in `output`."""
    _refuse_uneven("reduce_scatter_tensor", input, output)
    return _run(
        "reduce_scatter_tensor",
        lambda: _reduce_scatter_single(output, input, op=op, group=group, async_op=async_op),
        input,
        _nbytes(input),
        group,
        async_op,
    )


def all_reduce(
    tensor: torch.Tensor,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Reduce `tensor` over ranks in place; every rank ends with the result."""
    _refuse_uneven("all_reduce", tensor)
    return _run(
        "all_reduce",
        lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op),
        tensor,
        _nbytes(tensor),
        group,
        async_op,
    )


def broadcast(
    tensor: torch.Tensor,
    src: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> CommWork | None:
    """Copy `tensor` from global rank `src` to every rank of the group, in place."""
    _refuse_uneven("broadcast", tensor)
    return _run(
        "broadcast",
        lambda: dist.broadcast(tensor, src=src, group=group, async_op=async_op),
        tensor,
        _nbytes(tensor),
        group,
        async_op,
    )


def _staged(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> bool:
    """gloo carries CUDA tensors in its collectives but not point to point: a send or recv of
    one fails ("writev ... Bad address") and breaks the group. Those go through host memory."""
    return tensor.is_cuda and dist.get_backend(group) == "gloo"


def send(
    tensor: torch.Tensor, dst: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> CommWork | None:
    """Point-to-point send to global rank `dst` (``async_op=True`` is `isend`). A CUDA tensor
    over gloo (the shared-GPU mode) is copied to host memory first: the copy is counted as
    `device_to_host` on the "staging" link, the send as what the algorithm moves."""
    if _staged(tensor, group):
        tensor = device_to_host(tensor, torch.empty(tensor.shape, dtype=tensor.dtype), STAGING)
    call = dist.isend if async_op else dist.send
    return _run(
        "send", lambda: call(tensor, dst=dst, group=group), tensor, _nbytes(tensor), group, async_op
    )


def recv(
    tensor: torch.Tensor, src: int, group: dist.ProcessGroup | None = None, async_op: bool = False
) -> CommWork | None:
    """Point-to-point receive from global rank `src` into `tensor` (``async_op=True`` is `irecv`).
    A CUDA tensor over gloo is received in host memory, then copied over (counted as
    `host_to_device` on the "staging" link) — at once, or when an async receive is waited for."""
    target, staged = tensor, _staged(tensor, group)
    if staged:
        tensor = torch.empty(tensor.shape, dtype=tensor.dtype)
    call = dist.irecv if async_op else dist.recv
    work = _run(
        "recv", lambda: call(tensor, src=src, group=group), tensor, _nbytes(tensor), group, async_op
    )
    if not staged:
        return work
    if work is None:
        target.copy_(host_to_device(tensor, target.device, link=STAGING))
        return None

    def arrived() -> None:
        work.wait()
        target.copy_(host_to_device(tensor, target.device, link=STAGING))

    return CommWork(None, arrived)


HOST_LINK = "host link"  # how a CommRecord names the copies of CPU offload
STAGING = "staging"  # ... and a point-to-point message's trip through host memory (gloo, CUDA)


def host_to_device(
    tensor: torch.Tensor,
    device: torch.device,
    dtype: torch.dtype | None = None,
    link: str = HOST_LINK,
) -> torch.Tensor:
    """A copy of host `tensor` on `device` (cast to `dtype`): what CPU offload sends to the
    device before a unit computes. Always a real copy, counted — also where the "device" is
    the CPU itself, so a CPU-only run moves and counts the very bytes a GPU run would."""
    out = torch.empty(tensor.shape, dtype=dtype or tensor.dtype, device=device)
    copy = out.copy_  # non_blocking: from pinned host memory the copy overlaps the GPU's work
    _run(
        "host_to_device",
        lambda: copy(tensor, non_blocking=True),
        tensor,
        _nbytes(tensor),
        None,
        False,
        link,
    )
    return out


def device_to_host(tensor: torch.Tensor, out: torch.Tensor, link: str = HOST_LINK) -> torch.Tensor:
    """Copy device `tensor` into host tensor `out` (CPU offload's gradient shard); returns `out`."""
    _run("device_to_host", lambda: out.copy_(tensor), tensor, _nbytes(tensor), None, False, link)
    return out
