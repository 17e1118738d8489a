"""The cluster and wrap-boundary diagrams have the right parts, and a missing `dot` degrades to
DOT source."""

from __future__ import annotations

import html
import re
import shutil

import pytest
import torch
import torch.nn as nn
from test_tying import _SharedStorage

from fsdp_lab import diagrams
from fsdp_lab.diagrams import (
    MISSING_DOT_MESSAGE,
    Diagram,
    cluster_diagram,
    pipeline_diagram,
    wrap_diagram,
)
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.pipeline import PipeGPT, PipeGPTConfig, stage_module_names
from fsdp_lab.pipeline.rng import STRATEGIES, record_init_order
from fsdp_lab.sharding.wrap import PlanError, build_plan, unit_sizes

needs_dot = pytest.mark.skipif(shutil.which("dot") is None, reason="graphviz `dot` not installed")


@pytest.fixture
def no_dot(monkeypatch, tmp_path):
    """A PATH without `dot` (an empty directory), as on a machine without the OS package."""
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    diagrams._explain_missing_dot_once.cache_clear()
    yield
    diagrams._explain_missing_dot_once.cache_clear()


@needs_dot
def test_svg_has_one_node_per_rank_plus_notebook_and_store():
    svg = cluster_diagram(4, "gloo", ["cpu", "cpu", "cuda:0", "cuda:1"]).svg()
    assert svg is not None and "<svg" in svg
    titles = re.findall(r'<g id="node\d+" class="node">\s*<title>([^<]+)</title>', svg)
    assert sorted(titles) == [
        "forkserver",
        "notebook",
        "rank0",
        "rank1",
        "rank2",
        "rank3",
        "store",
    ]
    assert "gloo" in svg and "cuda:1" in svg and "rendezvous file" in svg
    assert "127.0.0.1" not in svg and "TCPStore" not in svg  # nothing listens on a port


@needs_dot
def test_mimebundle_and_save_with_dot(tmp_path):
    d = cluster_diagram(2, "gloo")
    bundle = d._repr_mimebundle_()
    assert "<svg" in bundle["image/svg+xml"]
    assert set(d._repr_mimebundle_(include=["text/plain"])) == {"text/plain"}
    out = d.save(tmp_path / "figs" / "cluster")
    assert out == tmp_path / "figs" / "cluster.svg"
    assert "<svg" in out.read_text()


def test_ring_edges_among_ranks():
    # n ranks on a ring have n links; two ranks have one link, one rank none.
    for world_size, links in ((1, 0), (2, 1), (3, 3), (8, 8)):
        source = cluster_diagram(world_size, "gloo").source
        assert source.count("penwidth=2") == links
        assert len(re.findall(r"notebook -> rank\d+", source)) == world_size  # one pipe each
        assert len(re.findall(r"forkserver -> rank\d+", source)) == 1  # to the group's box
        # Issue 39: one dotted line per rank crossed the group's label and each other; the
        # rendezvous line goes to the group's box too, and the label sits under the ranks.
        assert len(re.findall(r"store -> rank\d+", source)) == 1
        assert "labelloc=b" in source
        assert f"process group (gloo, world_size={world_size})" in source


def test_without_dot_shows_source_and_one_line_note(no_dot, tmp_path, capsys):
    d = cluster_diagram(3, "nccl", ["cuda:0", "cuda:1", "cuda:2"])
    assert not diagrams.has_dot()
    assert d.svg() is None
    bundle = d._repr_mimebundle_()
    assert "image/svg+xml" not in bundle
    assert "\n" not in MISSING_DOT_MESSAGE  # one line
    for text in (bundle["text/plain"], bundle["text/markdown"]):
        assert text.startswith(MISSING_DOT_MESSAGE) and d.source in text
    assert "```dot\n" in bundle["text/markdown"]

    first = d.save(tmp_path / "a")
    second = d.save(tmp_path / "b.svg")  # the suffix is replaced, not doubled
    assert (first, second) == (tmp_path / "a.dot", tmp_path / "b.dot")
    assert first.read_text() == d.source
    # The explanation is printed once, not once per save.
    assert capsys.readouterr().out.count(MISSING_DOT_MESSAGE) == 1


def test_diagram_of_any_dot_source_without_dot(no_dot):
    d = Diagram("digraph { a -> b }")
    assert d._repr_mimebundle_(exclude=["text/markdown"]) == {
        "text/plain": f"{MISSING_DOT_MESSAGE}\n\ndigraph {{ a -> b }}"
    }


