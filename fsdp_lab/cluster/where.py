"""Inside a rank: which rank am I, how many are we, which device do I compute on.

These read the default process group, so the same lab code answers correctly in a `Cluster`
rank, under torchrun, and in a plain single process (rank 0 of 1, on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab.choices import BACKENDS, DEVICE_ENV, DEVICES


def rank() -> int:
    """This process's global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the default process group (1 outside one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


_PLACED: list[torch.device] = []  # set once in a rank by `place_this_rank`
_SHARE: list[float] = []  # ... and in the shared-GPU mode, its fraction of that GPU


def device() -> torch.device:
    """The device this rank computes on: the one its cluster placed it on (a GPU of its own
    under NCCL, a shared GPU in the shared-GPU mode, the CPU), else its own GPU under NCCL,
    else the CPU."""
    if _PLACED:
        return _PLACED[0]
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def intra_op_threads(count: int) -> Iterator[None]:
    """torch's intra-op threads set to `count` (at least 1) for a block, then put back.

    N ranks on one machine, each with torch's default thread count, oversubscribe its cores:
    OpenMP threads spinning against each other made small steps 5-10x slower, now and then, in
    our runs on 2 cores. Labs run their measured work inside this.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, count))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rank_threads() -> contextlib.AbstractContextManager[None]:
    """Intra-op threads for one rank: this machine's cores shared by the ranks (at least 1).

    N ranks x torch's default thread count oversubscribe the cores, and OpenMP threads spinning
    against each other made the slice initialiser 5-10x slower (measured on 2 cores).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return intra_op_threads((cores or 1) // world_size())


def in_rank_threads(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run under `rank_threads()`: for a lab's rank workers (``cluster.run(worker)``)."""

    @functools.wraps(fn)
    def on_rank(*args: Any, **kwargs: Any) -> Any:
        with rank_threads():
            return fn(*args, **kwargs)

    return on_rank


@dataclass(frozen=True)
class Placement:
    """Where a cluster's ranks compute and how they talk: what `resolve_placement` chose."""

    backend: str  # "gloo" or "nccl"
    device: str  # "cpu" or "cuda"
    gpus: int  # GPUs the ranks use (0 on the CPU)
    why: str  # the start line's reason, e.g. "4 ranks sharing cuda:0 (gloo on CUDA tensors)"

    @property
    def shared_gpu(self) -> bool:
        """Several ranks per GPU: gloo's collectives on CUDA tensors, staged where it cannot."""
        return self.device == "cuda" and self.backend == "gloo"

    def device_of(self, rank: int) -> torch.device:
        return (
            torch.device("cuda", rank % self.gpus) if self.device == "cuda" else torch.device("cpu")
        )

    def memory_share(self, world_size: int) -> float:
        """The fraction of its GPU one rank may allocate: 1 / ranks on that GPU."""
        return 1.0 / -(-world_size // self.gpus) if self.gpus else 1.0


def resolve_placement(
    backend: str, world_size: int, device: str | None = None, gpus: int | None = None
) -> Placement:
    """Backend and device for `world_size` ranks. `backend="auto"`: one GPU per rank -> NCCL;
    otherwise gloo on the CPU. `device="cuda"` with fewer GPUs than ranks -> the shared-GPU mode
    (gloo on CUDA tensors, several ranks per GPU); `device="cpu"` (or FSDP_LAB_DEVICE=cpu)
    forces the CPU. `gpus`: the visible GPUs (default: counted)."""
    device = device or os.environ.get(DEVICE_ENV) or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if device not in DEVICES:
        raise ValueError(
            f"device={device!r} is not one of {DEVICES}. Fix: device='cpu' for the CPU lab, "
            "or 'auto'"
        )
    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    n = world_size
    if backend == "nccl":  # one GPU per rank, or a clear no
        if device == "cpu":
            raise ValueError(
                "backend='nccl' runs on GPUs only, and device='cpu' asks for the CPU. Fix: "
                "backend='gloo' (or 'auto') for the CPU lab, or device='auto'"
            )
        if gpus < n:
            raise ValueError(
                f"backend='nccl' needs one GPU per rank: world_size={n} but {gpus} GPU(s) "
                f"found (NCCL cannot put two ranks on one GPU). Fix: device='cuda' for {n} "
                f"ranks sharing {gpus} GPU(s) over gloo, or world_size={gpus}"
                if gpus
                else f"backend='nccl' needs one GPU per rank: world_size={n} but 0 GPU(s) found. "
                "Fix: backend='gloo' (CPU) or 'auto'"
            )
        return Placement("nccl", "cuda", n, f"{n} rank(s), one GPU each (NCCL)")
    # [Note: the shared-GPU mode is asked for] With fewer GPUs than ranks, "auto" stays on the
    # CPU until `scripts/gpu_check.sh` has run the shared mode on a GPU; device="cuda" asks for
    # it, and the start line says so to whoever has a GPU.
    fewer = backend == "auto" and 0 < gpus < n
    if device == "cpu" or (device == "auto" and (gpus == 0 or backend == "gloo" or fewer)):
        if device == "cpu":
            reason = "--device cpu"
        elif fewer:
            reason = (
                f"{gpus} GPU(s) for {n} ranks; --device cuda shares them (gloo on CUDA tensors)"
            )
        else:
            reason = "backend='gloo' asked for" if gpus else "no GPU visible"
        return Placement("gloo", "cpu", 0, f"{n} rank(s) on the CPU (gloo): {reason}")
    if gpus == 0:
        raise ValueError(
            f"device='cuda' (--device cuda) but no GPU is visible (torch {torch.__version__}). "
            "Fix: device='cpu' (--device cpu), or a CUDA build of torch on a machine with a GPU"
        )
    if backend == "auto" and gpus >= n:
        return Placement("nccl", "cuda", n, f"{n} rank(s), one GPU each (NCCL)")
    used = min(gpus, n)
    names = ", ".join(f"cuda:{g}" for g in range(used))
    return Placement("gloo", "cuda", used, f"{n} ranks sharing {names} (gloo on CUDA tensors)")


def resolve_backend(backend: str, world_size: int) -> str:
    """The backend `resolve_placement` picks (validating the name)."""
    return resolve_placement(backend, world_size).backend


def place_this_rank(placement: Placement, rank: int, world_size: int) -> torch.device:
    """In a rank, before the process group: its device, and in the shared-GPU mode its share of
    that GPU (`torch.cuda.set_per_process_memory_fraction`), so N ranks fit side by side."""
    where = placement.device_of(rank)
    if where.type == "cuda":
        torch.cuda.set_device(where)
        if placement.shared_gpu:
            share = placement.memory_share(world_size)
            torch.cuda.set_per_process_memory_fraction(share, where)
            _SHARE[:] = [share]
    _PLACED[:] = [where]
    return where


def _gpu_bytes(where: torch.device) -> int:
    return torch.cuda.get_device_properties(where).total_memory


def out_of_memory_hint(exc: BaseException) -> str:
    """What to add to a CUDA out-of-memory error in the shared-GPU mode: the rank's share of
    its GPU, and the fix ("" for any other error, or outside that mode)."""
    if not (_SHARE and _PLACED and isinstance(exc, torch.OutOfMemoryError)):
        return ""
    where, share = _PLACED[0], _SHARE[0]
    total = _gpu_bytes(where) / 2**30
    return (
        f" — this rank may allocate {share:.0%} of {where} ({share * total:.1f} of {total:.1f} "
        f"GiB), the rest is its neighbours'. Fix: fewer ranks per GPU (world_size), a smaller "
        "model or batch, or device='cpu'"
    )
