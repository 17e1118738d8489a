"""Live ranks a notebook can talk to: N processes, one process group, many `run` calls.

Real distributed training runs one process per device. A notebook is a single process, so
`Cluster` starts N rank processes once (spawned, like `torch.multiprocessing.spawn`), joins
them into one process group, and keeps them alive. Each `cluster.run(fn, ...)` ships `fn`
by value (cloudpickle, so a function written in a notebook cell works), runs it on every
rank at once and returns the results in rank order.

    notebook ──pipe──▶ rank 0 ─┐
             ──pipe──▶ rank 1 ─┼─ process group (gloo on CPU, NCCL on GPUs)
             ──pipe──▶ rank 2 ─┘   rendezvous: a TCPStore the notebook hosts on 127.0.0.1

The store is hosted by the notebook on a port the OS picks, so two clusters never collide.

Failure policy (what a learner sees):
- an exception on a rank raises `RankError` (rank, remote traceback). If every other rank
  also answered, the cluster stays usable.
- a rank that dies, or ranks that do not answer within `timeout` (a hung collective), raise
  `RankError` too; the cluster then stops all its ranks and starts fresh ones on the next
  `run` (state kept on the ranks is lost, and a line says so).
- `close()` (or leaving the ``with`` block, or garbage collection) stops every rank; a rank
  whose parent dies is killed by the kernel (PR_SET_PDEATHSIG), so no orphan survives.

Under `torchrun`, `AttachedCluster` gives the same `run` interface to a process that already
is one rank, so lab code runs unchanged on a multi-GPU node.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import multiprocessing.connection as mpc
import os
import pickle
import signal
import sys
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ("auto", "gloo", "nccl")


class RankError(RuntimeError):
    """A rank failed: raised an exception, died, or did not answer in time."""

    def __init__(self, rank: int, message: str, remote_traceback: str = "") -> None:
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        text = f"rank {rank}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


# ----------------------------------------------------------------------------- inside a rank


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


def _check_args(world_size: Any, timeout: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1 (e.g. 2 or 4)")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r}: expected a number of seconds > 0 (e.g. 60)")


def _die_with_parent(parent_pid: int) -> None:
    # Linux only: the kernel SIGKILLs this process when the parent dies, even by SIGKILL.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


@contextlib.contextmanager
def _main_module_hidden() -> Any:
    """Spawned children re-import the parent's __main__ unless it looks interactive.

    A learner's script without an ``if __name__ == "__main__":`` guard would then start
    clusters recursively. Ranks never need __main__ (cloudpickle ships functions defined
    there by value), so hide its file and spec while the children start.
    """
    main = sys.modules.get("__main__")
    if main is None:
        yield
        return
    saved_file, saved_spec = main.__dict__.pop("__file__", None), getattr(main, "__spec__", None)
    main.__spec__ = None
    try:
        yield
    finally:
        main.__spec__ = saved_spec
        if saved_file is not None:
            main.__file__ = saved_file


def _worker_main(
    rank: int, world_size: int, backend: str, port: int, timeout: float, conn: Any, parent: int
) -> None:
    """Loop of one rank: join the group, then run whatever the notebook sends until 'stop'."""
    _die_with_parent(parent)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.TCPStore(
            "127.0.0.1", port, world_size + 1, False, timeout=timedelta(seconds=timeout)
        )
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=world_size,
            # The backend's own collective timeout is only a backstop: the notebook's watchdog
            # (`Cluster.timeout`) must fire first, so that a hang is reported as a hang and the
            # ranks are restarted, not left with a half-failed process group.
            timeout=timedelta(seconds=2 * timeout + 30),
        )
    except BaseException:  # report, then exit: the parent turns this into an error
        conn.send_bytes(pickle.dumps(("error", "failed to join", traceback.format_exc(), "")))
        return
    conn.send_bytes(pickle.dumps(("ready", None, "", "")))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):  # the notebook went away
            break
        if message == b"stop":
            break
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
                fn, args, kwargs = cloudpickle.loads(message)
                result = fn(*args, **kwargs)
        except BaseException as exc:  # any failure goes back to the caller; the loop lives on
            reply = pickle.dumps(
                ("error", f"raised {exc!r}", traceback.format_exc(), out.getvalue())
            )
        else:
            try:
                reply = cloudpickle.dumps(("ok", result, "", out.getvalue()))
            except Exception as exc:
                why = f"returned a result that cannot be pickled to send back ({exc!r})"
                reply = pickle.dumps(("error", why, traceback.format_exc(), out.getvalue()))
        conn.send_bytes(reply)
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _stop_processes(procs: list[Any], conns: list[Any], grace: float = 5.0) -> None:
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.send_bytes(b"stop")
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for conn in conns:
        with contextlib.suppress(Exception):
            conn.close()


class Cluster:
    """N live rank processes in one process group.

    Args:
        world_size: number of ranks (int >= 1).
        backend: "auto" (NCCL if `world_size` GPUs are visible, else gloo), "gloo" or "nccl".
        timeout: seconds a `run` may take before hung ranks are reported (and the process
            group's own collective timeout).
        start_timeout: seconds allowed for starting the ranks (importing torch is slow).
        verbose: print a line when ranks start or restart.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        timeout: float = 120.0,
        *,
        start_timeout: float = 180.0,
        verbose: bool = True,
    ) -> None:
        _check_args(world_size, timeout)
        _check_args(world_size, start_timeout)
        self.world_size = world_size
        self.backend = resolve_backend(backend, world_size)
        self.timeout = float(timeout)
        self.start_timeout = float(start_timeout)
        self.verbose = verbose
        self.start_seconds: float | None = None
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._store: Any = None
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        self._start()

    # -- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        # The notebook hosts the rendezvous store; port 0 lets the OS choose a free port.
        self._store = dist.TCPStore(
            "127.0.0.1", 0, self.world_size + 1, True, wait_for_workers=False
        )
        ctx = mp.get_context("spawn")
        with _main_module_hidden():
            self._spawn_ranks(ctx)
        self._finalizer = weakref.finalize(self, _stop_processes, self._procs, self._conns)
        try:
            self._collect(None, self.start_timeout, what="start")
        except RankError:
            self._teardown()
            raise
        self.start_seconds = time.perf_counter() - t0
        if self.verbose:
            print(
                f"fsdp_lab: {self.world_size} rank(s) up on {self.backend} "
                f"in {self.start_seconds:.1f} s (pids {', '.join(str(p) for p in self.pids)})"
            )

    def _spawn_ranks(self, ctx: Any) -> None:
        for r in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            args = (
                r,
                self.world_size,
                self.backend,
                self._store.port,
                self.timeout,
                child_end,
                os.getpid(),
            )
            proc = ctx.Process(
                target=_worker_main, args=args, daemon=True, name=f"fsdp_lab-rank{r}"
            )
            proc.start()
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)

    def _teardown(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # stops and joins every rank exactly once
        self._procs, self._conns, self._store = [], [], None

    def close(self) -> None:
        """Stop every rank process. Safe to call twice."""
        self._teardown()
        self._closed = True

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        """Process ids of the live ranks, in rank order."""
        return [p.pid for p in self._procs]

    # -- running ------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new one: Cluster(world_size)")
        if not callable(fn):
            raise TypeError(f"run() needs a function, got {type(fn).__name__}: {fn!r}")
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"cannot send {name!r} (or its arguments) to the ranks: {exc}. Everything "
                "a rank runs is pickled; pass plain data, tensors and functions, not open "
                "files, locks, generators or live processes."
            ) from exc
        if not self._procs:
            if self.verbose:
                print(f"fsdp_lab: starting {self.world_size} fresh rank(s) after the last failure")
            self._start()
        for conn in self._conns:
            conn.send_bytes(payload)
        return self._collect(payload, self.timeout, what=getattr(fn, "__name__", "fn"))

    def _collect(self, payload: bytes | None, timeout: float, what: str) -> list[Any]:
        """Wait for one reply per rank; turn exceptions, deaths and silence into RankError."""
        n = self.world_size
        results: list[Any] = [None] * n
        errors: dict[int, tuple[str, str]] = {}
        dead: dict[int, int | None] = {}
        pending = set(range(n))
        deadline = time.monotonic() + timeout
        grace_deadline: float | None = None
        while pending:
            # Once a rank has failed, the others get a short grace to answer: a rank stuck in a
            # collective with the failed one would otherwise hold the notebook for `timeout`.
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            ready = mpc.wait(
                [self._conns[r] for r in pending] + [self._procs[r].sentinel for r in pending],
                timeout=max(0.0, limit - time.monotonic()),
            )
            if not ready:
                break
            for r in sorted(pending):
                conn, proc = self._conns[r], self._procs[r]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        status, value, tb, out = pickle.loads(conn.recv_bytes())
                    except (EOFError, OSError):
                        proc.join(1.0)
                        dead[r] = proc.exitcode
                        pending.discard(r)
                        continue
                    pending.discard(r)
                    if out:
                        print("".join(f"[rank {r}] {line}\n" for line in out.splitlines()), end="")
                    if status == "error":
                        errors[r] = (value, tb)
                    else:
                        results[r] = value
                elif proc.sentinel in ready:
                    proc.join(1.0)
                    dead[r] = proc.exitcode
                    pending.discard(r)
            if (errors or dead) and grace_deadline is None:
                grace_deadline = time.monotonic() + min(timeout, 10.0)
        if not errors and not dead and not pending:
            return results
        broken = bool(dead or pending)
        if broken or what == "start":
            self._teardown()
        after = (
            " All ranks were stopped; the next run() starts fresh ones."
            if broken
            else (" The other ranks answered; the cluster is still usable.")
        )
        if errors:
            r = min(errors)
            message, tb = errors[r]
            raise RankError(r, f"{what} {message}.{after}", tb)
        if dead:
            r = min(dead)
            code = dead[r]
            how = (
                f"signal {signal.Signals(-code).name}" if code and code < 0 else f"exit code {code}"
            )
            raise RankError(r, f"the rank process died ({how}) while running {what}.{after}")
        stuck = sorted(pending)
        raise RankError(
            stuck[0],
            f"ranks {stuck} did not finish {what} within timeout={timeout:g} s — most often a "
            "collective that not every rank called, or called with different sizes, or very "
            f"slow work (raise Cluster(timeout=...)).{after}",
        )


class AttachedCluster:
    """The `Cluster` interface for a process that already is one rank (torchrun, env://).

    `run(fn)` calls `fn` here and all-gathers every rank's result, so lab code written for
    `Cluster` runs unchanged under ``torchrun --nproc-per-node N -m fsdp_lab <lab>``.
    """

    def __init__(self, backend: str = "auto", timeout: float = 600.0) -> None:
        env_world = int(os.environ["WORLD_SIZE"])
        _check_args(env_world, timeout)
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", env_world)))
        if self.backend == "nccl":
            torch.cuda.set_device(local_rank)
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


def under_torchrun() -> bool:
    """True when this process was started by torchrun (env:// rendezvous variables set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


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
