"""The weight-tying lab's wrap diagrams at notebook width: sibling units stacked (``rankdir``),
a run of alike block units drawn as first, one dashed box, last (``collapse_repeats``), and a
width cap (``max_width_in``) — without losing a unit, a tie or a parameter count."""

from __future__ import annotations

import re

import pytest
import torch

from fsdp_lab.diagrams import wrap_diagram
from fsdp_lab.diagrams.base import has_dot
from fsdp_lab.models import tiny_gpt
from fsdp_lab.tying.lab.figures import DIAGRAM_WIDTH_IN
from fsdp_lab.tying.lab.plans import as_units, tie_plans

NOTEBOOK = {"rankdir": "LR", "collapse_repeats": True, "max_width_in": DIAGRAM_WIDTH_IN}


def _model(layers: int) -> torch.nn.Module:
    with torch.device("meta"):
        return tiny_gpt(vocab_size=32768, dim=256, n_layers=layers, n_heads=4, seq_len=64)


def _clusters(source: str) -> list[str]:
    return re.findall(r'\tsubgraph "?(cluster_[^"\s]+)"? \{', source)


@pytest.mark.parametrize("layers", [4, 12])
def test_a_run_of_block_units_is_first_one_dashed_box_and_last(layers):
    model = _model(layers)
    plan = tie_plans(model)["joint_unit"]
    source = wrap_diagram(model, as_units(plan), **NOTEBOOK).source
    last = f"blocks.{layers - 1}"
    assert _clusters(source) == [  # units in module order; tok_emb comes first
        "cluster_root_unit",
        "cluster_unit_tok_emb+head",
        "cluster_unit_blocks.0",
        "cluster_alike_blocks.1",  # declared after its first unit: drawn in its place
        f"cluster_unit_{last}",
    ]
    middle = layers - 2
    per_block = sum(p.numel() for p in model.blocks[0].parameters())
    assert (
        f"units 'blocks.1' … 'blocks.{layers - 2}'\\n{middle} more like 'blocks.0',"
        f"\\n{per_block:,} params each"
    ) in source
    # No hidden block is drawn, and none is folded into the ModuleList's box (no count).
    hidden = "|".join(str(i) for i in range(1, layers - 1))
    assert not re.search(rf'^\t+"blocks\.({hidden})" \[', source, re.M)
    assert '\t\tblocks [label="blocks\\nModuleList"]' in source
    assert 'blocks -> "blocks.1 ... ' in source  # the dashed box hangs where the middle was
    # The tie, its unit and both edges are all still there.
    assert "tok_emb.weight\\n(32768, 256)\\nshared" in source
    assert "rankdir=LR" in source and f'size="{DIAGRAM_WIDTH_IN},100"' in source


def test_short_runs_and_units_holding_a_tie_are_not_collapsed():
    model = _model(3)  # three blocks: nothing saved by collapsing
    source = wrap_diagram(model, as_units(tie_plans(model)["root_unit"]), **NOTEBOOK).source
    assert "cluster_alike" not in source
    assert [c for c in _clusters(source) if c.startswith("cluster_unit_blocks")] == [
        f"cluster_unit_blocks.{i}" for i in range(3)
    ]
    # Default: every unit drawn, top to bottom, no size cap (the picture of test_diagrams.py).
    plain = wrap_diagram(_model(4), as_units(tie_plans(_model(4))["root_unit"])).source
    assert "cluster_alike" not in plain and "rankdir=TB" in plain and "graph [size=" not in plain


class _TiedEnds(torch.nn.Module):
    """Seven alike layers; the first and the last share a weight."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(7))
        self.layers[6].weight = self.layers[0].weight


def test_units_using_a_tie_stay_drawn_and_only_the_alike_run_between_collapses():
    units = [f"layers.{i}" for i in range(7)]
    source = wrap_diagram(_TiedEnds(), units, **NOTEBOOK).source
    assert _clusters(source) == [
        "cluster_root_unit",
        "cluster_unit_layers.0",
        "cluster_unit_layers.1",
        "cluster_alike_layers.2",
        "cluster_unit_layers.5",
        "cluster_unit_layers.6",
    ]
    assert "units 'layers.2' … 'layers.4'\\n3 more like 'layers.1'," in source
    tie = "shared layers.0.weight"
    assert f'"layers.0" -> "{tie}"' in source and f'"layers.6" -> "{tie}"' in source


def test_bad_layout_arguments_name_the_value():
    with pytest.raises(ValueError, match="rankdir='BT': expected 'TB' or 'LR'"):
        wrap_diagram(_model(4), rankdir="BT")
    with pytest.raises(ValueError, match="max_width_in=0: expected a number of inches > 0"):
        wrap_diagram(_model(4), max_width_in=0)


@pytest.mark.skipif(not has_dot(), reason="graphviz's dot is not installed")
@pytest.mark.parametrize("layers", [4, 32])
def test_the_lab_diagrams_fit_a_notebook_column(layers):
    model = _model(layers)
    for name, plan in tie_plans(model).items():
        svg = wrap_diagram(model, as_units(plan), title=name, **NOTEBOOK).svg()
        width_pt = float(re.search(r'<svg width="([\d.]+)pt"', svg).group(1))
        assert width_pt <= DIAGRAM_WIDTH_IN * 72 + 1, (name, width_pt)
