"""How many bytes does this rank hold right now, and what are they for? A live memory tracker.

(Over 400 lines on purpose: the dispatch mode, storage lifetimes and the category rules
are one mechanism; split, the reason a byte is counted would sit in another file.)

A mechanism's own bookkeeping ("I freed the gathered buffer") can be wrong; the storages that
really exist cannot. `MemoryTracker` measures memory the way PyTorch's own tools do
(`torch.distributed._tools.mem_tracker`, `torch.cuda.memory._snapshot`): a `TorchDispatchMode`
sees every operator (forward and autograd backward), registers each *new* storage an operator
returns, and subtracts its bytes when the last tensor using it dies (a weakref callback on the
storage object, which PyTorch keeps unique per storage). Views, in-place ops and ``out=`` reuse
an existing storage, so they cost nothing — exactly as in the allocator.

Every storage carries one of `CATEGORIES`: a tag given when it is created (``with
category("comm_buffers"): ...``, default "other"), replaced by its *role* at every `mark()`
(a tracked module's parameter -> "parameters", its ``.grad`` -> "gradients", an optimizer's
state -> "optimizer_state"). Roles are matched by storage identity, so an unsharded parameter
that is a view into an all-gather buffer moves that whole buffer to "parameters".

On CUDA the totals come from the caching allocator (`torch.cuda.memory_allocated`); the
storages still split them into categories. On CPU the totals are the sum of live storages.

    with MemoryTracker(rank=0) as mem:
        mem.track(model); mem.track(optimizer)
        loss = model(x).sum(); mem.mark("forward")
        loss.backward(); mem.mark("backward")
    mem.trace()  # columnar dict for fsdp_lab.plots

[Note: what is not seen] Storages created before tracking unless `track()`ed (a DTensor counts
through its local shard); ops run by threads other than the one that started the tracker
(autograd's own threads excepted) — gloo's internal copy of an all-gather, for one; scratch
memory inside a single operator. `UntypedStorage.resize_` is not an operator, so the tracker
wraps it (how every FSDP frees a gathered buffer while views of it still exist). On CUDA,
autograd's device threads do not inherit the `category` context: gradients start as "other"
and get their role at the next `mark()`.
"""

from __future__ import annotations

import contextvars
import functools
import socket
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_lab.trace.cuda_memory import cuda_process_memory

CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "comm_buffers", "other")
# What ZeRO's model-state formulas count: not activations, not "other" (setup copies, scratch).
MODEL_STATE = ("parameters", "gradients", "optimizer_state", "comm_buffers")
_INDEX = {name: i for i, name in enumerate(CATEGORIES)}
_OTHER = _INDEX["other"]

_ACTIVE_CATEGORY = contextvars.ContextVar("fsdp_lab_memory_category", default=_OTHER)
# The trackers running in this context, so a mechanism can mark() them without a reference.
_RUNNING: contextvars.ContextVar[tuple[MemoryTracker, ...]] = contextvars.ContextVar(
    "fsdp_lab_running_trackers", default=()
)


def _category_index(name: str) -> int:
    if name not in _INDEX:
        raise ValueError(f"unknown memory category {name!r}; allowed: {', '.join(CATEGORIES)}")
    return _INDEX[name]


def mark(label: str) -> None:
    """Mark every tracker running in this context (no-op without one): "all-gather unit 3"."""
    for tracker in _RUNNING.get():
        tracker.mark(label)


@contextmanager
def category(name: str) -> Iterator[None]:
    """Tag the storages created inside the block with `name` (one of `CATEGORIES`).

    Needs no tracker: a mechanism writes ``with trace.category("comm_buffers"): buf = ...``
    and whichever tracker is running files the bytes there.
    """
    token = _ACTIVE_CATEGORY.set(_category_index(name))
    try:
        yield
    finally:
        _ACTIVE_CATEGORY.reset(token)


class _Record:
    """One live storage: its bytes when last looked at, its category, a weakref to it."""

    __slots__ = ("key", "nbytes", "cat", "ref")

    def __init__(self, key: int, nbytes: int, cat: int) -> None:
        self.key, self.nbytes, self.cat = key, nbytes, cat
        self.ref: weakref.ref | None = None


