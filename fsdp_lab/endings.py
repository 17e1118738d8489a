"""SIGTERM and SIGHUP end a command the way Ctrl-C does.

[Note: every ending runs the clean-up] A CI job's timeout sends SIGTERM, a dropped ssh
session SIGHUP; by default either ends Python at once, skipping every `finally`: a grading run
left every student's copy, its sandbox folder, the ranks' stores and its control groups behind,
which Ctrl-C (a KeyboardInterrupt) cleans up. So a command takes all three alike:
`ended_like_ctrl_c()` turns SIGTERM and SIGHUP into `Ended`, a KeyboardInterrupt, and every
clean-up written for Ctrl-C runs for them too (ranks stopped, sandboxes killed, temporary
folders and cgroups removed; what was committed — a gradebook, a checkpoint — stays). A second
signal while that runs ends the process at once, as the default would have.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from typing import Any

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # what ends a command


class Ended(KeyboardInterrupt):
    """SIGTERM or SIGHUP, taken as Ctrl-C."""


class Ending:
    """What `ended_like_ctrl_c` yields: the signal that ended the command, once one has (a
    KeyboardInterrupt may be re-raised on its way up with another message, so the signal is
    kept here, not only in the exception)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "SIGINT"


@contextlib.contextmanager
def ended_like_ctrl_c() -> Iterator[Ending]:
    """Inside, SIGTERM and SIGHUP raise `Ended` in the main thread (elsewhere: nothing)."""
    ending = Ending()
    if threading.current_thread() is not threading.main_thread():
        yield ending
        return

    def end(signum: int, frame: Any) -> None:
        for sig in SIGNALS[1:]:  # a second one while cleaning up: the default, at once
            signal.signal(sig, signal.SIG_DFL)
        ending.signum = signum
        raise Ended(signal.Signals(signum).name)

    previous = {sig: signal.signal(sig, end) for sig in SIGNALS[1:]}
    try:
        yield ending
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
