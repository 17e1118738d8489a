"""Explorers show their measurement as ordinary outputs below their controls, a new run replaces
the old one in place, and a notebook exported to HTML shows the measurement, not widget reprs."""

from __future__ import annotations

import copy

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter


def _run(sources: list[str]):
    """The executed notebook, and a copy of each cell as it stood when it finished (a later
    cell's observer may replace its outputs): one kernel shows both states."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in sources]
    client = NotebookClient(nb, timeout=300, kernel_name="python3")
    client.widget_registry = {}  # as in test_notebooks: no Output-widget mirroring
    when_run: list = []
    client.on_cell_executed = lambda cell, **_: when_run.append(copy.deepcopy(cell))
    client.execute()
    return nb, when_run


def _kinds(cell) -> list[str]:
    kinds = []
    for out in cell.outputs:
        data = out.get("data", {})
        kind = "widget" if "application/vnd.jupyter.widget-view+json" in data else None
        kinds.append(kind or ("png" if "image/png" in data else "other"))
    return kinds


def test_a_slider_move_replaces_the_picture_below_the_controls_and_the_export_reads():
    setup = "%matplotlib inline\nfrom fsdp_lab.hsdp.lab.explorer import scaling_explorer\ne = scaling_explorer()\ne"
    nb, when_run = _run([setup, "e.params_b.value = 70"])  # the observer redraws into cell 0
    before = when_run[0]  # the first cell as it stood before the slider moved
    first = before.outputs[1]["data"]["image/png"]
    assert _kinds(before) == ["widget", "png"]  # the controls, then the picture below

    cell, moved = nb.cells[0], nb.cells[1]
    assert _kinds(cell) == ["widget", "png"]  # replaced, not appended
    assert cell.outputs[1]["data"]["image/png"] != first
    assert moved.outputs == []

    assert "params (B) = 70" in cell.outputs[0]["data"]["text/plain"]
    nb.metadata.pop("widgets", None)  # JupyterLab saves no widget state by default
    html, _ = HTMLExporter().from_notebook_node(nb)
    assert "VBox(" not in html and "HBox(" not in html
    assert "ScalingExplorer: params (B) = 70" in html  # the controls' settings, as text


def test_the_planners_verify_button_shows_its_whole_label():
    """Issue 39: in JupyterLab the button read "Verify on a fak…" (a fixed-width button)."""
    from fsdp_lab.planning.explorer import plan_explorer

    assert plan_explorer().button.layout.width == "auto"