class _StorageWatcher(TorchDispatchMode):
    """Runs each aten operator, then shows its outputs to the tracker."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tracker._on_op(func, args, kwargs, out)
        return out


class MemoryTracker:
    """Live bytes of tensor storages on one device, split into `CATEGORIES`, over time.

    Args:
        device: the device to measure (default CPU); storages elsewhere are ignored.
        rank: stored in the trace; defaults to the torch.distributed rank when initialised.
    """

    def __init__(self, device: torch.device | str | None = None, *, rank: int | None = None):
        device = torch.device(device if device is not None else "cpu")
        self._use_allocator = device.type == "cuda"
        if self._use_allocator and not torch.cuda.is_available():
            raise RuntimeError(f"cannot track {device}: CUDA is not available")
        if self._use_allocator and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
            rank = torch.distributed.get_rank()
        self.device, self.rank = device, rank
        # The dispatch mode also runs on autograd threads: state changes happen under the lock.
        # Reentrant, so that a __del__ running tensor ops during our bookkeeping cannot deadlock.
        self._lock = threading.RLock()
        # Weakref callbacks fire at any moment (GC, another thread, halfway through our own
        # bookkeeping), so they only append (time, record) here — one atomic deque operation —
        # and the frees are applied under the lock before the next event is counted.
        self._pending_frees: deque[tuple[float, _Record]] = deque()
        self._remembered: list[tuple[weakref.ref, int | None]] = []
        self._watcher: _StorageWatcher | None = None
        self._clear_recording()

    def _clear_recording(self) -> None:
        self._live: dict[int, _Record] = {}  # id(storage) -> record of a live storage
        self._bytes = [0] * len(CATEGORIES)  # running totals, one per category
        self._samples: list[tuple[float, tuple[int, ...], int]] = []  # (t, split, total)
        self._markers: list[dict[str, Any]] = []
        self._peak, self._peak_split = 0, tuple(self._bytes)
        self._cuda: dict[str, Any] | None = None
        self._t0 = time.perf_counter()

    def start(self) -> MemoryTracker:
        """Start watching operators (a previous recording of this tracker is discarded)."""
        if self._watcher is not None:
            raise RuntimeError("this MemoryTracker is already running")
        _warm_up_dispatch_modes()
        _report_storage_resizes()
        self._clear_recording()
        if self._use_allocator:
            torch.cuda.reset_peak_memory_stats(self.device)
        self._watcher = _StorageWatcher(self)
        self._watcher.__enter__()
        _RUNNING.set((*_RUNNING.get(), self))
        with self._lock:
            self._sweep_remembered()
            self._record_sample()
        return self

    def stop(self) -> None:
        """Stop watching; the recording is frozen as it stands after a last refresh."""
        if self._watcher is None:
            return
        self._refresh()
        if self._use_allocator:  # the process beside its tensors: reserved, CUDA context
            self._cuda = cuda_process_memory(self.device)
        self._watcher.__exit__(None, None, None)
        self._watcher = None
        _RUNNING.set(tuple(t for t in _RUNNING.get() if t is not self))
        with self._lock:
            # A weakref object that dies first never calls back: dropping them detaches every
            # storage from this tracker (and breaks the record <-> callback reference cycles).
            for rec in self._live.values():
                rec.ref = None
            self._live.clear()
            self._pending_frees.clear()

    __enter__ = start

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- the hot path: called once per operator, so no rescans here -----------------------------

    def _on_op(self, func: Any, args: tuple, kwargs: dict | None, out: Any) -> None:
        input_storages: set[int] | None = None
        for t in (out,) if isinstance(out, torch.Tensor) else _tensors_in(out):
            storage = _storage_of(t, self.device)
            if storage is None:
                continue
            with self._lock:
                self._apply_pending_frees()  # first, so that a freed block's reuse is no peak
                rec = self._lookup(storage)
                if rec is not None:
                    self._update_nbytes(rec, storage.nbytes())  # Tensor.resize_, out= growth
                    continue
                # A storage that one of the inputs already has means a view, an in-place op or
                # out= on something created before tracking — except for lift_fresh, which
                # wraps the tensor torch.tensor(...) has just built outside dispatch.
                if func is not torch.ops.aten.lift_fresh.default:
                    if input_storages is None:
                        inputs = _tensors_in([args, list((kwargs or {}).values())])
                        input_storages = {
                            id(s) for x in inputs if (s := _storage_of(x, self.device))
                        }
                    if id(storage) in input_storages:
                        continue
                self._register(storage, _ACTIVE_CATEGORY.get())

    # -- bookkeeping; callers hold self._lock --------------------------------------------------

    def _lookup(self, storage: torch.UntypedStorage) -> _Record | None:
        rec = self._live.get(id(storage))  # ids are reused, so confirm through the weakref
        return rec if rec is not None and rec.ref is not None and rec.ref() is storage else None

    def _register(self, storage: torch.UntypedStorage, cat: int) -> None:
        # Zero-byte storages are registered too: a buffer created empty and grown later with
        # resize_ (FSDP's unsharded parameters) must be known to be re-read.
        rec = _Record(id(storage), storage.nbytes(), cat)
        pending = self._pending_frees
        rec.ref = weakref.ref(
            storage, lambda _, rec=rec: pending.append((time.perf_counter(), rec))
        )
        self._live[rec.key] = rec
        if rec.nbytes:
            self._bytes[cat] += rec.nbytes
            self._record_sample()

    def _apply_pending_frees(self) -> None:
        while self._pending_frees:
            t, rec = self._pending_frees.popleft()
            rec.ref = None
            if self._live.get(rec.key) is rec:
                del self._live[rec.key]
            if rec.nbytes:
                self._bytes[rec.cat] -= rec.nbytes
                self._record_sample(t)

    def _update_nbytes(self, rec: _Record, nbytes: int) -> None:
        if nbytes != rec.nbytes:
            self._bytes[rec.cat] += nbytes - rec.nbytes
            rec.nbytes = nbytes
            self._record_sample()

    def _record_sample(self, when: float | None = None) -> None:
        split = tuple(self._bytes)
        total = torch.cuda.memory_allocated(self.device) if self._use_allocator else sum(split)
        t = (time.perf_counter() if when is None else when) - self._t0
        self._samples.append((t, split, total))  # a single append: safe if re-entered
        if total > self._peak:
            self._peak, self._peak_split = total, split

    def _classify(self, t: torch.Tensor, cat: int, by_role: bool) -> None:
        storage = _storage_of(t, self.device)
        if storage is None:
            return
        rec = self._lookup(storage)
        if rec is None:
            self._register(storage, cat)  # created before tracking, or by a non-operator
        elif by_role and rec.cat != cat:  # moves bytes between categories; total unchanged
            self._bytes[rec.cat] -= rec.nbytes
            self._bytes[cat] += rec.nbytes
            rec.cat = cat

    def _sweep_remembered(self) -> None:
        alive = []
        for ref, cat in self._remembered:
            obj = ref()
            if obj is None:
                continue  # deleted by its owner: the tracker held it weakly, so it is gone
            alive.append((ref, cat))
            for tensor, role, by_role in _roles(obj, cat):
                self._classify(tensor, role, by_role)
        self._remembered = alive

    def _on_resize(self, storage: torch.UntypedStorage) -> None:
        with self._lock:
            self._apply_pending_frees()
            rec = self._lookup(storage)
            if rec is not None:
                self._update_nbytes(rec, storage.nbytes())

    def _refresh(self) -> None:
        """The full rescan, only at mark()/trace(): frees, storage resizes, roles."""
        with self._lock:
            self._apply_pending_frees()
            for rec in list(self._live.values()):
                storage = rec.ref() if rec.ref is not None else None
                if storage is not None:
                    self._update_nbytes(rec, storage.nbytes())  # UntypedStorage.resize_
            self._sweep_remembered()
            if self._use_allocator:  # the allocator also saw peaks inside an operator
                self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))

    # -- public API ------------------------------------------------------------------------------

    def track(
        self,
        obj: torch.Tensor | torch.nn.Module | torch.optim.Optimizer,
        category: str | None = None,
    ) -> None:
        """Count storages created before tracking, and remember roles for every `mark()`.

        Args:
            obj: a tensor (counted as `category`, default "other"); a module (parameters ->
                "parameters", their grads -> "gradients", buffers -> "other"); or an optimizer
                (its parameters and grads likewise, its state -> "optimizer_state"). Held
                weakly: deleting the model elsewhere frees its bytes here too.
            category: for a tensor only, one of `CATEGORIES`.
        """
        if not isinstance(obj, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            raise TypeError(
                f"cannot track a {type(obj).__name__}: pass a Tensor, Module, Optimizer"
            )
        if category is not None and not isinstance(obj, torch.Tensor):
            raise ValueError("category is for tensors; modules and optimizers are split by role")
        cat = None if category is None else _category_index(category)
        with self._lock:
            self._remembered.append((weakref.ref(obj), cat))
            if self._watcher is not None:
                self._sweep_remembered()
                self._record_sample()

    def mark(self, label: str) -> None:
        """Refresh (frees, resizes, roles), then record a sample with a labelled marker."""
        if self._watcher is None:
            raise RuntimeError("mark() needs a running tracker: `with MemoryTracker() as mem:`")
        self._refresh()
        with self._lock:
            self._record_sample()
            t, _, total = self._samples[-1]
            self._markers.append({"t": t, "label": label, "total": total})

    @property
    def current_bytes(self) -> int:
        """Bytes held now (CUDA: allocated on the device); after stop(), at the stop."""
        with self._lock:
            self._apply_pending_frees()
            if self._use_allocator and self._watcher is not None:
                return torch.cuda.memory_allocated(self.device)
            return self._samples[-1][2] if self._use_allocator else sum(self._bytes)

    @property
    def peak_bytes(self) -> int:
        """The highest total since start() or the last reset_peak()."""
        with self._lock:
            self._apply_pending_frees()
            if self._use_allocator and self._watcher is not None:
                self._peak = max(self._peak, torch.cuda.max_memory_allocated(self.device))
            return self._peak

    def reset_peak(self) -> None:
        """Start a new peak window at the current total (e.g. before the step to measure)."""
        with self._lock:
            self._apply_pending_frees()
            if self._use_allocator:
                torch.cuda.reset_peak_memory_stats(self.device)
            self._record_sample()
            _, self._peak_split, self._peak = self._samples[-1]

    def trace(self) -> dict[str, Any]:
        """The recording as JSON-serialisable columns, one entry per sample, for plotting.

        ``peak_bytes`` is `peak_bytes` (since start() or the last reset_peak()) and
        ``peak_by_category`` the category split at the sample where that peak was reached.
        On CUDA, ``cuda`` is the process's allocator and context memory
        (`cuda_memory.cuda_process_memory`), read at stop() or now.
        """
        if self._watcher is not None:
            self._refresh()
        with self._lock:
            samples = list(self._samples)
            return {
                "rank": self.rank,
                "device": str(self.device),
                "source": "cuda_allocator" if self._use_allocator else "storages",
                "categories": list(CATEGORIES),
                "t": [t for t, _, _ in samples],
                "bytes": {c: [s[i] for _, s, _ in samples] for i, c in enumerate(CATEGORIES)},
                "total": [total for _, _, total in samples],
                "markers": [dict(m) for m in self._markers],
                "peak_bytes": self._peak,
                "peak_by_category": dict(zip(CATEGORIES, self._peak_split, strict=True)),
                # the `perf_counter()` reading `t` counts from, and where: one host's ranks
                # share that clock, so their traces go on one axis (as timelines do)
                "origin": self._t0,
                "host": socket.gethostname(),
                **(
                    {"cuda": self._cuda or cuda_process_memory(self.device)}
                    if self._use_allocator
                    else {}
                ),
            }


@functools.cache
def _warm_up_dispatch_modes() -> None:
    # The first operator a process runs under any dispatch mode pays ~1 s of one-time set-up
    # inside torch; paying it here keeps it out of the recording's time axis.
    class _Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with _Passthrough():
        torch.empty(1) + 1


@functools.cache
def _report_storage_resizes() -> None:
    # `UntypedStorage.resize_` is no operator, so the dispatch mode never sees it — yet it is
    # how FSDP (ours, FSDP1, FSDP2) frees and re-allocates a gathered buffer. Wrapped once, for
    # good: with no tracker running the wrapper only reads a context variable.
    original = torch.UntypedStorage.resize_

    @functools.wraps(original)
    def resize_(storage: torch.UntypedStorage, size: int) -> Any:
        out = original(storage, size)
        for tracker in _RUNNING.get():
            tracker._on_resize(storage)
        return out

    torch.UntypedStorage.resize_ = resize_


def _roles(obj: Any, cat: int | None) -> Iterator[tuple[torch.Tensor, int, bool]]:
    """(tensor, category, by_role) for a tracked object; by_role re-tags a known storage."""
    if isinstance(obj, torch.Tensor):
        yield obj, _OTHER if cat is None else cat, cat is not None
        if obj.grad is not None:  # e.g. the gradient of FSDP's unsharded flat parameter
            yield obj.grad, _INDEX["gradients"], True
        return
    if isinstance(obj, torch.nn.Module):
        params, buffers, states = list(obj.parameters()), list(obj.buffers()), []
    else:  # an optimizer: the parameters it updates and its state (exp_avg, step, ...)
        params = [p for group in obj.param_groups for p in group["params"]]
        buffers, states = [], [v for state in obj.state.values() for v in state.values()]
    for p in params:
        yield p, _INDEX["parameters"], True
        if p.is_leaf and p.grad is not None:  # .grad of a non-leaf only warns
            yield p.grad, _INDEX["gradients"], True
    yield from ((b, _OTHER, False) for b in buffers)
    yield from ((s, _INDEX["optimizer_state"], True) for s in states if isinstance(s, torch.Tensor))


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    # Operator arguments and outputs: tensors, or nested lists/tuples of them (cat, _foreach_*).
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)


def _storage_of(t: torch.Tensor, device: torch.device) -> torch.UntypedStorage | None:
    # Meta tensors, other devices and sparse layouts hold no bytes on `device`; wrapper
    # subclasses such as DTensor have no storage of their own.
    local = getattr(t, "_local_tensor", None)  # a DTensor (FSDP2): its bytes live in its shard
    if isinstance(local, torch.Tensor):
        t = local
    if t.device != device or t.layout != torch.strided:
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
