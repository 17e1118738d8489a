"""`Cluster`: N live rank processes a notebook talks to, one `run` call at a time.

(Over 400 lines on purpose: start, run, and the failure policy are one state machine — a
rank dying, a timeout, Ctrl-C, a restart — and read best in one file, top to bottom.)

Real distributed training runs one process per device. A notebook is a single process, so
`Cluster` starts N rank processes (forked from `launcher`'s fork server), joins them into one
process group, and keeps them alive. Each `cluster.run(fn, ...)` ships `fn` by value
(cloudpickle, so a function written in a notebook cell works), runs it on every rank at once
and returns the results in rank order.

    notebook ──call #7──▶ rank 0 ─┐
             ──call #7──▶ rank 1 ─┼─ process group (gloo on CPU, NCCL on GPUs), loopback only
             ◀─reply #7── ...     ┘  stdout/stderr of every rank read live, as [rank r] lines

Failure policy (what a learner sees; `RankError` names the rank):
- fn raises on some ranks: RankError for the first that failed, its traceback, and one line per
  other failed rank. If every rank answered, the same ranks serve the next run (state kept).
- a rank dies (exit, signal, OOM killer) during a call, or ranks do not answer within
  `timeout` (a hung collective): RankError naming the rank that died first, with its exit
  code or signal, peers' errors listed after. All ranks are stopped; the next run() starts
  fresh ones and says so in one line (state kept on the ranks is lost).
- a rank died *between* calls: the next run() finds it before sending anything and raises
  RankError the same way; the run after it starts fresh ranks.
- Ctrl-C / the notebook's stop button during run(): the ranks still running the call get
  SIGINT too. If they all stop within a few seconds with their process groups in step (the
  same number of collectives issued on every group), they are kept; otherwise all ranks are
  stopped and the next run() starts fresh ones. The KeyboardInterrupt's message says which.
- every call and reply carries an id, so an abandoned call's late reply is dropped: run()
  never returns another call's result.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import multiprocessing.connection as mpc
import os
import pickle
import re
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import psutil

from fsdp_lab import endings
from fsdp_lab.cluster import launcher
from fsdp_lab.cluster.output import RankOutput
from fsdp_lab.cluster.protocol import (
    Channel,
    ChannelBroken,
    RankError,
    Reply,
    decode_plain,
    read_message,
)
from fsdp_lab.cluster.rank_main import RankSpec, rank_label, rank_main
from fsdp_lab.cluster.where import resolve_placement
from fsdp_lab.cores import OversubscribedWarning, available_cores, too_many_ranks
from fsdp_lab.host import check_ranks_fit

# After one rank failed, how long the others get to answer before they count as stuck (a rank
# in a collective with a dead peer would otherwise hold the notebook for the whole timeout).
FAILURE_GRACE = 10.0
# After Ctrl-C, how long the ranks get to stop the interrupted call before they are restarted.
INTERRUPT_GRACE = 5.0


@dataclass
class _Rank:
    index: int
    proc: Any  # multiprocessing.Process
    channel: Channel  # the driver's end of the call pipe
    output: RankOutput


def check_timeout(name: str, value: Any) -> float:
    """A finite number of seconds > 0, or a ValueError naming `name`."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0 (e.g. 60)")
    return float(value)


def _check_world_size(world_size: Any) -> int:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1 (e.g. 2 or 4)")
    return world_size


