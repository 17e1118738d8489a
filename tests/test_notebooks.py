"""Every notebook in notebooks/ runs headless, top to bottom, in a real Jupyter kernel."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
# Nine whole lab runs, about 300 s here: end-to-end runs whose pieces (each lab's run, figures,
# sentences, explorers) the labs' own tests cover; CI makes them after the suite (`pytest -m
# e2e`). The first test's setup runs all nine: the 300 s per test is a limit for one test, not
# for nine notebooks; a hung cell still stops at 900.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


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
    """Every notebook run top to bottom, one at a time, as a learner runs them: two at once on two
    cores took longer in all (396 s against 313 s here), each notebook's ranks and the other's
    contending for the cores, and its times measured that contention."""
    return {p.name: _execute(p, tmp_path_factory.mktemp(p.stem)) for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path, executed, record_property):
    committed = nbformat.read(path, as_version=4)
    stale = [i for i, c in enumerate(committed.cells) if c.cell_type == "code" and c.get("outputs")]
    assert not stale, f"{path.name} is committed with outputs in cells {stale}: clear them"
    nb, seconds = executed[path.name]
    if isinstance(nb, Exception):
        raise nb
    record_property("notebook_seconds", (path.name, seconds))
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
