"""Where a failing learner's code is: a rank's traceback and a hung rank's stack, from the
learner's first frame, their frames in their words.

A rank runs the learner's functions shipped by value (cloudpickle): it knows neither the file
they were written in (a notebook cell lives in the kernel, not on disk; cloudpickle 3.1 and later
names every such file '<dynamic-code>') nor, then, their lines. Where the function was written
(the notebook's kernel, the graded submission's process) both are known: `learner_files` maps
each of the learner's function names to its file, and linecache holds the lines (the kernel's
cells; a graded file's blocks, put there by `submission.py`).
"""

from __future__ import annotations

import linecache
import os
import re
import sys
import sysconfig
import types
from typing import Any

MAX_TRACEBACK_LINES = 30


# A frame line of a traceback ('File "f", line 3, in g') or of faulthandler's stack (no comma).
FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+),? in (?P<name>.+)$')
# Where the learner's code is not: the standard library, installed packages, this package.
NOT_LEARNERS = tuple(
    {sysconfig.get_paths()[k] for k in ("stdlib", "purelib", "platlib")}
    | {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}
)


def _learners(frame: re.Match) -> bool:
    return not frame["file"].startswith((*NOT_LEARNERS, "<frozen"))


def learner_files(fn: Any) -> dict[str, str]:
    """Function name -> the file its code was written in (a notebook cell, a graded file's
    block, a script), for the learner's function, the functions inside it and those its globals
    hold: a rank runs them as shipped by value, and cloudpickle (3.1 and later) names their file
    '<dynamic-code>'."""
    files: dict[str, str] = {}

    def add(code: types.CodeType) -> None:
        files.setdefault(code.co_name, code.co_filename)
        for inner in code.co_consts:
            if isinstance(inner, types.CodeType):
                add(inner)

    # Plain functions only, by their type: nothing of the learner's runs here (an object's
    # __getattr__ would, and a hostile one may raise anything).
    if type(fn) is types.FunctionType:
        for obj in [fn, *fn.__globals__.values()]:
            if type(obj) is types.FunctionType:
                add(obj.__code__)
    return files


def _where(file: str) -> str:
    """A file that is not on disk, as the learner knows it: a notebook cell ("your cell In[3]"),
    a graded file's block ("ex.py [cell 2]"), else their code."""
    if "ipykernel_" in file or file.startswith("<ipython-input"):
        shell = sys.modules["IPython"].get_ipython() if "IPython" in sys.modules else None
        count = getattr(getattr(shell, "compile", None), "_filename_map", {}).get(file)
        return "your cell" if count is None else f"your cell In[{count}]"
    return "your code" if file.startswith("<") else file


def _in_their_words(frame: re.Match, files: dict[str, str], with_text: bool) -> list[str]:
    """A frame of the learner's code, with its line. A rank runs the learner's functions shipped
    by value: it knows neither the file (a cell lives in the kernel) nor, then, the line; both
    are known here, where the function was written (linecache: the kernel's cells, a graded
    file's blocks). A frame the rank could show keeps its line (`with_text`: add it)."""
    file, line, name = frame["file"], int(frame["line"]), frame["name"]
    shipped = file.startswith("<") and name in files
    file = files[name] if shipped else file
    on_disk = os.path.exists(file)
    said = (
        f'  File "{file}", line {line}, in {name}'
        if on_disk
        else f"  {_where(file)}, line {line}, in {name}"
    )
    text = linecache.getline(file, line).strip()
    return [said] + ([f"    {text}"] if text and (with_text or shipped or not on_disk) else [])


def cut(tb: str, files: dict[str, str]) -> str:
    """The traceback from the learner's first frame on (ours before it is noise to them), their
    frames in their words."""
    lines = tb.rstrip().splitlines()
    frames = [FRAME.match(line) for line in lines]
    first = next((i for i, m in enumerate(frames) if m and _learners(m)), None)
    if first is not None:
        lines, frames = lines[first:], frames[first:]
        lines = ["Traceback (most recent call last):"] + [
            said
            for line, m in zip(lines, frames, strict=True)
            for said in (_in_their_words(m, files, False) if m and _learners(m) else [line])
        ]
    if len(lines) > MAX_TRACEBACK_LINES:
        lines = ["...", *lines[-MAX_TRACEBACK_LINES:]]
    return "\n".join(lines)


def _own_first(stack: str, files: dict[str, str]) -> str:
    """A stack (most recent call first) led by the learner's own frames, in their words."""
    lines = stack.splitlines()
    frames = [FRAME.match(line) for line in lines]
    own = [m for m in frames if m and _learners(m)]
    if not own:
        return "the stack, most recent call first:\n" + stack
    yours = [said for m in own for said in _in_their_words(m, files, with_text=True)]
    whole = [
        _in_their_words(m, files, False)[0] if m and _learners(m) else line
        for line, m in zip(lines, frames, strict=True)
    ]
    return "\n".join(["your code, most recent call first:", *yours, "the whole stack:", *whole])


def hung_rank(
    reported: int, world_size: int, stack_file: str, files: dict[str, str]
) -> tuple[int, str, list[str]]:
    """The rank stuck in the learner's own code (else the one `Cluster` reported), its stack,
    and one line per other rank that was waiting in a collective (for it, most likely)."""
    stacks = {r: _main_thread(_read(stack_file.format(rank=r))) for r in range(world_size)}
    frames = {r: [m for ln in s.splitlines() if (m := FRAME.match(ln))] for r, s in stacks.items()}

    def in_own_code(r: int) -> bool:  # the most recent frame is the learner's
        return bool(frames[r] and _learners(frames[r][0]))

    own = [r for r in stacks if in_own_code(r)]
    rank = own[0] if own else reported
    waiting = []
    for r, fr in frames.items():
        if r != rank and fr and "torch/distributed" in fr[0]["file"]:
            waiting.append(f"rank {r} was waiting in {fr[0]['name']}")
    stack = ""
    if stacks.get(rank):
        stack = f"rank {rank}, just before the time limit:\n"
        stack += _own_first(stacks[rank], files)
    return rank, stack, waiting


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _main_thread(dump: str) -> str:
    """faulthandler's block for the thread that ran the trial, cut after `attempt` (below it:
    the rank's own machinery)."""
    for block in dump.split("\n\n"):
        if "in attempt" in block:
            lines = [ln for ln in block.splitlines() if not ln.startswith("Timeout (")]
            end = next(i for i, ln in enumerate(lines) if ln.rstrip().endswith("in attempt"))
            return "\n".join(lines[:end]).strip()
    return ""