class Cluster:
    """N live rank processes in one process group.

    Args:
        world_size: number of ranks (int >= 1).
        backend: "auto" (NCCL if `world_size` GPUs are visible, else gloo), "gloo" or "nccl".
        device: "auto" (as `backend` chooses), "cpu" (the CPU lab on a GPU machine) or "cuda"
            (with fewer GPUs than ranks, the ranks share them over gloo); default: the
            environment's FSDP_LAB_DEVICE, else "auto" (`where.resolve_placement`).
        timeout: seconds a `run` may take before hung ranks are reported (and, doubled, the
            process group's own collective timeout).
        start_timeout: seconds allowed for starting the ranks.
        verbose: print a line when ranks start or restart.
        failure_grace: after one rank failed, seconds the others get to answer before they
            count as stuck (a check, whose ranks do little, needs less than a lab).
        plain_results: accept only plain data as results (numbers, strings, lists, tuples,
            dicts, tensors), read without running any code the ranks sent: for ranks that run
            code the driver does not trust.
        timed: False where nothing these ranks run is timed (a check compares values): more
            ranks than cores then needs no note about times measuring contention.
    """

    def __init__(
        self,
        world_size: int,
        backend: str = "auto",
        timeout: float = 120.0,
        *,
        start_timeout: float = 180.0,
        verbose: bool = True,
        failure_grace: float = FAILURE_GRACE,
        plain_results: bool = False,
        device: str | None = None,
        timed: bool = True,
    ) -> None:
        label = rank_label()
        if label is not None:
            raise RuntimeError(
                f"Cluster() was called inside rank {label} of a running cluster: ranks cannot "
                "start ranks of their own. Create the Cluster in the notebook (or script) and "
                "send work to it with cluster.run(fn); inside fn, fsdp_lab.rank(), "
                "world_size() and device() say where it runs."
            )
        self.world_size = _check_world_size(world_size)
        check_ranks_fit(world_size)  # before forking hundreds of ranks a host cannot hold
        self.timeout = check_timeout("timeout", timeout)
        self.start_timeout = check_timeout("start_timeout", start_timeout)
        self.placement = resolve_placement(backend, world_size, device)
        self.backend = self.placement.backend
        self.verbose = verbose
        self.failure_grace = check_timeout("failure_grace", failure_grace)
        self.plain_results = bool(plain_results)
        self.start_seconds: float | None = None
        self._ranks: list[_Rank] = []
        self._calls = itertools.count(1)
        self._closed = False
        self._finalizer: weakref.finalize | None = None
        cores = available_cores()
        crowded = timed and too_many_ranks(world_size, cores, f"world_size={cores}")
        if crowded and _in_a_notebook():  # a note for the learner, not a red stderr box
            print(f"note: {crowded}.")
        elif crowded:
            warnings.warn(OversubscribedWarning(f"fsdp_lab: {crowded}"), stacklevel=2)
        self._start()

    # -- lifecycle ----------------------------------------------------------------------------

    def _start(self) -> None:
        t0 = time.perf_counter()
        # The rendezvous is a file in a folder only this user can open (mkdtemp: mode 0700):
        # no TCP store, so nothing listens on the network.
        launcher.warm_up()
        folder = tempfile.mkdtemp(prefix="cluster-", dir=launcher.session_folder())
        environ = dict(os.environ)
        ranks: list[_Rank] = []
        self._ranks = ranks
        self._finalizer = weakref.finalize(self, _stop_ranks, ranks, folder)
        try:
            for r in range(self.world_size):
                spec = RankSpec(
                    r,
                    self.world_size,
                    self.backend,
                    f"{folder}/store",
                    self.timeout,
                    environ,
                    self.plain_results,
                    self.placement,
                )
                ours, theirs = launcher.pipe()
                out_fd, out_w = launcher.os_pipe_for_child()
                err_fd, err_w = launcher.os_pipe_for_child()
                proc = launcher.start_process(
                    rank_main, (spec, theirs, out_w, err_w), name=f"fsdp_lab-rank{r}"
                )
                for child_end in (theirs, out_w, err_w):
                    child_end.close()
                ranks.append(_Rank(r, proc, Channel(ours), RankOutput(r, out_fd, err_fd)))
            call = _Call(ranks, 0, "start", self.plain_results)
            call.wait(time.monotonic() + self.start_timeout)
        except BaseException:  # Ctrl-C while starting, or a failed fork: leave nothing behind
            self._teardown()
            raise
        if call.failed:
            error = self._start_error(call)  # before teardown: it reads the exit codes
            self._teardown()
            raise error
        self.start_seconds = time.perf_counter() - t0
        if self.verbose:
            print(
                f"fsdp_lab: {self.world_size} rank(s) up on {self.backend} "
                f"in {self.start_seconds:.1f} s (pids {', '.join(str(p) for p in self.pids)}): "
                f"{self.placement.why}"
            )

    def _start_error(self, call: _Call) -> RankError:
        if call.broken:
            r, why = next(iter(call.broken.items()))
            return RankError(
                r, f"its channel carried what no rank of ours sends while starting: {why}"
            )
        if call.failures:
            r = call.failures[0]
            return RankError(r, "failed to join the process group", call.replies[r].traceback)
        if call.deaths:
            r = call.deaths[0]
            code = self._ranks[r].proc.exitcode
            return RankError(r, f"died while starting ({how_it_ended(code)})", exitcode=code)
        return RankError(
            min(call.pending),
            f"ranks {sorted(call.pending)} did not start within "
            f"start_timeout={self.start_timeout:g} s (a busy machine, or many ranks on few "
            "cores). Fix: Cluster(..., start_timeout=<more seconds>)",
        )

    def _teardown(self, grace: float = 5.0) -> None:
        if grace == 0:  # broken ranks need no goodbye: kill now, then clean up
            for rk in self._ranks:
                with contextlib.suppress(Exception):
                    rk.proc.kill()
        if self._finalizer is not None:
            self._finalizer()  # stops and joins every rank exactly once
        self._ranks = []

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
        return [rk.proc.pid for rk in self._ranks]

    # -- running ------------------------------------------------------------------------------

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if self._closed:
            raise RuntimeError("this Cluster is closed; create a new one: Cluster(world_size)")
        if not callable(fn):
            raise TypeError(f"run() needs a function, got {type(fn).__name__}: {fn!r}")
        what = getattr(fn, "__name__", "fn")
        try:
            payload = cloudpickle.dumps((fn, args, kwargs))
        except Exception as exc:
            name = getattr(fn, "__qualname__", repr(fn))
            raise TypeError(
                f"cannot send {name!r} (or its arguments) to the ranks: {exc}. Everything "
                "a rank runs is pickled; pass plain data, tensors and functions, not open "
                "files, locks, generators or live processes."
            ) from exc
        self._ensure_live_ranks()
        call = _Call(self._ranks, next(self._calls), what, self.plain_results)
        try:
            deadline = time.monotonic() + self.timeout
            call.send(payload, deadline)
            call.wait(deadline, grace=self.failure_grace)
        except KeyboardInterrupt:
            # The learner sees one line, at the end of the KeyboardInterrupt it pressed for.
            raise KeyboardInterrupt(self._after_interrupt(call)) from None
        return self._finish(call)

    def _ensure_live_ranks(self) -> None:
        """Fresh ranks after a failure; a rank that died since the last call is reported."""
        if not self._ranks:
            if self.verbose:
                print(
                    f"fsdp_lab: starting {self.world_size} fresh rank(s) after the last failure "
                    "(state kept on the old ranks is gone)"
                )
            self._start()
            return
        for rk in self._ranks:  # between calls a rank says nothing: bytes now are strays
            rk.channel.read()
            if rk.channel.buffer or rk.channel.ended and not _has_died(rk):
                self._teardown(grace=0)
                raise RankError(
                    rk.index,
                    f"its channel carried {len(rk.channel.buffer)} bytes between calls, which "
                    "is not a well-formed reply to any call (a rank's own code writing to it, "
                    "or a process it started). All ranks were stopped; the next run() starts "
                    "fresh ones.",
                )
        dead = [rk for rk in self._ranks if _has_died(rk)]
        if not dead:
            return
        for rk in self._ranks:
            rk.output.drain()
        first, *later = dead
        code = first.proc.exitcode
        self._teardown(grace=0)
        raise RankError(
            first.index,
            f"the rank process died ({how_it_ended(code)}) since the last run(), before this call was "
            "sent." + _death_hint(code) + " All ranks were stopped; the next run() starts "
            "fresh ones.",
            exitcode=code,
            others=[f"rank {rk.index} died too ({how_it_ended(rk.proc.exitcode)})" for rk in later],
        )

    def _finish(self, call: _Call) -> list[Any]:
        """The results in rank order, or one RankError that says what happened to whom."""
        if not call.failed:
            return [call.results[r] for r in range(self.world_size)]
        broken = bool(call.deaths or call.pending or call.broken)
        codes = {r: self._ranks[r].proc.exitcode for r in call.deaths}
        halves = {r: len(self._ranks[r].channel.buffer) for r in sorted(call.pending)}
        if broken:
            self._teardown(grace=0)
        after = (
            " All ranks were stopped; the next run() starts fresh ones."
            if broken
            else " The other ranks answered; the cluster is still usable."
        )
        others = [f"rank {r} {call.replies[r].error}" for r in call.failures]
        if call.pending:
            others.append(
                f"ranks {sorted(call.pending)} did not answer (most likely waiting in a "
                "collective for a rank that failed)"
            )
        if call.deaths:
            r, *later = call.deaths
            others = [f"rank {d} died too ({how_it_ended(codes[d])})" for d in later] + others
            raise RankError(
                r,
                f"the rank process died ({how_it_ended(codes[r])}) while running {call.what}."
                + _death_hint(codes[r])
                + after,
                exitcode=codes[r],
                others=others,
            )
        if call.broken:
            r, why = next(iter(call.broken.items()))
            others = [f"rank {b} {w}" for b, w in list(call.broken.items())[1:]] + others
            raise RankError(
                r, f"its channel carried what is not a well-formed reply to {call.what}: {why}"
                f" (a rank's own code writing to it, or a process it started).{after}",
                others=others,
            )  # fmt: skip
        if call.failures:
            r = call.failures[0]
            reply = call.replies[r]
            raise RankError(
                r, f"{call.what} {reply.error}.{after}", reply.traceback, others=others[1:]
            )
        stuck = sorted(call.pending)
        if any(halves.values()):  # past the deadline with half a message
            r = next(r for r, n in halves.items() if n)
            raise RankError(
                r, f"its channel carried what is not a well-formed reply to {call.what}: "
                f"{halves[r]} bytes of a message that never completed "
                f"within timeout={self.timeout:g} s (a rank's own code writing to it, or a "
                f"process it started).{after}",
            )  # fmt: skip
        raise RankError(
            stuck[0],
            f"ranks {stuck} did not finish {call.what} within timeout={self.timeout:g} s — most "
            "often a collective that not every rank called, or called with different sizes, or "
            f"very slow work (raise Cluster(timeout=...)).{after}",
        )

    def _after_interrupt(self, call: _Call) -> str:
        """Ctrl-C in the driver: stop the call on the ranks too, keep them or restart them, and
        say which."""
        if call.sent_all:
            deadline = time.monotonic() + INTERRUPT_GRACE
            with contextlib.suppress(KeyboardInterrupt):  # pressed again: stop waiting
                while call.pending and time.monotonic() < deadline:
                    # Again every half second: a rank that had not yet begun the call when
                    # the first SIGINT came ignored it (idle ranks ignore Ctrl-C).
                    for r in call.pending:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(self._ranks[r].proc.pid, signal.SIGINT)
                    call.wait(min(deadline, time.monotonic() + 0.5), grace=INTERRUPT_GRACE)
        if call.sent_all and not (call.pending or call.deaths or call.broken) and call.in_step():
            return (
                f"fsdp_lab: interrupted {call.what}; every rank stopped it and is kept, its "
                "state intact (process groups in step). The cluster is ready for the next run()."
            )
        why = (
            f"rank(s) {sorted(call.broken)} broke their channel"
            if call.broken
            else f"rank(s) {sorted(call.pending)} could not stop (inside a collective or native code)"
            if call.pending
            else "the ranks stopped at different collectives"
            if call.sent_all
            else "the call was only half sent"
        )
        self._teardown(grace=0)
        return (
            f"fsdp_lab: interrupted {call.what}; {why}, so all ranks were stopped. The next "
            "run() starts fresh ones (state kept on the ranks is lost)."
        )


