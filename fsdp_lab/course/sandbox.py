"""Where a submission runs when it is graded: a bubblewrap sandbox, limits, and a wall clock.

`fsdp-lab grade` runs each learner's file (its parsing, its top-level code and its ranks) in a
child process that can harm nothing the grader owns:

- **bubblewrap** (`bwrap`, the sandbox Flatpak uses): the system and Python read-only; as working
  directory a small private tmpfs holding a read-only copy of the submission and nothing else of
  the course; a private /tmp; its own PID namespace (every process it starts dies with it:
  nothing outlives grading); a network namespace with loopback only (gloo's sockets work,
  nothing leaves the machine); of the grader's files only what Python needs to import this
  package and its dependencies (`binds`), never a folder that holds submissions; and — when
  the grader runs as root — an unprivileged user of its own, without capabilities;
- **limits on the sandbox as a whole** (`containment`): its memory — every process, shared
  memory and memfds summed — and its processes and threads, in a control group of its own where
  the grader may make one, else watched by a thread that stops it at the limit; as root, a user
  of its own, so no sandbox's processes count against another's;
- **rlimits** on every process it starts: address space, CPU seconds, file size; and
  the out-of-memory killer's first choice (oom_score_adj 1000), so a runaway submission is
  what dies, not the grader;
- **a wall clock** per file: at the limit the whole sandbox is killed;
- **capped output**: only the last `Limits.output_bytes` of stdout and of stderr are kept, so a
  submission that prints gigabytes costs the grader a megabyte; the reply (file descriptor 3,
  a pipe) is read up to `reply_limit` bytes.

Without bwrap (not installed, or the kernel refuses its namespaces) the child runs with the same
rlimits, in a temporary folder, in a process group of its own that is killed as a whole, and
whatever it leaves running is found and killed afterwards (the grader is a child subreaper, so
orphans come back to it); `sandbox_note()` says which of the two the machine gives.
"""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from fsdp_lab.cluster import launcher
from fsdp_lab.course.containment import ControlGroup, Watchdog, sandbox_uid

INSIDE = "/sandbox"  # the working directory inside the sandbox
REPLY_FD = 3  # the child writes its reply here: a pipe to the grader, nothing on disk
TMPFS = ("--perms", "01777", "--size", str(256 << 20), "--tmpfs")  # a small private folder
# POSIX shared memory of its own: bwrap's /dev/shm is a folder of its /dev (as big as half the
# machine's memory, writable by a grader that is not root), whose pages no process maps.
SHM_TMPFS_BYTES = 64 << 20
# The sandbox's tmpfs mounts: their files are memory, counted against the sandbox's limit.
TMPFS_MOUNTS = ("/tmp", INSIDE, "/dev/shm")
SHM_BYTES = 32 << 20  # System V shared memory the sandbox may hold in all
SHM_LIMITS = (
    f"echo {SHM_BYTES} > /proc/sys/kernel/shmmax && "
    f"echo {SHM_BYTES // 4096} > /proc/sys/kernel/shmall && "
)


@dataclass(frozen=True)
class Limits:
    """What one submission may use.

    Args:
        wall_seconds: the whole run, start-up included; then everything is killed.
        memory_bytes: memory of the whole sandbox (every process, shared memory, memfds); also
            the address space of each process in it.
        file_bytes: largest file a process may write.
        processes: processes and threads of the whole sandbox.
        output_bytes: the last bytes of stdout and of stderr that are kept.
    """

    wall_seconds: float
    memory_bytes: int = 6 << 30
    file_bytes: int = 64 << 20
    processes: int = 512
    output_bytes: int = 1 << 20


