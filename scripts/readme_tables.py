"""Regenerate the README's measured tables from a fresh run, or check that they are current.

The README shows a measured table only between markers this script owns:

    <!-- generated: NAME (python scripts/readme_tables.py) -->
    ...
    <!-- end generated -->

Each NAME is a lab run at fixed settings whose table holds only deterministic columns (bytes
counted at the collective call, formulas), so a fresh run reproduces it exactly;
tests/test_readme.py runs it and compares. Times and resident memory move with the machine's
load and never appear in the README: the commands print them.

    python scripts/readme_tables.py          # rewrite the blocks in README.md
    python scripts/readme_tables.py --check  # exit 1 if a block differs from a fresh run
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(
    r"(<!-- generated: (?P<name>[\w-]+) \(python scripts/readme_tables.py\) -->\n)"
    r"(?P<body>.*?)(<!-- end generated -->)",
    re.S,
)


def _hsdp_bytes() -> str:
    from fsdp_lab.hsdp import lab as hsdp
    from fsdp_lab.hsdp.lab import report

    result = hsdp.run(hsdp.HsdpConfig(world_size=4, steps=1, compare_pytorch=False))
    return (
        "`fsdp-lab hsdp --steps 1 --no-pytorch` (4 ranks, mesh 2,2, TinyGPT, fp32), bytes per "
        "step on rank 0:\n\n" + report.bytes_table(result) + "\n"
    )


TABLES: dict[str, Callable[[], str]] = {"hsdp-bytes": _hsdp_bytes}


def render(names: list[str] | None = None) -> dict[str, str]:
    """Each table's body from a fresh run (all of them, or `names`)."""
    return {name: TABLES[name]() for name in names or TABLES}


def blocks(text: str) -> dict[str, str]:
    """The generated blocks in `text`, name -> body."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare, do not write")
    args = parser.parse_args(argv)
    text = README.read_text()
    unknown = set(blocks(text)) - set(TABLES)
    if unknown:
        print(f"README.md has blocks no table makes: {sorted(unknown)}", file=sys.stderr)
        return 2
    fresh = render(list(blocks(text)))
    stale = [name for name, body in blocks(text).items() if fresh[name] != body]
    if args.check:
        for name in stale:
            print(f"README.md block {name!r} differs from a fresh run", file=sys.stderr)
        return 1 if stale else 0
    new = BLOCK.sub(lambda m: m.group(1) + fresh[m["name"]] + m.group(4), text)
    README.write_text(new)
    print(f"rewrote {len(fresh)} block(s): {', '.join(fresh)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
