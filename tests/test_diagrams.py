"""The cluster diagram has the right parts, and a missing `dot` degrades to DOT source."""

from __future__ import annotations

import re
import shutil

import pytest

from fsdp_lab import diagrams
from fsdp_lab.diagrams import MISSING_DOT_MESSAGE, Diagram, cluster_diagram

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
    assert sorted(titles) == ["notebook", "rank0", "rank1", "rank2", "rank3", "store"]
    assert "gloo" in svg and "cuda:1" in svg and "127.0.0.1" in svg


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
