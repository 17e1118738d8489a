"""The `Cluster` interface for a process that already is one rank (torchrun, env://).

Under ``torchrun --nproc-per-node N -m fsdp_lab <lab>`` every process runs the CLI; there is
no notebook to ship functions from, so `AttachedCluster.run(fn)` calls `fn` here and
all-gathers every rank's result. Lab code written for `Cluster` runs unchanged.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from fsdp_lab.cluster.driver import Cluster, check_timeout
from fsdp_lab.cluster.protocol import RankError
from fsdp_lab.cluster.where import place_this_rank, rank, resolve_placement
from fsdp_lab.host import under_torchrun


class AttachedCluster:
    """`run(fn)` calls `fn` on this rank and all-gathers the results of every rank."""

    def __init__(self, backend: str = "auto", timeout: float = 600.0) -> None:
        check_timeout("timeout", timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        # The GPUs of this node, shared by its ranks when there are fewer GPUs than ranks.
        self.placement = resolve_placement(backend, local_world)
        self.backend = self.placement.backend
        place_this_rank(self.placement, local_rank, local_world)
        if not dist.is_initialized():
            dist.init_process_group(self.backend, timeout=timedelta(seconds=timeout))
        self.world_size = dist.get_world_size()
        self.timeout = timeout
        self.start_seconds = 0.0

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            raise RankError(rank(), repr(exc), traceback.format_exc()) from exc
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, result)
        return gathered

    def close(self) -> None:
        if dist.is_initialized():
            # Every rank leaves together: a rank tearing gloo down while another is still in
            # a collective makes the other's transport thread abort the process.
            dist.barrier()
            dist.destroy_process_group()

    def __enter__(self) -> AttachedCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


SHARED_DIR_ENV = "FSDP_LAB_SHARED_DIR"  # where torchrun's ranks share files (several machines)


@contextlib.contextmanager
def shared_folder(cluster: Cluster | AttachedCluster, prefix: str) -> Iterator[str]:
    """A temporary folder every rank of `cluster` writes and reads (a sharded checkpoint).

    A `Cluster`'s ranks share this host: the driver's own temporary folder. Under torchrun
    each rank runs this code itself, so rank 0 makes the folder — in ``$FSDP_LAB_SHARED_DIR``,
    default the temporary folder; on several machines a filesystem every node mounts — and
    broadcasts its path. Removed once every rank is done with it.
    """
    if not isinstance(cluster, AttachedCluster):
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield tmp
        return
    base = os.environ.get(SHARED_DIR_ENV) or tempfile.gettempdir()
    path = [tempfile.mkdtemp(prefix=prefix, dir=base) if rank() == 0 else None]
    dist.broadcast_object_list(path, src=0)
    try:
        yield path[0]
    finally:
        dist.barrier()
        if rank() == 0:
            shutil.rmtree(path[0], ignore_errors=True)


def open_cluster(
    world_size: int, backend: str = "auto", timeout: float = 120.0
) -> Cluster | AttachedCluster:
    """A `Cluster` of `world_size` ranks, or the torchrun job this process belongs to."""
    if under_torchrun():
        cluster = AttachedCluster(backend, timeout)
        if world_size != cluster.world_size and rank() == 0:
            print(
                f"fsdp_lab: running under torchrun with {cluster.world_size} ranks "
                f"(--world-size {world_size} ignored)",
                file=sys.stderr,
            )
        return cluster
    return Cluster(world_size, backend, timeout)


@contextlib.contextmanager
def borrow(
    cluster: Cluster | AttachedCluster | None, world_size: int, backend: str = "auto"
) -> Iterator[Cluster | AttachedCluster]:
    """The cluster a lab runs on: the caller's, left running, or a new one closed on the way
    out — after a failure or Ctrl-C too, so no rank outlives the call.

        with borrow(cluster, config.world_size, config.backend) as c:
            per_rank = c.run(worker, ...)
    """
    if cluster is not None:
        yield cluster
        return
    owned = Cluster(world_size, backend)
    try:
        yield owned
    finally:
        owned.close()
