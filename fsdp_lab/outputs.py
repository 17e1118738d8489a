"""How fsdp_lab writes a file it leaves behind: new, whole, and its own.

[Note: an output folder is not trusted] Whatever already sits where an output goes — a
gradebook's folder others can write to, a checkpoint folder, `--out` — may have been put there
to be written through. So every file fsdp_lab leaves (a gradebook, a sharded checkpoint's rank
files and meta.json, a lab's JSON and figures) is written by `write_file`:

- into a temporary file this process creates new beside the destination (O_EXCL and
  O_NOFOLLOW, a random name: never through a link, never a file someone else made), flushed
  and fsynced;
- given the mode a file made by `open()` would have (0666 less the umask);
- renamed onto the destination in one step (`os.replace`): a reader sees the old file or the
  new one, never half; a link planted at the destination is replaced, never written through;
- and the folder fsynced, so the rename survives a crash.

A failed write (a full disk, a file-size limit) removes its temporary file and raises an
OSError that names the destination and the reason, whatever library was writing. What
fsdp_lab reads back from such a folder (`read_file`) is a regular file of bounded size: a
FIFO planted there never hangs a read, a link to /dev/zero never fills memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import stat
from collections.abc import Callable
from pathlib import Path
from typing import IO


class HashingWriter:
    """Passes writes on to a file and hashes them: the size and sha256 of exactly the bytes
    written. Keeps the first OSError a write raised (a library calling it may hide it)."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f, self.sha256, self.size = f, hashlib.sha256(), 0
        self.error: OSError | None = None

    def write(self, data: bytes) -> int:
        try:
            written = self.f.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.sha256.update(data)
        self.size += memoryview(data).nbytes
        return written

    def flush(self) -> None:
        self.f.flush()


def write_file(
    path: str | os.PathLike,
    content: bytes | str | Callable[[HashingWriter], object],
    folder: int | None = None,
) -> tuple[int, str]:
    """Write `content` (bytes, text as UTF-8, or a function given the file to write to) to
    `path`, new and whole (see the module's note); returns the size and sha256 written.

    `folder`: an open folder that `path` is a name in — nothing is then looked up by a path
    again, so a folder swapped for a link since it was opened leads nowhere else."""
    if folder is None:
        path = Path(path)
        try:
            fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise OSError(exc.errno, f"writing {path}: {exc.strerror or exc}") from exc
        try:
            return _write_in(fd, path.name, content, str(path))
        finally:
            os.close(fd)
    return _write_in(folder, os.fspath(path), content, os.fspath(path))


NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_in(
    folder: int, name: str, content: bytes | str | Callable[[HashingWriter], object], shown: str
) -> tuple[int, str]:
    try:
        tmp = f".{name}.{secrets.token_hex(6)}.tmp"  # new (O_EXCL), ours, never through a link
        fd = os.open(tmp, NEW_FILE, 0o600, dir_fd=folder)
    except OSError as exc:
        raise OSError(exc.errno, f"writing {shown}: {exc.strerror or exc}") from exc
    try:
        with os.fdopen(fd, "wb") as f:
            hashed = HashingWriter(f)
            try:
                if callable(content):
                    content(hashed)
                else:
                    hashed.write(content.encode() if isinstance(content, str) else content)
                f.flush()
                os.fsync(f.fileno())  # the bytes are on disk before the name points at them
            except Exception as exc:
                cause = hashed.error or (exc if isinstance(exc, OSError) else None)
                if cause is None:
                    raise
                raise OSError(cause.errno, f"writing {shown}: {cause.strerror or cause}") from exc
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=folder)
        raise
    if os.name == "posix":  # the rename itself, with any new folder entries beside it
        os.fsync(folder)
    return hashed.size, hashed.sha256.hexdigest()


def read_file(path: str | os.PathLike, limit: int, folder: int | None = None) -> bytes:
    """A regular file's bytes, at most `limit` (a ValueError past it): what fsdp_lab reads back
    from a folder it does not trust. A FIFO or a device (/dev/zero) is refused, never read;
    with `folder` (an open folder `path` is a name in), a link is not followed either."""
    flags = (
        os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (os.O_NOFOLLOW if folder is not None else 0)
    )
    fd = os.open(path, flags, dir_fd=folder)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{os.fspath(path)} is not a regular file")
        if info.st_size > limit:
            raise ValueError(f"{os.fspath(path)} holds {info.st_size} bytes, more than {limit}")
        data = read_open(fd, limit + 1)
        if len(data) > limit:
            raise ValueError(f"{os.fspath(path)} grew past {limit} bytes while read")
        return data
    finally:
        os.close(fd)


def read_open(fd: int, limit: int) -> bytes:
    """What the open file `fd` holds from where it stands, at most `limit` bytes."""
    chunks, total = [], 0
    while total < limit and (chunk := os.read(fd, min(1 << 20, limit - total))):
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def _umask() -> int:
    """This process's umask, read without changing it (os.umask sets it: a race with threads)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022
