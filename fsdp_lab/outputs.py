"""How fsdp_lab writes a file it leaves behind: new, whole, and its own.

[Note: an output folder is not trusted] Whatever already sits where an output goes — a
gradebook's folder others can write to, a checkpoint folder, `--out` — may have been put there
to be written through. So every file fsdp_lab leaves (a gradebook, a sharded checkpoint's rank
files and meta.json, a lab's JSON and figures) is written by `write_file`:

- into a temporary file this process creates new beside the destination (`mkstemp`: O_EXCL,
  never through a link, never a file someone else made), flushed and fsynced;
- given the mode a file made by `open()` would have (0666 less the umask), not mkstemp's 0600;
- renamed onto the destination in one step (`os.replace`): a reader sees the old file or the
  new one, never half; a link planted at the destination is replaced, never written through;
- and the folder fsynced, so the rename survives a crash.

A failed write (a full disk, a file-size limit) removes its temporary file and raises an
OSError that names the destination and the reason, whatever library was writing.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
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
    path: str | os.PathLike, content: bytes | str | Callable[[HashingWriter], object]
) -> tuple[int, str]:
    """Write `content` (bytes, text as UTF-8, or a function given the file to write to) to
    `path`, new and whole (see the module's note); returns the size and sha256 written."""
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise OSError(exc.errno, f"writing {path}: {exc.strerror or exc}") from exc
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
                raise OSError(cause.errno, f"writing {path}: {cause.strerror or cause}") from exc
            os.fchmod(f.fileno(), 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)  # the rename itself, with any new folder entries beside it
    return hashed.size, hashed.sha256.hexdigest()


def fsync_folder(folder: Path) -> None:
    if os.name != "posix":  # Windows cannot open a folder to fsync it
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