def test_invalid_arguments_name_the_value():
    with pytest.raises(ValueError, match="world_size must be >= 1, got 0"):
        cluster_diagram(0, "gloo")
    with pytest.raises(ValueError, match="2 devices for world_size 3"):
        cluster_diagram(3, "gloo", ["cpu", "cpu"])


# -- wrap_diagram ------------------------------------------------------------------------------

BLOCKS = [f"blocks.{i}" for i in range(4)]
TIED = "shared tok_emb.weight"  # the ellipse of TinyGPT's tied embedding/head weight


def _clusters(source: str) -> dict[str, tuple[str, set[str]]]:
    """cluster name -> (its label, the node ids declared in it), read from the DOT source."""
    clusters = {}
    for m in re.finditer(r'\tsubgraph "?(cluster_[^"\s]+)"? \{\n(.*?)\n\t\}', source, re.S):
        body = m.group(2)
        label = re.search(r'label="([^"]*)"', body.splitlines()[0]).group(1)
        nodes = set(re.findall(r'^\t\t"?([^"\[]+?)"? \[', body, re.M))
        clusters[m.group(1)] = (label, nodes)
    return clusters


def _edges(source: str) -> list[tuple[str, str, str]]:
    """(tail, head, attributes) of every edge."""
    pattern = r'^\t+"?([^"]+?)"? -> "?([^"\[]+?)"?(?: \[(.*)\])?$'
    return re.findall(pattern, source, re.M)


def _red_dashed(source: str) -> set[tuple[str, str]]:
    return {(t, h) for t, h, attrs in _edges(source) if "color=red" in attrs and "dashed" in attrs}


def _graph_label(source: str) -> str:
    return re.search(r'^\tgraph \[.*?label="([^"]*)"', source, re.M).group(1)


def test_block_units_one_cluster_each_and_the_tie_inside_the_root_unit():
    model = tiny_gpt()
    source = wrap_diagram(model, {Block}).source
    clusters = _clusters(source)
    assert list(clusters) == ["cluster_root_unit", *(f"cluster_unit_{b}" for b in BLOCKS)]
    root_label, root_nodes = clusters["cluster_root_unit"]
    assert {"tok_emb", "head", TIED} <= root_nodes and not root_nodes & set(BLOCKS)
    for b in BLOCKS:
        assert clusters[f"cluster_unit_{b}"][1] == {b}  # its submodules folded into it
    assert "blocks.0.attn" not in source  # deeper than max_depth=2 and no unit root: folded
    assert "12,704 params\\n(+8 submodules inside)" in source
    # Cluster labels count what each unit gathers: the same numbers as the plan.
    sizes = unit_sizes(build_plan(model, {Block}), model)
    assert root_label == f"root unit · {sizes['']:,} params"
    for b in BLOCKS:
        assert clusters[f"cluster_unit_{b}"][0] == f"unit {b!r} · {sizes[b]:,} params"
    assert "tok_emb.weight\\n(64, 32)\\nshared" in source
    assert {(t, h) for t, h, _ in _edges(source) if h == TIED} == {
        ("tok_emb", TIED),
        ("head", TIED),
    }
    assert _red_dashed(source) == set()
    assert _graph_label(source).endswith("valid: every tie inside one unit")


def test_head_alone_is_drawn_invalid_with_red_edges_to_both_owners():
    model = tiny_gpt()
    with pytest.raises(PlanError):
        build_plan(model, ["head"])  # the plan the picture explains is one wrap refuses
    source = wrap_diagram(model, ["head"]).source  # ... but drawing it must not raise
    clusters = _clusters(source)
    assert set(clusters) == {"cluster_root_unit", "cluster_unit_head"}
    assert clusters["cluster_unit_head"][1] == {"head"}
    assert "tok_emb" in clusters["cluster_root_unit"][1]
    assert all(TIED not in nodes for _, nodes in clusters.values())  # no unit can hold it
    assert _red_dashed(source) == {("tok_emb", TIED), ("head", TIED)}
    assert 'label="own copy in root unit"' in source
    assert "label=\"own copy in unit 'head'\"" in source
    label = _graph_label(source)
    assert "INVALID: tok_emb.weight is tied across units '' and 'head'" in label
    # Each unit gathers its own copy, so both clusters count the tied 64 x 32 weight.
    assert clusters["cluster_unit_head"][0] == "unit 'head' · 2,048 params"


def test_a_group_unit_holds_embedding_head_and_their_tie():
    source = wrap_diagram(tiny_gpt(), [("tok_emb", "head"), *BLOCKS]).source
    clusters = _clusters(source)
    label, nodes = clusters["cluster_unit_tok_emb+head"]
    assert nodes == {"tok_emb", "head", TIED}
    assert label == "unit 'tok_emb+head' · 2,048 params"  # the tie counted once
    assert len(clusters) == 6 and "tok_emb" not in clusters["cluster_root_unit"][1]
    assert _red_dashed(source) == set()
    assert _graph_label(source).endswith("valid: every tie inside one unit")


