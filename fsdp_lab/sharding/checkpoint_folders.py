"""The folders of a sharded checkpoint: which version folder a save makes, which it may remove.

[Note: a save deletes only what it wrote] The checkpoint folder may hold anything else — a
user's data, a folder named like a version, a version folder moved to another disk and linked
back — and others may be able to write to it. So a save creates its version folder new (never
adopting one that exists) and writes its name and identity (device, inode) into journal.json;
it removes only a folder the journal names that is still that very folder — a journal counts
only as the saving user's own regular file, and a folder put in the place of one it names is
another — and inside it only rank files and their temporary files, never through a link, and
the folder only once empty. Every rank file is written through the version folder opened once
(O_NOFOLLOW, the saving user's): a version folder swapped for a link after it was made leads
nowhere else.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

from fsdp_lab.outputs import read_file, write_file

META = "meta.json"
JOURNAL = "journal.json"
VERSION = re.compile(r"v(\d{5,})")  # a version folder of rank files: v00001, v00002, ...
# What a save writes inside its own version folder: rank files, and the temporary files of
# writes a crash interrupted (`outputs.write_file`'s names).
_OURS_INSIDE = re.compile(r"rank\d{5}\.pt|\.rank\d{5}\.pt\..+\.tmp")
MAX_RECORD_BYTES = 64 << 20  # meta.json or journal.json larger than this is not ours


def version_name(version: int) -> str:
    return f"v{version:05d}"


def rank_name(rank: int) -> str:
    return f"rank{rank:05d}.pt"


MAX_RECORD_BYTES = 64 << 20  # meta.json or journal.json larger than this is not ours


@contextlib.contextmanager
def _opened(folder: Path) -> Iterator[int]:
    """The checkpoint folder, opened (the user's own path: a link to it is followed)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


@contextlib.contextmanager
def version_folder(folder: Path, version: int) -> Iterator[int]:
    """A version folder this save made, opened without following a link, and checked to be the
    saving user's: rank files are written into it, never into what a link points at."""
    with _opened(folder) as top:
        fd = os.open(version_name(version), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
                     | os.O_CLOEXEC, dir_fd=top)  # fmt: skip
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError(errno.EPERM, f"{version_name(version)} is not this save's "
                                  "folder (another user's)")  # fmt: skip
        yield fd
    finally:
        os.close(fd)


def _identity(top: int, name: str) -> tuple[int, int] | None:
    """(device, inode) of the real folder `name` in the open folder `top`, None if it is not
    one (a link, a file, nothing)."""
    try:
        info = os.stat(name, dir_fd=top, follow_symlinks=False)
    except OSError:
        return None
    return (info.st_dev, info.st_ino) if stat.S_ISDIR(info.st_mode) else None


def _journal(top: int) -> dict[str, list[int]]:
    """The version folders journal.json says this checkpoint's saves made, with the identity
    each had when made — a name alone proves nothing, as anyone may write the folder. The file
    counts only if it is the saving user's own regular file (not a link, a FIFO, another
    user's)."""
    try:
        if not _mine(top, JOURNAL):
            return {}
        entries = json.loads(read_file(JOURNAL, MAX_RECORD_BYTES, folder=top))
    except (OSError, ValueError):
        return {}
    made = entries if isinstance(entries, dict) else {}
    return {
        name: ident for name, ident in made.items()
        if VERSION.fullmatch(name) and isinstance(ident, list) and len(ident) == 2
        and all(isinstance(n, int) for n in ident)
    }  # fmt: skip


def new_version_folder(folder: Path, committed: int | None) -> int:
    """A new version folder, past every version this checkpoint knows (`committed`: the one its
    meta.json names) and past whatever sits in the folder under that name: created new (never
    an existing folder adopted), then journaled with its identity. (A kill between the two
    leaves an empty folder no save will remove.)"""
    with _opened(folder) as top:
        made = _journal(top)
        if committed and version_name(committed) not in made and _mine(top, META):
            # A checkpoint saved before journals: the folder its own meta.json names.
            ident = _identity(top, version_name(committed))
            made.update({version_name(committed): list(ident)} if ident else {})
        version = 1 + max([int(name[1:]) for name in made] + [committed or 0])
        while True:
            try:
                os.mkdir(version_name(version), dir_fd=top)
                break
            except FileExistsError:  # whatever sits there is not ours
                version += 1
        made[version_name(version)] = list(_identity(top, version_name(version)) or (0, 0))
        write_file(JOURNAL, json.dumps(made), folder=top)
    return version


def _mine(top: int, name: str) -> bool:
    """`name` in the open folder `top` is the saving user's own (not followed if a link)."""
    try:
        return os.stat(name, dir_fd=top, follow_symlinks=False).st_uid == os.geteuid()
    except OSError:
        return False


def remove_superseded(folder: Path, current: int) -> None:
    """The version folders this checkpoint's saves made, but the current one: their rank files
    and temporary files, then the folder if nothing else is in it. A folder counts only while
    it is the very folder the journal recorded (same device and inode, not a link)."""
    keep = version_name(current)
    with _opened(folder) as top:
        made = _journal(top)
        for name, ident in made.items():
            if name != keep:
                _remove_version(top, name, tuple(ident))
        write_file(JOURNAL, json.dumps({keep: made[keep]} if keep in made else {}), folder=top)


def _remove_version(top: int, name: str, ident: tuple[int, ...]) -> None:
    with contextlib.suppress(OSError):
        if _identity(top, name) != ident:  # replaced, linked or gone: not what we made
            return
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=top)  # fmt: skip
        try:
            if (os.fstat(fd).st_dev, os.fstat(fd).st_ino) != ident:
                return
            for entry in os.scandir(fd):
                if _OURS_INSIDE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    os.unlink(entry.name, dir_fd=fd)
        finally:
            os.close(fd)
        os.rmdir(name, dir_fd=top)  # only if empty: whatever else is there stays


def forget_uncommitted(folder: Path, version: int, rank: int, committed: int | None) -> None:
    """A save that failed before its switch: this rank's file goes, and (rank 0) the version
    folder once empty; a kill leaves them to the next save, whose journal names the folder."""
    if committed == version:
        return
    with contextlib.suppress(OSError), version_folder(folder, version) as here:
        os.unlink(rank_name(rank), dir_fd=here)
    if rank == 0:
        with contextlib.suppress(OSError), _opened(folder) as top:
            ident = _journal(top).get(version_name(version))
            if ident:
                _remove_version(top, version_name(version), tuple(ident))
