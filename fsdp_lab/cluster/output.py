"""What ranks print, shown as it happens: each line prefixed ``[rank r]``.

Each rank's stdout and stderr are the write ends of two OS pipes; the driver holds the read
ends and reads whatever is there whenever it waits for the ranks. So a line printed before a
hang or a crash is already in the pipe when the rank stops, and a long stream arrives line by
line while the call runs (read in chunks of up to 64 KiB, printed with one write per chunk),
not all at once at the end. A line longer than `MAX_LINE` bytes is printed in pieces of that
length: a rank that prints 100 MB without a newline costs the driver one piece at a time, not
a partial line joined to every chunk (quadratic) and held whole.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TextIO

CHUNK = 1 << 16
MAX_LINE = 1 << 16  # bytes of one line kept before it is printed as a piece


class RankOutput:
    """The read ends of one rank's stdout and stderr, and the partial lines seen so far."""

    def __init__(self, rank: int, out_fd: int, err_fd: int) -> None:
        self.rank = rank
        self.fds = {out_fd: "stdout", err_fd: "stderr"}
        self._partial = {out_fd: b"", err_fd: b""}

    def read(self, fd: int) -> None:
        """Read what is in `fd` now (it is non-blocking) and print the complete lines."""
        while True:
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # the rank closed it (it exited): nothing more will come
                self._emit(fd, self._partial[fd] + (b"\n" if self._partial[fd] else b""))
                self._close(fd)
                return
            got = len(data)
            data = self._partial[fd] + data  # the partial line is below MAX_LINE: joined cheaply
            cut = data.rfind(b"\n") + 1
            while len(data) - cut > MAX_LINE:  # no newline for that long: print a piece
                cut += MAX_LINE
            self._partial[fd] = data[cut:]
            self._emit(fd, data[:cut])
            if got < CHUNK:
                return

    def drain(self) -> None:
        """Print everything in the pipes now, incomplete last lines included (end of a call)."""
        for fd in list(self.fds):
            self.read(fd)
            if fd in self.fds and self._partial[fd]:
                self._emit(fd, self._partial[fd] + b"\n")
                self._partial[fd] = b""

    def close(self) -> None:
        for fd in list(self.fds):
            self._close(fd)

    def _emit(self, fd: int, data: bytes) -> None:
        if not data:
            return
        prefix = f"[rank {self.rank}] "
        text = data.decode("utf-8", errors="backslashreplace")
        stream: TextIO = sys.stdout if self.fds.get(fd) == "stdout" else sys.stderr
        stream.write("".join(prefix + line + "\n" for line in text.splitlines()))
        with contextlib.suppress(Exception):
            stream.flush()

    def _close(self, fd: int) -> None:
        if self.fds.pop(fd, None) is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
