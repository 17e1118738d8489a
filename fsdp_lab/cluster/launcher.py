"""Where rank processes come from: one fork server per driver, with torch already imported.

Starting a rank used to mean a fresh Python interpreter importing torch (2-3 s each, N of them
on a 2-core laptop). Instead, the first time a driver needs ranks it starts a *fork server*
(`multiprocessing`'s forkserver: a small single-threaded process that imports torch once);
every rank after that is a `fork()` of it, ready in tens of milliseconds. Restarting ranks
after a failure is then nearly free, which the failure policy relies on.

    driver (notebook kernel) ──unix socket──▶ fork server (torch imported, no threads)
                                                 ├── fork ─▶ rank 0
                                                 └── fork ─▶ rank 1 ...

Lifetimes: the fork server exits when the driver process does, however it ends (it watches a
pipe only the driver holds: each rank closes its inherited copy first thing), and each rank
dies with the fork server (PR_SET_PDEATHSIG). Neither is tied to the *thread* that made a
`Cluster`, so a cluster created in a worker thread outlives it.

[Note: nothing a cluster starts outlives it] Every process a rank starts dies with the rank:
a rank is a child subreaper, so whatever its children leave orphaned stays below it; a rank
that stops kills everything below it (`rank_main`), and a rank the driver stops is killed with
everything below it and its process group (`end_process`). A rank that died on its own leaves
its orphans to the fork server, itself a subreaper (`fork_server`): the driver kills every
child of the server that is no live rank (`reap_orphans`). When the driver is gone, the server
kills everything below it and removes the driver's session folder (where the ranks' stores
are), also after a SIGKILL of the driver, which runs no code of ours.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

# What the fork server imports once, so that forked ranks need not: torch and the modules a
# rank runs (its loop, the collectives' accounting); and torch._dynamo, which a rank's first
# optimizer step or memory trace imports (about 2 s of CPU on each rank, otherwise).
PRELOAD = [
    "fsdp_lab.cluster.fork_server",  # first: the server's own set-up (subreaper, clean exit)
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "cloudpickle",
    "fsdp_lab.cluster.rank_main",
]


def context() -> Any:
    """The multiprocessing context every `Cluster` starts its ranks with."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too, if it has not started yet (else nothing):
    for a caller whose ranks all need them (the checks: every exercise, torch._dynamo, which
    the first optimizer step imports), one import in the server instead of one per rank."""
    from multiprocessing import forkserver

    if server_pid() is None and not getattr(forkserver._forkserver, "_forkserver_alive_fd", None):
        PRELOAD.extend(m for m in modules if m not in PRELOAD)


# Set in the fork server's environment (and so in every rank forked from it): those
# processes import this package too, and must not start a fork server of their own.
IN_LAUNCHER_ENV = "FSDP_LAB_IN_LAUNCHER"
PR_SET_CHILD_SUBREAPER = 36
SESSION_ENV = "FSDP_LAB_SESSION_DIR"  # the folder the fork server removes when it exits

# One fork server per process (multiprocessing's own, module-level), so its bookkeeping is
# per process too: the folder it removes at its exit, and the ranks alive now (a child of the
# server that is none of them is an orphan). The lock keeps a rank being forked in one thread
# from being taken for an orphan in another.
_server: dict[str, Any] = {"session": None, "ranks": {}}
_lock = threading.Lock()


def warm_up() -> None:
    """Start the fork server now (it imports torch in the background), if not running yet.

    The first `Cluster` calls it; a notebook that wants its ranks a fork away by the time it
    creates one may call it earlier. Does nothing inside a rank, inside the fork server, or
    under torchrun (no ranks to fork).
    """
    from multiprocessing import forkserver

    from fsdp_lab.host import under_torchrun

    if IN_LAUNCHER_ENV in os.environ or under_torchrun():
        return
    context()
    starting = server_pid() is None
    if starting:
        _server["session"] = tempfile.mkdtemp(prefix="fsdp_lab-")
    # Inherited by the server when it starts, not kept here.
    os.environ.update({IN_LAUNCHER_ENV: "1", SESSION_ENV: _server["session"] or ""})
    try:
        with _main_module_hidden():
            forkserver.ensure_running()
    finally:
        del os.environ[IN_LAUNCHER_ENV], os.environ[SESSION_ENV]


def session_folder() -> str | None:
    """A private folder (mode 0700) the fork server removes when it exits, however this
    process ends: where clusters keep their stores. None before the server started."""
    folder = _server["session"]
    return folder if folder and os.path.isdir(folder) else None


def server_pid() -> int | None:
    """The fork server's pid (a helper of this process, shared by all its clusters), or None."""
    from multiprocessing import forkserver

    return getattr(forkserver._forkserver, "_forkserver_pid", None)