def test_storage_tie_is_an_ellipse_linked_to_both_owners():
    tie = "shared first.weight ~ second.b"
    source = wrap_diagram(_SharedStorage()).source
    assert "first.weight (2, 4)\\nsecond.b (4,)\\nshared storage" in source
    assert tie in _clusters(source)["cluster_root_unit"][1]
    assert {(t, h) for t, h, _ in _edges(source) if h == tie} == {("first", tie), ("second", tie)}
    split = wrap_diagram(_SharedStorage(), ["second"]).source
    assert _red_dashed(split) == {("first", tie), ("second", tie)}
    assert "INVALID: first.weight ~ second.b is tied across units '' and 'second'" in split


def test_deep_unit_roots_are_drawn_and_their_parents_fold_the_rest():
    source = wrap_diagram(tiny_gpt(), ["blocks.0.attn"]).source
    clusters = _clusters(source)
    assert clusters["cluster_unit_blocks.0.attn"][1] == {"blocks.0.attn"}
    assert "blocks.0" in clusters["cluster_root_unit"][1]
    # blocks.0 keeps ln1, ln2, mlp (5 modules, 8,480 params); attn is drawn in its own unit.
    assert "blocks.0\\nBlock\\n8,480 params\\n(+5 submodules inside)" in source
    assert ("blocks.0", "blocks.0.attn", "") in _edges(source)
    # max_depth=0 folds pos_emb and ln_f into the model, but a tie's users stay boxes of their
    # own (its edges must land on them) and so do the unit roots.
    only_root = _clusters(wrap_diagram(tiny_gpt(), {Block}, max_depth=0).source)
    assert only_root["cluster_root_unit"][1] == {"(model)", "blocks", "tok_emb", "head", TIED}
    assert only_root["cluster_unit_blocks.3"][1] == {"blocks.3"}


def test_other_plan_problems_are_drawn_and_non_plans_raise():
    label = _graph_label(wrap_diagram(tiny_gpt(), ["blocks"]).source)
    assert "INVALID: wrap unit 'blocks' is a ModuleList" in label
    assert _graph_label(wrap_diagram(nn.Linear(2, 2)).source).endswith("no tied parameters")
    with pytest.raises(PlanError, match="did you mean \\['head'\\]"):
        wrap_diagram(tiny_gpt(), ["hed"])
    with pytest.raises(PlanError, match="is not a plan"):
        wrap_diagram(tiny_gpt(), 42)
    with pytest.raises(ValueError, match="max_depth must be >= 0, got -1"):
        wrap_diagram(tiny_gpt(), max_depth=-1)


@needs_dot
def test_wrap_diagram_svg_has_the_unit_clusters(tmp_path):
    d = wrap_diagram(tiny_gpt(), ["head"], title="embedding and head split")
    svg = d.svg()
    titles = re.findall(r'<g id="clust\d+" class="cluster">\s*<title>([^<]+)</title>', svg)
    assert titles == ["cluster_root_unit", "cluster_unit_head"]
    text = html.unescape(svg)
    assert "embedding and head split" in text and "own copy in unit 'head'" in text
    assert d.save(tmp_path / "wrap").suffix == ".svg"


def test_wrap_diagram_saves_dot_without_dot(no_dot, tmp_path):
    d = wrap_diagram(tiny_gpt(), {Block})
    out = d.save(tmp_path / "wrap.svg")
    assert out == tmp_path / "wrap.dot" and out.read_text() == d.source


# -- pipeline_diagram --------------------------------------------------------------------------

PIPE = PipeGPTConfig(n_layers=6)


def _handoffs(source: str) -> list[tuple[str, str]]:
    return [(t, h) for t, h, attrs in _edges(source) if "handoff" in attrs]