@dataclass(frozen=True)
class Run:
    """How a sandboxed run ended: its exit code (None: killed at the wall clock), the kept tails
    of its output, and what it wrote to its reply channel (None: more than allowed)."""

    returncode: int | None
    seconds: float
    stdout: str
    stderr: str
    reply: bytes | None
    limit_hit: str | None = None  # "memory" or "processes": the sandbox was stopped at it

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@functools.cache
def bwrap() -> str | None:
    """The bwrap executable, if it is installed and this kernel lets it make its namespaces."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    probe = [path, *_mounts([]), "--unshare-pid", "--unshare-net", "--", "/bin/true"]
    try:
        ok = subprocess.run(probe, capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        ok = False
    return path if ok else None


def sandbox_note(limits: Limits | None = None) -> str:
    """One line: how submissions are contained on this machine (and with `limits`, what each
    may use in all)."""
    limited = ""
    if limits is not None:
        how = "a control group" if _can_make_cgroups() else "a watchdog"
        limited = (
            f"; each sandbox limited as a whole by {how}: {limits.memory_bytes >> 20} MiB of "
            f"memory, {limits.processes} processes and threads"
        )
    if bwrap() is not None:
        who = "as a user of its own, " if os.geteuid() == 0 else ""
        return (
            f"submissions run in a bubblewrap sandbox ({who}own PID and network namespaces, "
            f"of this machine's files only Python and fsdp_lab, read-only){limited}"
        )
    return (
        "bubblewrap (bwrap) is not available: submissions run unsandboxed, with your user's "
        "rights, in a temporary folder and a process group of their own (killed as a whole), "
        f"under rlimits{limited} — install bubblewrap (apt-get install bubblewrap) to contain them"
    )


@functools.cache
def _can_make_cgroups() -> bool:
    group = ControlGroup.make(f"fsdp_lab_probe_{os.getpid()}", 1 << 30, 64)
    if group is None:
        return False
    group.remove()
    return True


def run_submission(
    submission: Path,
    name: str,
    argv: list[str],
    limits: Limits,
    reply_limit: int,
    binds: list[str] | None = None,
) -> Run:
    """Run `python argv...` with `submission` as `name` (a read-only copy) in its working
    directory; its reply is what it writes to file descriptor 3.

    Args:
        submission: the file, as the grader copied it before any submission ran.
        name: its file name in the working directory.
        argv: the arguments after the Python executable (e.g. ["-m", "module", name]).
        limits: see `Limits`.
        reply_limit: a reply longer than this many bytes is not read (`Run.reply` None).
        binds: the folders the sandbox sees read-only (default: `python_binds()`).
    """
    folder = Path(tempfile.mkdtemp(prefix="fsdp_lab_grade_"))
    try:
        sandboxed = bwrap() is not None
        uid = sandbox_uid() if os.geteuid() == 0 else None
        if sandboxed:
            seen = python_binds() if binds is None else binds
            command = _bwrap_command(submission, name, argv, seen, uid)
        else:  # the best without a sandbox: a folder of its own with a copy
            shutil.copyfile(submission, folder / name)
            command = [sys.executable, *argv]
        t0 = time.monotonic()
        code, out, err, reply, hit = _run_limited(
            command, limits, folder, sandboxed, reply_limit, own_user=sandboxed and uid is not None
        )
        return Run(code, time.monotonic() - t0, out, err, reply, hit)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# -- bubblewrap ------------------------------------------------------------------------------


def _mounts(extra: list[str]) -> list[str]:
    """bwrap's arguments for a root with the system (read-only), /dev, /proc, a private /tmp,
    and each of `extra` read-only at its own path (its parent folders readable)."""
    args = ["--ro-bind", "/usr", "/usr", "--ro-bind", "/etc", "/etc"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{top}"
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    # The private /tmp first: mounted after them, it would hide every bind below /tmp (a
    # checkout or a virtual environment there), and no submission could import anything.
    args += ["--dev", "/dev", "--perms", "01777", "--size", str(SHM_TMPFS_BYTES), "--tmpfs",
             "/dev/shm", "--remount-ro", "/dev", "--proc", "/proc", *TMPFS, "/tmp"]  # fmt: skip
    made: set[str] = set()
    for path in extra:
        # bwrap makes missing parents mode 0700: readable parents, or nobody cannot reach it
        for parent in reversed(Path(path).parents):
            p = str(parent)
            if p != "/" and p not in made and not p.startswith(("/usr", "/etc")):
                made.add(p)
                args += ["--perms", "0755", "--dir", p]
        args += ["--ro-bind", path, path]
    return args


SITE_FOLDERS = ("site-packages", "dist-packages")


def python_binds(avoid: list[Path] = ()) -> list[str]:  # type: ignore[assignment]
    """The folders a sandboxed Python needs, to be bound read-only: its installation (and a
    virtual environment's), the folders of installed packages on its import path, and this
    package's own folder — not the other folders on the import path (a checkout, PYTHONPATH:
    they may hold a course and its submissions), nor the folder grading started in. A ValueError
    if one of them holds a folder of `avoid` (the submissions), which the sandbox must not see.
    """
    import fsdp_lab

    wanted = {sys.base_prefix, sys.prefix, sys.exec_prefix, str(Path(fsdp_lab.__file__).parent)}
    wanted |= {p for p in sys.path if p and os.path.isdir(p) and Path(p).name in SITE_FOLDERS}
    prefixes = [os.path.realpath(p) for p in (sys.base_prefix, sys.prefix, sys.exec_prefix)]
    wanted |= {p for p in sys.path if p and os.path.isdir(p) and _inside(p, prefixes)}
    cwd = os.path.realpath(os.getcwd())
    real = {os.path.realpath(p) for p in wanted}
    paths = sorted(p for p in real if p != cwd and not p.startswith(("/usr/", "/etc/")))
    binds = [p for i, p in enumerate(paths) if not any(p.startswith(q + "/") for q in paths[:i])]
    for folder in avoid:
        where = os.path.realpath(folder)
        for bind in binds:
            if where == bind or where.startswith(bind + "/"):
                raise ValueError(
                    f"{folder} is inside {bind}, which the sandbox must see to run Python and "
                    "fsdp_lab: every submission would see every other. Move the submissions "
                    "out of it (e.g. grade a copy of the folder made elsewhere)"
                )
    return binds


def _inside(path: str, folders: list[str]) -> bool:
    real = os.path.realpath(path)
    return any(real == f or real.startswith(f + "/") for f in folders)


def _bwrap_command(
    submission: Path, name: str, argv: list[str], binds: list[str], uid: int | None
) -> list[str]:
    path = bwrap()
    assert path is not None
    command = [
        path,
        *_mounts(binds),
        *(*TMPFS, INSIDE, "--ro-bind", str(submission), f"{INSIDE}/{name}", "--chdir", INSIDE),
        *("--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"),
        *("--unshare-cgroup-try", "--die-with-parent", "--new-session", "--clearenv"),
    ]
    for key, value in _environment(INSIDE).items():
        command += ["--setenv", key, value]
    command.append("--")
    if uid is not None:  # drop root inside: a user of this sandbox's own, without capabilities
        # First, still root in the sandbox's own IPC namespace: cap System V shared memory,
        # which no rlimit counts (a segment outlives its process until the namespace dies).
        command += ["/bin/sh", "-c", SHM_LIMITS + 'exec "$@"', "sh"]
        command += [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            "--bounding-set=-all",
            "--inh-caps=-all",
        ]
    return [*command, sys.executable, *argv]


def _environment(home: str) -> dict[str, str]:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLCONFIGDIR": f"{home}/.matplotlib",
    }
    for key in ("PYTHONPATH", "LD_LIBRARY_PATH"):  # what the grader's own Python needs
        if os.environ.get(key):
            env[key] = os.environ[key]
    return env


# -- running under limits --------------------------------------------------------------------


def _run_limited(
    command: list[str], limits: Limits, folder: Path, sandboxed: bool, reply_limit: int,
    own_user: bool,
) -> tuple[int | None, str, str, bytes | None, str | None]:  # fmt: skip
    """Start `command` in a session of its own under `limits`; wait up to the wall clock, then
    kill it whole. Returns the exit code (None: killed), the kept output, the reply and the
    limit the sandbox was stopped at (or None). `own_user`: the child runs as a user of its
    own (so the per-user process rlimit counts this sandbox alone)."""
    env = None if sandboxed else {**_environment(str(folder)), "TMPDIR": str(folder)}
    reply_r, reply_w = os.pipe()
    group = ControlGroup.make(folder.name, limits.memory_bytes, limits.processes)

    def apply_limits() -> None:  # in the child, before exec: inherited by all it starts
        if group is not None:
            group.join()
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        cpu = int(limits.wall_seconds) + 1
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if own_user:  # counted per user: the sandbox's own (root itself is exempt)
            resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        with contextlib.suppress(OSError), open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # out of memory: the submission goes first
        os.dup2(reply_w, REPLY_FD)

    before = None
    if not sandboxed:  # the grader's own helpers must exist before: they are not orphans
        launcher.warm_up()
        launcher.become_subreaper()
        before = _children()
    try:
        proc = subprocess.Popen(
            command,
            cwd=folder,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            pass_fds=tuple(sorted({reply_w, REPLY_FD})),
            preexec_fn=apply_limits,
        )
    except BaseException:
        if group is not None:
            group.remove()
        raise
    finally:
        os.close(reply_w)
    watchdog = None
    if group is None:
        watchdog = Watchdog(proc.pid, limits.memory_bytes, limits.processes,
                            kill=lambda: launcher.kill_tree(proc.pid), tmpfs=TMPFS_MOUNTS)  # fmt: skip
    tails = [_Tail(proc.stdout, limits.output_bytes), _Tail(proc.stderr, limits.output_bytes)]
    reply = _Tail(os.fdopen(reply_r, "rb"), reply_limit, keep="first")
    try:
        returncode: int | None = proc.wait(timeout=limits.wall_seconds)
    except subprocess.TimeoutExpired:
        returncode = None
    finally:  # also on Ctrl-C: nothing of the submission is left behind
        if watchdog is not None:
            watchdog.stop()
        _kill(proc, before)
        hit = group.hit() if group is not None else watchdog.hit if watchdog else None
        if group is not None:
            group.remove()
    return returncode, tails[0].text(), tails[1].text(), reply.data(), hit


def _kill(proc: subprocess.Popen, before: set[int] | None) -> None:
    """The child's session, then (without a sandbox) any orphan of it that came back to this
    process: a child of ours that was not there before the submission started. `before` is
    None in a sandbox, whose PID namespace dies with it — and this process's own helpers (the
    grader's reference ranks' fork server) must never be taken for orphans."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    if before is None:
        return
    for pid in _children() - before:  # orphans reparented here (we are a subreaper)
        with contextlib.suppress(psutil.Error, ChildProcessError):
            for p in [*psutil.Process(pid).children(recursive=True), psutil.Process(pid)]:
                p.kill()
            os.waitpid(pid, 0)


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children()}