@contextlib.contextmanager
def _main_module_hidden() -> Iterator[None]:
    """A new rank re-imports the driver's __main__ unless it looks interactive.

    A learner's script without an ``if __name__ == "__main__":`` guard would then start
    clusters recursively. Ranks never need __main__ (cloudpickle ships functions defined
    there by value), so hide its file and spec while ranks start.
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


def start_process(target: Any, args: tuple, name: str) -> Any:
    """Fork one process from the fork server (a `multiprocessing.Process`, already started)."""
    warm_up()
    ctx = context()
    proc = ctx.Process(target=target, args=args, daemon=True, name=name)
    with _lock, _main_module_hidden():
        proc.start()
        _server["ranks"][proc.pid] = proc
    return proc


def end_process(proc: Any) -> None:
    """Kill `proc` (started by `start_process`) and every process below it and in its process
    group (a rank's children stay in its group unless they leave it), then reap it."""

    with _lock:
        _server["ranks"].pop(proc.pid, None)
        if proc.is_alive():
            kill_tree(proc.pid)
        proc.join(5.0)
        if proc.exitcode is not None:  # its pid is free again only after this: the group's
            with contextlib.suppress(OSError):  # members, not a later process, are killed
                os.killpg(proc.pid, signal.SIGKILL)


def reap_orphans() -> None:
    """Kill every process that came back to the fork server orphaned (its rank died) and
    everything below it: each child of the server that is no live rank."""
    import psutil

    pid = server_pid()
    if pid is None:
        return
    with _lock, contextlib.suppress(psutil.Error):
        for child in psutil.Process(pid).children():
            if child.pid not in _server["ranks"]:
                kill_tree(child.pid)


def kill_tree(pid: int) -> None:
    """SIGKILL `pid` and everything below it: the process is stopped first (it starts nothing
    while its tree is killed), then its tree, then itself; returns once they are gone."""
    import psutil

    with contextlib.suppress(psutil.Error):
        top = psutil.Process(pid)
        top.send_signal(signal.SIGSTOP)
        kill_below(top)
        top.kill()
        psutil.wait_procs([top], timeout=5)


def become_subreaper() -> None:
    """Orphans of what this process starts come back to it (not to init), to be killed."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1)


def kill_below(top: Any) -> None:
    """SIGKILL every process below `top` (a psutil.Process), again until none is left, and
    wait until they are gone: each pass stops them first, so none forks a new one between the
    listing and the kill."""
    import psutil

    killed: list[Any] = []
    for _ in range(20):
        try:
            below = top.children(recursive=True)
        except psutil.Error:
            break
        if not below:
            break
        for p in below:
            with contextlib.suppress(psutil.Error):
                p.send_signal(signal.SIGSTOP)
        for p in below:
            with contextlib.suppress(psutil.Error):
                p.kill()
        killed += below
    psutil.wait_procs(killed, timeout=5)


def pipe() -> tuple[Any, Any]:
    """A duplex pipe whose child end can be handed to a forked rank."""
    return context().Pipe(duplex=True)


def os_pipe_for_child() -> tuple[int, Any]:
    """(read fd kept here, write end as a Connection that pickles into the rank's process)."""
    import multiprocessing.connection as mpc

    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, mpc.Connection(w, readable=False, writable=True)
