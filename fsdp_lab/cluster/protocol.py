"""The messages between the driver (notebook, CLI) and its ranks, and the error a learner sees.

One duplex pipe per rank carries pickled tuples of plain values:

    driver -> rank   ("call", call_id, token, payload)   payload: cloudpickle of (fn, args, kwargs)
                     ("stop",)
    rank -> driver   ("ready", pid)                   the rank joined the process group
                     ("failed", traceback)            ... or could not
                     ("reply", call_id, token, Reply) one per call, echoing its id and token

Every reply echoes the id of the call it answers, so a reply of a call the driver gave up on
(interrupted, timed out) can never be taken for the answer to a later call: it is dropped; and
the call's random token, so a reply to an id guessed ahead is no reply at all.
The result travels as its own cloudpickle inside the reply, so a result the driver cannot
unpickle (a class that exists only on the ranks) is an error of *that* call, not a broken pipe.

[Note: the driver trusts no byte on a channel] The driver reads a channel without ever
blocking (`Channel`): it takes what the pipe holds when the OS says it is readable and parses
a message only once it is whole. A rank that sends half a message, a header promising a
gigabyte, a reply to a call not yet sent, or anything while no call is in flight cannot hold
the driver past the call's deadline nor keep Ctrl-C from it: that call fails with a
`RankError` naming the rank, and a channel out of step is never used again (its ranks are
restarted).

Unpickling runs code the pickle names. The driver therefore reads a rank's *messages* with
`read_message`, which builds tuples, strings, numbers and `Reply` and refuses anything else;
and a `Cluster(plain_results=True)` reads *results* with `torch.load(weights_only=True)`
(PyTorch's own restricted unpickler: containers, numbers, strings, tensors), so a rank running
code the driver does not trust (a learner's, when grading) cannot run code in the driver.

What ranks print does not travel here: their stdout and stderr are pipes the driver reads as
the bytes arrive (`fsdp_lab.cluster.output`), so output printed before a hang or a death
reaches the learner.
"""

from __future__ import annotations

import io
import os
import pickle
import select
import struct
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Reply:
    """A rank's answer to one call.

    Args:
        ok: the function returned (`result` holds its cloudpickle) or raised (`error`, `traceback`).
        result: cloudpickle of the return value.
        error: one line, e.g. "raised ValueError('boom')".
        traceback: the remote traceback.
        interrupted: the call ended in KeyboardInterrupt (the driver forwarded Ctrl-C).
        collectives: collectives issued so far, per process group (name -> count): after an
            interrupt, ranks whose counts agree are in step and can be kept.
    """

    ok: bool
    result: bytes = b""
    error: str = ""
    traceback: str = ""
    interrupted: bool = False
    collectives: dict[str, int] | None = field(default=None)


class RankError(RuntimeError):
    """A rank failed: raised an exception, died, or did not answer in time.

    Attributes:
        rank: the rank the error is about (the one that died first, if any died).
        message: what happened, and what the cluster did about it.
        remote_traceback: the traceback on that rank ("" if it died or hung).
        exitcode: for a rank that died, its exit code (negative: killed by that signal).
        others: one line per other rank that failed in the same call (often a consequence).
    """

    def __init__(
        self,
        rank: int,
        message: str,
        remote_traceback: str = "",
        *,
        exitcode: int | None = None,
        others: list[str] | None = None,
    ) -> None:
        self.rank = rank
        self.message = message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        self.others = list(others or [])
        text = f"rank {rank}: {message}"
        if self.others:
            text += "\n" + "\n".join(f"  then {line}" for line in self.others)
        if remote_traceback:
            text += f"\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)


class _MessageUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == (__name__, "Reply"):
            return Reply
        raise pickle.UnpicklingError(f"a rank sent a {module}.{name}: only replies are read")


def read_message(data: bytes) -> Any:
    """A message from a rank: built from plain values and `Reply`, nothing else."""
    return _MessageUnpickler(io.BytesIO(data)).load()


def encode_plain(value: Any) -> bytes:
    """A result for a driver that reads plain data only (`decode_plain`)."""
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def decode_plain(blob: bytes) -> Any:
    """Containers, numbers, strings and tensors; an UnpicklingError for anything else."""
    import torch

    return torch.load(io.BytesIO(blob), weights_only=True)


# multiprocessing.Connection's framing, which the ranks' plain Connection writes: a signed
# 4-byte length, or -1 and then an 8-byte length for a message of 2 GiB or more.
_SHORT, _LONG = struct.Struct("!i"), struct.Struct("!Q")


class ChannelBroken(Exception):
    """What a rank wrote on its channel is not a message of ours (or the channel closed)."""


class Channel:
    """The driver's end of one rank's call pipe, read and written without blocking.

    `read()` takes whatever the pipe holds now; `message()` returns the next whole message, or
    None while it is incomplete. So no read ever waits for bytes a rank promised and never
    sent: the caller's deadline (and Ctrl-C) stays in charge.
    """

    def __init__(self, conn: Any) -> None:
        self.conn = conn  # owns the file descriptor
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = bytearray()
        self.ended = False  # the rank's end is closed: nothing more will come

    def fileno(self) -> int:
        return self.fd

    def read(self) -> None:
        """Everything the pipe holds now, appended to the buffer."""
        while not self.ended:
            try:
                chunk = os.read(self.fd, 1 << 20)
            except BlockingIOError:
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.ended = True
            self.buffer += chunk

    def message(self) -> bytes | None:
        """The next whole message read so far (None: not whole yet); ChannelBroken if the
        bytes cannot be one."""
        if len(self.buffer) < _SHORT.size:
            return None
        (size,), start = _SHORT.unpack_from(self.buffer), _SHORT.size
        if size == -1:
            if len(self.buffer) < start + _LONG.size:
                return None
            (size,), start = _LONG.unpack_from(self.buffer, start), start + _LONG.size
        elif size < 0:
            raise ChannelBroken(f"a message header of {size} bytes")
        if len(self.buffer) < start + size:
            return None
        data = bytes(self.buffer[start : start + size])
        del self.buffer[: start + size]
        return data

    def send(self, data: bytes, deadline: float) -> None:
        """One message, written as the pipe takes it; TimeoutError if the rank has not taken
        it all by `deadline` (a rank that stopped reading)."""
        size = len(data)
        header = _SHORT.pack(size) if size <= 0x7FFFFFFF else _SHORT.pack(-1) + _LONG.pack(size)
        for part in (header, data):
            view = memoryview(part)
            while view:
                try:
                    view = view[os.write(self.fd, view) :]
                except BlockingIOError:
                    left = deadline - time.monotonic()
                    if left <= 0 or not select.select([], [self.fd], [], left)[1]:
                        raise TimeoutError("the rank did not take the message") from None

    def close(self) -> None:
        self.conn.close()
