"""The generated tables of docs/: what each exercise is worth and catches, how
long its check takes (docs/teaching.md), every file of every topic folder with its lines and its
role (docs/architecture.md), and the HSDP lab's bytes per step (docs/labs.md) — written from the
code and from a run, never typed.

    python scripts/doc_tables.py            # rewrite the catalog and files blocks (from the code)
    python scripts/doc_tables.py --run      # ... and the HSDP lab's table (a fresh 4-rank run)
    python scripts/doc_tables.py --times    # ... and measure the check times on this machine
    python scripts/doc_tables.py --check    # exit 1 if a block made from the code is stale

Blocks live between `<!-- generated: NAME (python scripts/doc_tables.py) -->` and
`<!-- end generated -->`. The catalog block (labs, points, cases, bugs) and the files block
(each topic folder's files, their line counts, the first paragraph of each docstring) follow
from the code, so the tests check they are current. The HSDP lab's table holds only bytes
counted at the collective call and formulas, so a fresh run reproduces it exactly
(tests/test_readme.py runs it and compares); times and resident memory move with the machine's
load and never appear in it. The times block is a measurement: it says on what machine
and when; the test checks only that it covers every exercise.
"""

from __future__ import annotations

import argparse
import ast
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

from fsdp_lab.course import LABS, ClusterPool, grade
from fsdp_lab.markdown import table

ROOT = Path(__file__).resolve().parent.parent
DOCS = tuple(ROOT / "docs" / f"{name}.md" for name in ("labs", "teaching", "architecture"))
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) \(python scripts/doc_tables.py\) -->\n)"
    r"(?P<body>.*?)(<!-- end generated -->)",
    re.S,
)
REPEATS = 3


def catalog() -> str:
    rows = []
    for lab, group in LABS.items():
        for ex in group:
            sizes = sorted({c.world_size for c in ex.cases})
            rows.append(
                (
                    lab,
                    f"`{ex.name}`",
                    ex.points,
                    f"{len(ex.cases)} (ranks: {', '.join(map(str, sizes))})",
                    "; ".join(b.title for b in ex.bugs) or "—",
                    ex.minutes,
                )
            )
    header = ["lab", "exercise", "points", "cases", "classic bugs it catches", "minutes (est.)"]
    return table(header, rows) + "\n"


def times() -> str:
    """Per lab: starting its ranks and the first check (cold); per exercise: the median of
    REPEATS checks of the reference on warm ranks. Every check must pass."""
    rows = []
    for lab, group in LABS.items():
        t0 = time.perf_counter()
        with ClusterPool() as pool:
            first = grade(group[0].name, group[0].solution, pool)
            cold = time.perf_counter() - t0
            assert first.passed, first.to_text()
            for ex in group:
                runs = []
                for _ in range(REPEATS):
                    t = time.perf_counter()
                    v = grade(ex.name, ex.solution, pool)
                    runs.append(time.perf_counter() - t)
                    assert v.passed, v.to_text()
                rows.append(
                    (
                        lab,
                        f"`{ex.name}`",
                        f"{statistics.median(runs):.2f} s",
                        f"{cold:.1f} s" if ex is group[0] else "",
                    )
                )
                print(f"{lab} {ex.name}: {statistics.median(runs):.2f} s", file=sys.stderr)
    cores = len(os.sched_getaffinity(0))
    import torch

    where = (
        f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} Linux, {cores} CPU "
        f"cores, torch {torch.__version__}, gloo, by `python scripts/doc_tables.py "
        f"--times`; median of {REPEATS} checks of the reference solution on warm ranks. The "
        f"last column: the lab notebook's first check, starting its ranks. Your machine will "
        f"differ: run the command."
    )
    header = ["lab", "exercise", "one check (warm)", "first check (ranks start)"]
    return where + "\n\n" + table(header, rows) + "\n"


# The topic folders, in the order docs/architecture.md's reading order takes them.
TOPICS = ("collectives", "sharding", "checkpointing", "tying", "meta_init", "pipeline", "hsdp",
          "course")  # fmt: skip
ROLE_CHARS = 150


def _role(source: str) -> str:
    """The first paragraph of a file's docstring, on one line, cut near ROLE_CHARS."""
    doc = (ast.get_docstring(ast.parse(source)) or "").split("\n\n")[0]
    role = " ".join(doc.split())
    if len(role) > ROLE_CHARS:
        role = role[:ROLE_CHARS].rsplit(" ", 1)[0] + " …"
    return role


def files() -> str:
    """Every file of every topic folder: its lines and its role, from the tree as it is."""
    rows = []
    for topic in TOPICS:
        folder = ROOT / "fsdp_lab" / topic
        paths = sorted(folder.rglob("*.py"), key=lambda p: (p.name != "__init__.py" or
                                                             p.parent != folder, str(p)))  # fmt: skip
        for i, path in enumerate(paths):
            source = path.read_text()
            name = f"`{path.relative_to(folder)}` ({len(source.splitlines())})"
            here = (topic, f"`fsdp_lab/{topic}/`") if i == 0 else ("", "")
            rows.append((*here, name, _role(source)))
    header = ["topic", "folder", "file", "role"]
    return table(header, rows) + "\n(The number beside a file is its lines.)\n"


def hsdp_bytes() -> str:
    """docs/labs.md's table: the HSDP lab's bytes per step on rank 0, beside the formulas."""
    from fsdp_lab.hsdp import lab as hsdp
    from fsdp_lab.hsdp.lab import report

    result = hsdp.run(hsdp.HsdpConfig(world_size=4, steps=1, compare_pytorch=False))
    return (
        "`fsdp-lab hsdp --steps 1 --no-pytorch` (4 ranks, mesh 2,2, TinyGPT, fp32), bytes per "
        "step on rank 0:\n\n" + report.bytes_table(result) + "\n"
    )


FROM_RUNS = {"hsdp-bytes": hsdp_bytes}


def blocks(text: str) -> dict[str, str]:
    """The generated blocks in `text`, name -> body."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0]
        + " With no option, rewrites the blocks made from the code in docs/."
    )
    parser.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a block is stale"
    )
    parser.add_argument(
        "--run", action="store_true", help="also docs/labs.md's HSDP table (a fresh 4-rank run)"
    )
    parser.add_argument(
        "--times", action="store_true", help="also measure every exercise's check time"
    )
    args = parser.parse_args(argv)
    fresh = {"catalog": catalog, "files": files}
    if args.run:
        fresh |= FROM_RUNS
    if args.times:
        fresh["times"] = times
    stale = []

    def rebuild(m: re.Match, doc: Path) -> str:
        name = m.group("name")
        if name not in fresh:
            return m.group(0)
        body = fresh[name]()
        if body != m.group("body"):
            stale.append((doc, name))
        return m.group(1) + body + m.group(4)

    for doc in DOCS:
        new = BLOCK.sub(lambda m, doc=doc: rebuild(m, doc), doc.read_text())
        if not args.check:
            doc.write_text(new)
    for doc, name in stale if args.check else ():
        flag = " --run" if name in FROM_RUNS else " --times" if name == "times" else ""
        where = doc.relative_to(ROOT)
        print(f"{where}: block {name!r} is stale: python scripts/doc_tables.py{flag}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
