"""What runs inside one rank process: join the process group, then answer calls in order.

A rank is forked from the launcher (`fsdp_lab.cluster.launcher`) and lives until the driver
says "stop" or goes away. Five things make it safe to leave running under a notebook:

- it dies with its parent (PR_SET_PDEATHSIG), and the launcher dies with the driver;
- what it starts dies with it: it is a child subreaper (whatever its children orphan stays
  below it), kills everything below it when it stops, and holds no copy of the pipe that
  keeps the launcher alive;
- it sits in its own process group: Ctrl-C in a terminal reaches the driver only, and the
  driver decides to forward it (SIGINT) to the ranks that are running a call;
- SIGINT interrupts the learner's function only; while idle, or while sending a reply (a
  half-written message would desynchronise the pipe), the rank ignores it;
- its stdout and stderr are pipes the driver reads live, line-buffered, so a line printed
  just before a hang or a crash still arrives.

Everything the process group opens stays on the loopback interface: the rendezvous is a
file in a private folder (no TCP store), and gloo's (and NCCL's bootstrap) sockets are bound
to the loopback interface.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import signal
import socket
import sys
import traceback
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_lab.cluster.where import Placement

# Set before anything asks: code on a rank (a learner's cell calling Cluster) reads it.
RANK_ENV = "FSDP_LAB_RANK"


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to join its cluster."""

    rank: int
    world_size: int
    backend: str
    store_path: str  # a FileStore in a folder only this user can read
    timeout: float
    environ: dict[str, str]  # the driver's environment when the cluster started
    plain_results: bool = False  # results as plain data (`protocol.encode_plain`)
    placement: Placement | None = None  # its device (`where.resolve_placement`); None: the CPU


def rank_main(spec: RankSpec, conn: Any, stdout: Any, stderr: Any) -> None:
    """Entry point of a rank process: set up, join the group, serve calls until "stop"."""
    _die_with_parent()
    _keep_descendants_below()
    # The launcher was started once, with the environment of that moment: take the driver's
    # current one, so NCCL_*/TORCH_* variables set in a notebook cell reach the ranks.
    os.environ.clear()
    os.environ.update(spec.environ)
    os.setpgrp()  # terminal signals (Ctrl-C) go to the driver's group, not to ranks
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _stream_output_to(stdout.fileno(), stderr.fileno())
    stdout.close()
    stderr.close()
    os.environ[RANK_ENV] = f"{spec.rank}/{spec.world_size}"
    try:
        _join(spec)
    except BaseException:  # reported, then exit: the driver turns this into a RankError
        _send(conn, ("failed", traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the driver went away
            break
        if message[0] == "stop":
            break
        _, call_id, token, payload = message
        _send(conn, ("reply", call_id, token, _answer(payload, spec.plain_results)))
    import torch.distributed as dist

    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    import psutil

    from fsdp_lab.cluster.launcher import kill_below

    kill_below(psutil.Process())  # nothing this rank started outlives it


def _answer(payload: bytes, plain_results: bool) -> Any:
    """Run one call; every outcome, even Ctrl-C, becomes a `Reply` (the loop lives on)."""
    import cloudpickle

    from fsdp_lab.cluster.protocol import Reply, encode_plain

    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C may stop fn ...
        try:
            result = fn(*args, **kwargs)
        finally:
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # ... and nothing after it
        try:
            blob = encode_plain(result) if plain_results else cloudpickle.dumps(result)
        except Exception as exc:
            why = f"returned a result that cannot be pickled to send back ({exc!r})"
            reply = Reply(ok=False, error=why, traceback=traceback.format_exc())
        else:
            reply = Reply(ok=True, result=blob)
    except BaseException as exc:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        from fsdp_lab.cluster.where import out_of_memory_hint  # a shared GPU: whose memory

        reply = Reply(
            ok=False,
            error=f"raised {exc!r}{out_of_memory_hint(exc)}",
            traceback=traceback.format_exc(),
            interrupted=isinstance(exc, KeyboardInterrupt),
        )
    for stream in (sys.stdout, sys.stderr):  # what it printed arrives before its reply
        with contextlib.suppress(Exception):
            stream.flush()
    return replace(reply, collectives=_collective_counts())


def _join(spec: RankSpec) -> None:
    import torch.distributed as dist

    loopback = _loopback_interface()
    os.environ["GLOO_SOCKET_IFNAME"] = loopback  # gloo listens here, not on the LAN address
    os.environ["NCCL_SOCKET_IFNAME"] = loopback  # NCCL's bootstrap sockets likewise
    if spec.placement is not None:  # its GPU (and, shared, its share of it), or the CPU
        from fsdp_lab.cluster.where import place_this_rank

        place_this_rank(spec.placement, spec.rank, spec.world_size)
    dist.init_process_group(
        spec.backend,
        store=dist.FileStore(spec.store_path, spec.world_size),
        rank=spec.rank,
        world_size=spec.world_size,
        # Only a backstop: the driver's watchdog (`Cluster.timeout`) fires first, so a hang is
        # reported as a hang and the ranks are restarted, not left with a half-failed group.
        timeout=timedelta(seconds=2 * spec.timeout + 30),
    )


def _collective_counts() -> dict[str, int] | None:
    """Collectives (and send/recv) issued so far on every process group of this rank."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        if not dist.is_initialized():
            return {}
        return {
            c10d._world.pg_names[pg]: pg._get_sequence_number_for_group()
            for pg in c10d._world.pg_map
        }
    except Exception:  # unknown: the driver then restarts rather than guess
        return None


def _loopback_interface() -> str:
    """The name of the interface that carries 127.0.0.1 ('lo' on Linux)."""
    try:
        import psutil

        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addrs):
                return name
    except Exception:
        pass
    return "lo"


def _stream_output_to(out_fd: int, err_fd: int) -> None:
    """Point fd 1 and 2 at the driver's pipes; Python's streams flush at every line."""
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    line_buffered = {"buffering": 1, "encoding": "utf-8", "errors": "backslashreplace"}
    sys.stdout = open(1, "w", closefd=False, **line_buffered)  # noqa: SIM115 (lives with the rank)
    sys.stderr = open(2, "w", closefd=False, **line_buffered)  # noqa: SIM115
    sys.stdin = open(os.devnull)  # noqa: SIM115  (a rank has no keyboard)


def _die_with_parent() -> None:
    # Linux only: the kernel SIGKILLs this process when its parent (the launcher) dies.
    parent = os.getppid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)


def _keep_descendants_below() -> None:
    """Orphans of this rank's children come back to it (not to init), to die with it; and the
    launcher's alive pipe, inherited from the fork server, is closed: a child of this rank
    holding it would keep the launcher alive after the driver is gone."""
    from multiprocessing import forkserver

    from fsdp_lab.cluster.launcher import become_subreaper

    become_subreaper()
    alive = getattr(forkserver._forkserver, "_forkserver_alive_fd", None)
    if alive is not None:
        with contextlib.suppress(OSError):
            os.close(alive)
        forkserver._forkserver._forkserver_alive_fd = None


def _send(conn: Any, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message))


def rank_label() -> str | None:
    """'r/N' when this process is a Cluster rank, else None."""
    return os.environ.get(RANK_ENV)