class _Call:
    """One call in flight: sent to every rank, answered (or not) rank by rank."""

    def __init__(self, ranks: list[_Rank], call_id: int, what: str, plain: bool) -> None:
        self.ranks, self.call_id, self.what, self.plain = ranks, call_id, what, plain
        # Sent with the call and echoed by its reply: a reply to a call id guessed ahead (a
        # thread a rank left running) is not well-formed.
        self.token = secrets.token_hex(8)
        self.pending = set(range(len(ranks)))
        self.replies: dict[int, Reply] = {}
        self.results: dict[int, Any] = {}
        self.failures: list[int] = []  # ranks whose reply is an error, in arrival order
        self.deaths: list[int] = []  # ranks that died, in the order noticed
        self.broken: dict[int, str] = {}  # ranks whose channel carried what no reply is
        self.sent_all = False

    @property
    def failed(self) -> bool:
        return bool(self.failures or self.deaths or self.pending or self.broken)

    def send(self, payload: bytes, deadline: float) -> None:
        message = pickle.dumps(("call", self.call_id, self.token, payload))
        with _sigint_held():  # every rank gets the call, or (Ctrl-C before) none does
            for r, rk in enumerate(self.ranks):
                try:
                    rk.channel.send(message, deadline)
                except TimeoutError:
                    self._broke(r, "did not take the call (it stopped reading its channel)")
                except OSError:  # a rank that died just now: its sentinel says how, in wait()
                    pass
            self.sent_all = True

    def in_step(self) -> bool:
        """Every rank issued the same number of collectives on every group it belongs to."""
        counts: dict[str, set[int]] = {}
        for reply in self.replies.values():
            if reply.collectives is None:
                return False
            for group, n in reply.collectives.items():
                counts.setdefault(group, set()).add(n)
        return all(len(seen) == 1 for seen in counts.values())

    def wait(self, deadline: float, grace: float = FAILURE_GRACE) -> None:
        """Take replies, output and deaths as they come, until all answered or the deadline."""
        grace_deadline: float | None = None
        while self.pending:
            if (self.failures or self.deaths or self.broken) and grace_deadline is None:
                grace_deadline = time.monotonic() + grace
            limit = deadline if grace_deadline is None else min(deadline, grace_deadline)
            outputs = [fd for rk in self.ranks for fd in rk.output.fds]
            watched = [self.ranks[r].channel for r in self.pending]
            watched += [self.ranks[r].proc.sentinel for r in self.pending]
            ready = mpc.wait(watched + outputs, timeout=max(0.0, limit - time.monotonic()))
            if not ready:
                break
            for rk in self.ranks:
                for fd in [fd for fd in rk.output.fds if fd in ready]:
                    rk.output.read(fd)
            for r in sorted(self.pending):
                rk = self.ranks[r]
                if rk.channel in ready or rk.proc.sentinel in ready:
                    self._take(r)
                if r in self.pending and (rk.proc.sentinel in ready or rk.channel.ended):
                    self._died(r)
        for rk in self.ranks:
            rk.output.drain()

    def _take(self, r: int) -> None:
        """Every whole message rank `r`'s channel holds now (its reply, late replies to calls
        given up on); anything else breaks the channel."""
        channel = self.ranks[r].channel
        try:
            with _sigint_held():
                channel.read()
            while r in self.pending and (data := channel.message()) is not None:
                self._receive(r, data)
        except ChannelBroken as exc:
            self._broke(r, str(exc))

    def _receive(self, r: int, data: bytes) -> None:
        try:
            message = read_message(data)
        except pickle.UnpicklingError as exc:  # not a message a rank of ours sends
            message = ("reply", self.call_id, self.token, Reply(ok=False, error=f"sent {exc}"))
        except Exception as exc:  # not a pickle at all
            raise ChannelBroken(f"{len(data)} bytes that are no message ({exc!r:.100})") from None
        kind = message[0] if isinstance(message, tuple) and message else None
        starting = self.call_id == 0
        if kind == "reply" and len(message) == 4 and isinstance(message[3], Reply):
            if isinstance(message[1], int) and message[1] < self.call_id and not starting:
                return  # the late answer to a call that was given up on: dropped, never returned
            if message[1:3] != (self.call_id, self.token):  # a reply no rank was asked for
                raise ChannelBroken(f"a reply to call {message[1]!r:.20} that is not the call "
                                    f"in flight ({self.call_id}) or not its token")  # fmt: skip
            reply = message[3]
        elif starting and kind == "ready":
            reply = Reply(ok=True, collectives={})
        elif starting and kind == "failed":
            tb = message[1] if len(message) > 1 and isinstance(message[1], str) else ""
            reply = Reply(ok=False, error="failed to join the process group", traceback=tb)
        else:
            raise ChannelBroken(f"a message of kind {kind!r:.40}")
        if reply.ok and kind == "reply":
            try:
                blob = reply.result
                self.results[r] = decode_plain(blob) if self.plain else cloudpickle.loads(blob)
            except Exception as exc:
                reply = Reply(
                    ok=False, error=_unreadable(exc, self.plain), collectives=reply.collectives
                )
        self.replies[r] = reply
        self.pending.discard(r)
        if not reply.ok:
            self.failures.append(r)

    def _broke(self, r: int, why: str) -> None:
        self.pending.discard(r)
        self.broken.setdefault(r, why)

    def _died(self, r: int) -> None:
        rk = self.ranks[r]
        rk.proc.join(1.0)
        rk.output.drain()
        self.pending.discard(r)
        self.deaths.append(r)


