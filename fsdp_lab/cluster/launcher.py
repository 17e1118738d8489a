"""Where rank processes come from: one fork server per driver, with torch already imported.

Starting a rank used to mean a fresh Python interpreter importing torch (2-3 s each, N of them
on a 2-core laptop). Instead, the first time a driver needs ranks it starts a *fork server*
(`multiprocessing`'s forkserver: a small single-threaded process that imports torch once);
every rank after that is a `fork()` of it, ready in tens of milliseconds. Restarting ranks
after a failure is then nearly free, which the failure policy relies on.

    driver (notebook kernel) ──unix socket──▶ fork server (torch imported, no threads)
                                                 ├── fork ─▶ rank 0
                                                 └── fork ─▶ rank 1 ...

Lifetimes: the fork server exits when the driver process does (it watches a pipe only the
driver holds), and each rank dies with the fork server (PR_SET_PDEATHSIG). Neither is tied to
the *thread* that made a `Cluster`, so a cluster created in a worker thread outlives it.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import sys
from collections.abc import Iterator
from typing import Any

# What the fork server imports once, so that forked ranks need not: torch and the modules a
# rank runs (its loop, the collectives' accounting); and torch._dynamo, which a rank's first
# optimizer step or memory trace imports (about 2 s of CPU on each rank, otherwise).
PRELOAD = [
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


def warm_up() -> None:
    """Start the fork server now (it imports torch in the background), if not running yet.

    The first `Cluster` calls it; a notebook that wants its ranks a fork away by the time it
    creates one may call it earlier. Does nothing inside a rank, inside the fork server, or
    under torchrun (no ranks to fork).
    """
    from multiprocessing import forkserver

    if IN_LAUNCHER_ENV in os.environ or "TORCHELASTIC_RUN_ID" in os.environ:
        return
    if all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR")):
        return
    context()
    os.environ[IN_LAUNCHER_ENV] = "1"  # inherited by the server when it starts, not kept here
    try:
        with _main_module_hidden():
            forkserver.ensure_running()
    finally:
        del os.environ[IN_LAUNCHER_ENV]


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
    with _main_module_hidden():
        proc.start()
    return proc


def pipe() -> tuple[Any, Any]:
    """A duplex pipe whose child end can be handed to a forked rank."""
    return context().Pipe(duplex=True)


def os_pipe_for_child() -> tuple[int, Any]:
    """(read fd kept here, write end as a Connection that pickles into the rank's process)."""
    import multiprocessing.connection as mpc

    r, w = os.pipe()
    os.set_blocking(r, False)
    return r, mpc.Connection(w, readable=False, writable=True)
