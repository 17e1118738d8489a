"""Every notebook in notebooks/ runs headless, top to bottom, in a real Jupyter kernel."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# The first test's setup runs all nine notebooks (about 250 s here, two at a time): the suite's
# 300 s per test is a limit for one test, not for nine notebooks; a hung cell still stops at 900.
pytestmark = pytest.mark.timeout(900)


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_collectives.ipynb"]


def _execute(path: Path, folder: Path) -> tuple[object, float]:
    """`path` run top to bottom in a fresh kernel, in `folder`: the executed notebook (or the
    error it raised) and its seconds."""
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
    )
    # nbclient mirrors Output widgets by messaging the kernel while it waits for the same cell's
    # reply, which can stall until the cell timeout (jupyter/nbclient#312). Without the mirror,
    # what an Output widget captures is recorded as ordinary cell output.
    client.widget_registry = {}
    start = time.perf_counter()
    try:
        client.execute()  # raises CellExecutionError, naming the cell, on any error
    except Exception as exc:  # reported by that notebook's test
        return exc, time.perf_counter() - start
    return nb, time.perf_counter() - start


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Every notebook run top to bottom, two at a time: much of a notebook's time is its kernel
    and its ranks starting and waiting on each other, which two notebooks overlap on two cores.
    (The times a notebook prints are then measured beside another notebook: its sentences are
    built from what it measured, whichever way that goes.)"""
    folders = {p.name: tmp_path_factory.mktemp(p.stem) for p in NOTEBOOKS}
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = pool.map(lambda p: _execute(p, folders[p.name]), NOTEBOOKS)
        return dict(zip([p.name for p in NOTEBOOKS], runs, strict=True))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path, executed, record_property):
    committed = nbformat.read(path, as_version=4)
    stale = [i for i, c in enumerate(committed.cells) if c.cell_type == "code" and c.get("outputs")]
    assert not stale, f"{path.name} is committed with outputs in cells {stale}: clear them"
    nb, seconds = executed[path.name]
    if isinstance(nb, Exception):
        raise nb
    record_property("notebook_seconds", (f"{path.name} (two at a time)", seconds))
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    # No warning reaches the learner as a red stderr box (more ranks than cores: a calm note).
    red = [o["text"] for o in outputs if o.get("name") == "stderr" and "Warning" in o["text"]]
    assert not red, f"{path.name} shows warnings on stderr: {red}"
    # The notebook draws what it measured: at least one picture came out.
    assert any("image/png" in o.get("data", {}) for o in outputs)
    # Saved from JupyterLab, a notebook keeps no widget state by default; exported to HTML it
    # must still read: every explorer's measurement as ordinary output, no widget reprs.
    nb.metadata.pop("widgets", None)
    html, _ = HTMLExporter().from_notebook_node(nb)
    leaked = [w for w in ("VBox(", "HBox(", "Output(", "IntSlider(") if w in html]
    assert not leaked, f"{path.name} exported to HTML shows widget reprs: {leaked}"
