"""What the learner reads cites only what the learner has: every file path and notebook name in
the README, docs/, the notebooks and the package's own text exists in this repository; nothing
names a Markdown file the repository does not hold (a note kept elsewhere) or the issue tracker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(
    r"(?<![\w/.<])((?:notebooks|fsdp_lab|docs|scripts|benchmarks|tests)/[\w./-]*\w\.(?:ipynb|py|md|sh|json|yml|toml))"
)
NOTEBOOK = re.compile(r"(?<![\w/])(\d\d_[a-z_]+\.ipynb)")
# A note's name, in capitals like README.md (what a run writes, summary.md, is lower case).
MARKDOWN = re.compile(r"(?<![\w.-])([A-Z][A-Z_-]*\.md)\b")
TRACKER = re.compile(r"\b(?:issue|Issue) \d+\b")


def _reader_texts() -> dict[str, str]:
    """README, docs and every notebook's cells: what a learner reads."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    texts |= {str(p.relative_to(ROOT)): p.read_text() for p in (ROOT / "docs").glob("*.md")}
    for nb in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        cells = json.loads(nb.read_text())["cells"]
        texts[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    return texts


def _package_texts() -> dict[str, str]:
    files = [
        *(ROOT / "fsdp_lab").rglob("*.py"),
        *(ROOT / "scripts").glob("*"),
        *(ROOT / "tests").glob("*.py"),
    ]
    return {str(p.relative_to(ROOT)): p.read_text() for p in files if p.is_file()}


def _missing(text: str) -> list[str]:
    notebooks = {p.name for p in (ROOT / "notebooks").rglob("*.ipynb")}
    held = {p.name for p in [*ROOT.glob("*.md"), *(ROOT / "docs").glob("*.md")]}
    gone = [p for p in PATH.findall(text) if not (ROOT / p).exists()]
    gone += [n for n in NOTEBOOK.findall(text) if n not in notebooks]
    return gone + [m for m in MARKDOWN.findall(text) if m not in held]


@pytest.mark.parametrize("name", sorted(_reader_texts()))
def test_what_a_learner_reads_names_only_files_that_exist(name):
    text = _reader_texts()[name]
    assert not _missing(text), f"{name} names files this repository does not have"
    assert not TRACKER.findall(text), f"{name} cites the issue tracker"


def test_the_package_cites_no_file_it_does_not_have():
    for name, text in _package_texts().items():
        if name == "tests/test_references.py":
            continue
        assert not _missing(text), (name, _missing(text))


def test_the_guard_would_catch_a_wrong_name():
    assert _missing("see `notebooks/01_shard.ipynb` and 02_activation_checkpointing.ipynb") == [
        "notebooks/01_shard.ipynb",  # the old name of notebooks/01_sharding.ipynb
        "02_activation_checkpointing.ipynb",
    ]
    assert _missing("as NOTES.md and ../notes/PLAN.md say") == [
        "NOTES.md",
        "PLAN.md",
    ]  # notes kept elsewhere
    assert _missing("see `notebooks/01_sharding.ipynb`, fsdp_lab/theory.py, README.md") == []


CORRECTED = [  # sentences a review found false in the regime they were printed in (issue 25)
    "files them under `comm_buffers`",
    "is a little under 4Ψ",
    "are N/C of them",
    "and nothing says so",
    "(FSDP1's flag): rank 0 materialises",
    "each rank allocates only what it keeps",
    "HSDP stays far above FSDP once there are several nodes",
    "a second gathered unit beside the computing one",
    "the default 3 stages do not",
    "until the ranks get a process group of their own",
]


def test_corrected_sentences_stay_corrected():
    texts = {**_reader_texts(), **_package_texts()}
    texts.pop("tests/test_references.py")
    for name, text in texts.items():
        back = [s for s in CORRECTED if s in text]
        assert not back, f"{name} says again what was found false: {back}"