class _Tail:
    """Reads a pipe to its end on a thread, keeping its last (or first) `limit` bytes."""

    def __init__(self, pipe: Any, limit: int, keep: str = "last") -> None:
        self.limit, self.keep, self.total = limit, keep, 0
        self.chunks: deque[bytes] = deque()
        self.kept = 0
        self.thread = threading.Thread(target=self._drain, args=(pipe,), daemon=True)
        self.thread.start()

    def _drain(self, pipe: Any) -> None:
        with contextlib.suppress(OSError, ValueError), pipe:
            while chunk := os.read(pipe.fileno(), 1 << 16):
                self.total += len(chunk)
                if self.keep == "first" and self.kept >= self.limit:
                    continue  # read on (the writer must not block), keep nothing more
                self.chunks.append(chunk)
                self.kept += len(chunk)
                while self.keep == "last" and self.kept - len(self.chunks[0]) >= self.limit:
                    self.kept -= len(self.chunks.popleft())

    def data(self) -> bytes | None:
        """All that was written, or None if it was longer than the limit (keep="first")."""
        self.thread.join(5.0)
        return b"".join(self.chunks) if self.total <= self.limit else None

    def text(self) -> str:
        """The last `limit` bytes as text, with a line saying how much came before."""
        self.thread.join(5.0)
        data = b"".join(self.chunks)[-self.limit :]
        dropped = self.total - len(data)
        head = f"[... {dropped} earlier bytes not kept ...]\n" if dropped else ""
        return head + data.decode("utf-8", errors="replace")
