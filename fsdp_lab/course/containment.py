"""Limits on a sandbox as a whole: memory and processes summed over everything it starts.

An rlimit is per process (address space) or per user (processes), so a submission that forks
four children, each under the address-space limit, held four times the memory it was given, and
every sandbox ran as one user, so one submission's threads used up the process limit of a
concurrent sandbox (whose students then saw "no result"). Two ways to limit the sandbox itself:

- **a control group** (the kernel's own accounting, what systemd and container runtimes use):
  where the grader runs as root and may make one below its own — cgroup v2's `memory.max` and
  `pids.max`, or v1's `memory.limit_in_bytes` and `pids.max` — the child joins it before it
  runs anything; anonymous memory, shared memory and memfd pages are all charged to it, and the
  kernel's out-of-memory killer stops the sandbox at its limit;
- **a watchdog** otherwise: a thread sums the proportional memory (PSS) of the sandbox's
  processes, the memfds they hold and the files in the sandbox's own tmpfs mounts (its /tmp,
  working folder and /dev/shm: pages no process maps), and their threads, every
  `WATCH_SECONDS`, and kills the whole sandbox past a limit. Coarser (between two looks a
  submission can overshoot), but it holds the total where no cgroup can be made.

As root, each sandbox also runs as a user of its own (`sandbox_uid`), so the per-user process
rlimit counts that sandbox alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

WATCH_SECONDS = 0.05
UID_BASE, UID_SPAN = 200_000, 1 << 20  # users no account has: one per sandbox (as root)
NOBODY = 65534


def sandbox_uid() -> int:
    """A user id for one sandbox, mapped in this user namespace; `nobody` where none is."""
    uid = UID_BASE + secrets.randbelow(UID_SPAN)
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/uid_map").read_text().splitlines():
            inside, _, count = (int(x) for x in line.split())
            if inside <= uid < inside + count:
                return uid
    return NOBODY


# -- control groups --------------------------------------------------------------------------


def _own_cgroups() -> dict[str, tuple[str, Path]]:
    """{"memory": (version, folder), "pids": ...}: the hierarchy holding each controller, at
    this process's own cgroup in it."""
    own: dict[str, str] = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, names, path = line.split(":", 2)
        for name in names.split(",") if names else ["v2"]:
            own[name] = path.lstrip("/")
    found: dict[str, tuple[str, Path]] = {}
    for line in Path("/proc/mounts").read_text().splitlines():
        _, mount, kind, options = line.split()[:4]
        if kind == "cgroup2" and "v2" in own:
            folder = Path(mount, own["v2"])
            with contextlib.suppress(OSError):
                for name in (folder / "cgroup.controllers").read_text().split():
                    found.setdefault(name, ("v2", folder))
        elif kind == "cgroup":
            for name in options.split(","):
                if name in ("memory", "pids") and name in own:
                    found.setdefault(name, ("v1", Path(mount, own[name])))
    return {k: v for k, v in found.items() if k in ("memory", "pids")}


