"""Every notebook in notebooks/ runs headless, top to bottom, in a real Jupyter kernel."""

from __future__ import annotations

import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbconvert import HTMLExporter

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS][:1] == ["00_collectives.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes_without_errors(path, tmp_path, record_property):
    nb = nbformat.read(path, as_version=4)
    stale = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.get("outputs")]
    assert not stale, f"{path.name} is committed with outputs in cells {stale}: clear them"
    client = NotebookClient(
        nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    # nbclient mirrors Output widgets by messaging the kernel while it waits for the same cell's
    # reply, which can stall until the cell timeout (jupyter/nbclient#312). Without the mirror,
    # what an Output widget captures is recorded as ordinary cell output.
    client.widget_registry = {}
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    record_property("notebook_seconds", (path.name, time.perf_counter() - start))
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
