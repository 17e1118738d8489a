"""The fork server's own set-up: imported first in the server (`launcher.PRELOAD`), and there
only (ranks are forked after it, and exit without running exit handlers).

What must hold even when the driver dies without running a line of ours (SIGKILL, the
out-of-memory killer) is done here, in the process that outlives it:

- orphans come back here: the server is a child subreaper, so a process a rank started and
  left behind when the rank died becomes the server's child — where `launcher.reap_orphans`
  finds it — and not init's, where nobody would;
- nothing outlives the server: it exits only when the driver is gone (its alive pipe closes);
  then it kills every process still below it and removes the driver's session folder, where
  the ranks' stores are.
"""

from __future__ import annotations

import atexit
import os
import shutil
import warnings


def _set_up(session: str) -> None:
    from fsdp_lab.cluster.launcher import become_subreaper

    become_subreaper()
    # The server reaps the orphans that come back to it, and would warn of each.
    warnings.filterwarnings("ignore", message="forkserver: waitpid returned unexpected pid")
    atexit.register(_end, session)


def _end(session: str) -> None:
    from multiprocessing import forkserver

    import psutil

    from fsdp_lab.cluster.launcher import kill_below

    kill_below(psutil.Process())
    # multiprocessing's own folder of the server's socket (pymp-...), which the driver
    # removes at a clean exit only.
    address = getattr(forkserver._forkserver, "_forkserver_address", None)
    folders = [session, os.path.dirname(address) if isinstance(address, str) else ""]
    for folder in folders:
        if folder and (folder == session or os.path.basename(folder).startswith("pymp-")):
            shutil.rmtree(folder, ignore_errors=True)


def _in_the_server() -> bool:
    from fsdp_lab.cluster.launcher import IN_LAUNCHER_ENV

    main = __import__("sys").modules.get("__main__")
    return os.environ.get(IN_LAUNCHER_ENV) == "1" and getattr(main, "__file__", None) is None


if _in_the_server():
    from fsdp_lab.cluster.launcher import SESSION_ENV

    _set_up(os.environ.get(SESSION_ENV, ""))