@dataclass
class ControlGroup:
    """The sandbox's own cgroup(s): made before the child starts, joined by it, removed after."""

    folders: dict[str, tuple[str, Path]]
    made: list[Path] = field(default_factory=list)

    @classmethod
    def make(cls, name: str, memory_bytes: int, processes: int) -> ControlGroup | None:
        """A cgroup with both limits, or None where this process may not make one."""
        if os.geteuid() != 0:
            return None
        try:
            parents = _own_cgroups()
        except OSError:
            return None
        if set(parents) != {"memory", "pids"}:
            return None
        group = cls({})
        try:
            for controller, (version, parent) in parents.items():
                folder = parent / name
                if folder not in group.made:
                    if version == "v2":
                        (parent / "cgroup.subtree_control").write_text(f"+{controller}")
                    folder.mkdir()
                    group.made.append(folder)
                group.folders[controller] = (version, folder)
            group._limit(memory_bytes, processes)
        except OSError:
            group.remove()
            return None
        return group

    def _limit(self, memory_bytes: int, processes: int) -> None:
        version, folder = self.folders["memory"]
        if version == "v2":
            (folder / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):  # no swapping past the limit either
                (folder / "memory.swap.max").write_text("0")
        else:
            (folder / "memory.limit_in_bytes").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (folder / "memory.memsw.limit_in_bytes").write_text(str(memory_bytes))
        (self.folders["pids"][1] / "pids.max").write_text(str(processes))

    def join(self) -> None:
        """Move the calling process in (the child, before exec: all it starts stays in)."""
        for folder in dict.fromkeys(f for _, f in self.folders.values()):
            (folder / "cgroup.procs").write_text(str(os.getpid()))

    def hit(self) -> str | None:
        """Which limit the sandbox reached, if one: "memory" (the kernel killed a process at
        it) or "processes" (a fork was refused)."""
        version, folder = self.folders["memory"]
        events = "memory.events" if version == "v2" else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in (folder / events).read_text().splitlines():
                key, value = line.split()
                if key == "oom_kill" and int(value) > 0:
                    return "memory"
        with contextlib.suppress(OSError, ValueError):
            for line in (self.folders["pids"][1] / "pids.events").read_text().splitlines():
                if line.split()[0] == "max" and int(line.split()[1]) > 0:
                    return "processes"
        return None

    def remove(self) -> None:
        """Kill what is left inside, then remove the folders."""
        for folder in reversed(self.made):
            for _ in range(100):
                try:
                    pids = (folder / "cgroup.procs").read_text().split()
                except OSError:
                    break
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
                try:
                    folder.rmdir()
                    break
                except OSError:
                    time.sleep(0.02)


# -- the watchdog ----------------------------------------------------------------------------


def _memory_of(process: psutil.Process, memfds: dict[tuple[int, int], int]) -> int:
    """A process's proportional share of the memory it maps (PSS); the memfds it holds are
    added to `memfds` (by device and inode, each counted once)."""
    pss = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path(f"/proc/{process.pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) * 1024
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{process.pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{process.pid}/fd/{fd}").startswith("/memfd:"):
                    info = os.stat(f"/proc/{process.pid}/fd/{fd}")
                    memfds[(info.st_dev, info.st_ino)] = info.st_blocks * 512
    return pss


def _device(path: str) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None


class Watchdog:
    """Sums the memory and threads of `root` and everything below it, every `WATCH_SECONDS`;
    past a limit it calls `kill` once and remembers which limit it was."""

    def __init__(
        self, root: int, memory_bytes: int, processes: int, kill: Callable[[], None],
        tmpfs: tuple[str, ...] = (),
    ) -> None:  # fmt: skip
        self.root, self.memory_bytes, self.processes, self.kill = (
            root,
            memory_bytes,
            processes,
            kill,
        )
        self.tmpfs = tmpfs  # the sandbox's own tmpfs mounts (paths inside it)
        # The grader's own filesystems at those paths: never the sandbox's (without bwrap, its
        # processes see the machine's /tmp, which is not theirs to be charged for).
        self._hosts = {_device(p) for p in ("/", *tmpfs)} - {None}
        self.hit: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="sandbox-watchdog")
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_SECONDS):
            try:
                top = psutil.Process(self.root)
                tree = [top, *top.children(recursive=True)]
            except psutil.Error:
                return
            memfds: dict[tuple[int, int], int] = {}
            memory = threads = 0
            for process in tree:
                memory += _memory_of(process, memfds)
                with contextlib.suppress(psutil.Error):
                    threads += process.num_threads()
            memory += sum(memfds.values()) + self._tmpfs_bytes(tree)
            if memory > self.memory_bytes or threads > self.processes:
                self.hit = "memory" if memory > self.memory_bytes else "processes"
                self.kill()
                return

    def _tmpfs_bytes(self, tree: list[psutil.Process]) -> int:
        """Bytes in use in the sandbox's tmpfs mounts, each counted once (seen through
        /proc/<pid>/root of a process inside)."""
        used: dict[int, int] = {}
        for process in tree:
            for mount in self.tmpfs:
                path = f"/proc/{process.pid}/root{mount}"
                device = _device(path)
                if device is None or device in self._hosts or device in used:
                    continue
                with contextlib.suppress(OSError):
                    fs = os.statvfs(path)
                    used[device] = (fs.f_blocks - fs.f_bfree) * fs.f_frsize
        return sum(used.values())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