def _unreadable(exc: Exception, plain: bool) -> str:
    """Why a rank's result could not be read here, and what to return instead."""
    if plain:
        named = re.search(r"Unsupported global: GLOBAL (\S+)", str(exc))
        what = f" (it holds a {named.group(1)})" if named else ""
        return (
            f"returned a result that is not plain data{what}: this Cluster takes numbers, "
            "strings, lists, tuples, dicts and tensors only"
        )
    return (
        f"returned a result this process cannot unpickle ({exc!r:.300}): return plain data "
        "(numbers, strings, lists, dicts, tensors), or define its class in the notebook or an "
        "importable module"
    )


def _in_a_notebook() -> bool:
    """This process is a Jupyter kernel (where a warning shows as an error-red box)."""
    shell = sys.modules.get("IPython")
    ipython = shell.get_ipython() if shell is not None else None
    return ipython is not None and hasattr(ipython, "kernel")


def _has_died(rk: _Rank) -> bool:
    """Dead, or a zombie whose exit the fork server has not reported yet (then wait for it)."""
    if not rk.proc.is_alive():
        return True
    gone = _state_of(rk.proc.pid) in ("Z", "X", None)
    if gone:
        rk.proc.join(2.0)  # the exit code comes through the fork server
    return gone


def _state_of(pid: int) -> str | None:
    """The process state letter ('R', 'S', 'Z' zombie, ...), None if there is no such process.

    /proc read directly: psutil.Process() costs ~0.1 ms, and this runs for every rank on
    every call."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (not Linux): ask psutil
        try:
            return "Z" if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE else "R"
        except psutil.NoSuchProcess:
            return None


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """Ctrl-C (and SIGTERM, SIGHUP: `fsdp_lab.endings`) waits until a message is wholly sent
    or read: half of one desynchronises a pipe."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signals are only ever handled on the main thread
        return
    held = set(endings.SIGNALS) - signal.pthread_sigmask(signal.SIG_BLOCK, endings.SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def how_it_ended(code: int | None) -> str:
    """A dead process's exit code in words: "exit code 3", "signal SIGKILL"."""
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"signal {signal.Signals(-code).name}"
        return f"signal {-code}"
    return f"exit code {code}"


def _death_hint(code: int | None) -> str:
    if code == -signal.SIGKILL:
        return (
            " SIGKILL comes from outside the rank: most often the kernel's out-of-memory killer "
            "(`dmesg` shows it), or a `kill -9`."
        )
    if code is not None and code < 0:
        return " A crash in native code (torch, the backend): its stderr lines are above."
    return ""


def _stop_ranks(ranks: list[_Rank], folder: str, grace: float = 5.0) -> None:
    """Ask every rank to stop (a rank that stops kills what it started), wait `grace`, then
    end each rank with everything below it; orphans of ranks that died are killed too; close
    pipes; remove the store."""
    stop = pickle.dumps(("stop",))
    for rk in ranks:
        with contextlib.suppress(Exception):
            rk.channel.send(stop, time.monotonic() + 0.5)
    deadline = time.monotonic() + grace
    for rk in ranks:
        rk.proc.join(max(0.0, deadline - time.monotonic()))
    for rk in ranks:
        launcher.end_process(rk.proc)
    if ranks:
        launcher.reap_orphans()
    for rk in ranks:
        with contextlib.suppress(Exception):
            rk.output.drain()
        rk.output.close()
        with contextlib.suppress(Exception):
            rk.channel.close()
    shutil.rmtree(folder, ignore_errors=True)