class _HeadFirst(PipeGPT):
    """init_weights draws the head before everything else: the order is not the layout's."""

    def init_modules(self):
        mods = super().init_modules()
        return [m for m in mods if m[0] == "head"] + [m for m in mods if m[0] != "head"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pipeline_diagram_has_one_cluster_per_stage_holding_its_modules(strategy):
    source = pipeline_diagram(PIPE, 3, [1, 3, 2], strategy=strategy, dp=2).source
    clusters = _clusters(source)
    assert list(clusters) == ["cluster_stage_0", "cluster_stage_1", "cluster_stage_2"]
    for s, ranks in enumerate(("0, 3", "1, 4", "2, 5")):  # rank = dp_rank * S + stage
        label, nodes = clusters[f"cluster_stage_{s}"]
        assert label == f"stage {s} · ranks {ranks}"
        assert nodes == set(stage_module_names(PIPE, s, 3, [1, 3, 2]))
    assert f"{strategy}: S=3 stages x dp=2 on 6 ranks" in _graph_label(source)


@pytest.mark.parametrize("stages, split", [(2, None), (3, [1, 3, 2]), (6, None)])
def test_rng_replay_draws_one_handoff_per_owner_change_of_the_recorded_order(stages, split):
    source = pipeline_diagram(PIPE, stages, split, strategy="rng_replay").source
    with torch.device("meta"):
        order = record_init_order(PipeGPT(PIPE))
    owner = {n: s for s in range(stages) for n in stage_module_names(PIPE, s, stages, split)}
    top = [owner[".".join(n.split(".")[:2]) if n.startswith("layers") else n] for n in order]
    changes = sum(a != b for a, b in zip(top, top[1:], strict=False))
    assert len(_handoffs(source)) == changes == stages - 1
    firsts = [stage_module_names(PIPE, s, stages, split) for s in range(stages)]
    # Each handoff goes from a stage's last module to the next stage's first.
    assert _handoffs(source) == [(firsts[s][-1], firsts[s + 1][0]) for s in range(stages - 1)]
    assert f"({torch.get_rng_state().numel():,} B on CPU)" in source


def test_rng_replay_diagram_follows_the_recorded_order_not_the_layout():
    source = pipeline_diagram(PIPE, 2, strategy="rng_replay", model_cls=_HeadFirst).source
    # head (stage 1) -> tok_emb ... layers.2 (stage 0) -> layers.3 ... norm: two handoffs.
    assert _handoffs(source) == [("head", "tok_emb"), ("layers.2", "layers.3")]
    assert ("seed", "head", 'label="draws head first" color="#B07A00"') in _edges(source)


def test_seed_checkpoint_diagram_draws_the_file_and_a_load_per_stage():
    source = pipeline_diagram(PIPE, 3, strategy="seed_checkpoint").source
    assert re.search(
        r'checkpoint \[label="pp_seed_checkpoint\.pt\\n[\d,]+ B".*shape=cylinder', source
    )
    loads = [(t, h) for t, h, attrs in _edges(source) if t == "checkpoint"]
    assert loads == [
        ("checkpoint", "tok_emb"),
        ("checkpoint", "layers.2"),
        ("checkpoint", "layers.4"),
    ]
    assert ("rank 0 init", "checkpoint") in {(t, h) for t, h, _ in _edges(source)}
    assert _handoffs(source) == []


def test_same_seed_and_per_stage_seed_diagrams():
    same = pipeline_diagram(PIPE, 3, strategy="same_seed").source
    red = {(t, h) for t, h, attrs in _edges(same) if "color=red" in attrs}
    assert red == {("tok_emb", "layers.2"), ("layers.2", "layers.4")}
    per = pipeline_diagram(PIPE, 3, strategy="per_stage_seed").source
    sent = [a for t, _, a in _edges(per) if t == "seeds"]
    assert len(sent) == 3 and all("broadcast" in a for a in sent)


def test_pipeline_diagram_refuses_bad_input():
    with pytest.raises(ValueError, match=r"strategy='replay' is unknown: allowed \['seed_ch"):
        pipeline_diagram(PIPE, 2, strategy="replay")
    with pytest.raises(ValueError, match="S=7 stages for L=6 layers: allowed 1..6"):
        pipeline_diagram(PIPE, 7)
    with pytest.raises(ValueError, match="dp=0 is out of range"):
        pipeline_diagram(PIPE, 2, dp=0)


@needs_dot
def test_pipeline_diagram_renders(tmp_path):
    d = pipeline_diagram(PIPE, 3, strategy="rng_replay")
    titles = re.findall(r'<g id="clust\d+" class="cluster">\s*<title>([^<]+)</title>', d.svg())
    assert titles == ["cluster_stage_0", "cluster_stage_1", "cluster_stage_2"]
    assert d.save(tmp_path / "pipe").suffix == ".svg"


def test_the_parallelism_map_marks_what_is_not_built_and_fits_a_notebook():
    from fsdp_lab.diagrams import parallelism_diagram

    dot = parallelism_diagram(4, layers=6).source
    assert dot.count("theory only: not built here") == 2  # context and tensor
    assert "size=9.5" in dot and "layers 0..1" in dot and "layers 4..4" in dot
    assert dot.count("rank 3") == 4  # one box per rank and strategy
    with pytest.raises(ValueError, match="n=0"):
        parallelism_diagram(0)
