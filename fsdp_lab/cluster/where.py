"""Inside a rank: which rank am I, how many are we, which device do I compute on.

These read the default process group, so the same lab code answers correctly in a `Cluster`
rank, under torchrun, and in a plain single process (rank 0 of 1, on the CPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab.choices import BACKENDS


def rank() -> int:
    """This process's global rank (0 outside a process group)."""
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    """Number of ranks in the default process group (1 outside one)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def device() -> torch.device:
    """The device this rank computes on: its own GPU under NCCL, else the CPU."""
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


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> 'nccl' when `world_size` GPUs are visible, else 'gloo'; validates the name."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: world_size={world_size} but {gpus} GPU(s) "
            "found. Use backend='gloo' (CPU) or 'auto', or a smaller world_size."
        )
    return backend
