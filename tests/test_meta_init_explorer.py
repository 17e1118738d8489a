"""Lab 04's explorer: one run on the notebook's ranks returns the host-memory picture and both
tables with their sentences (written from that run), and closing it leaves those ranks alive."""

from __future__ import annotations

import pytest
from IPython.display import Markdown
from matplotlib.figure import Figure

from fsdp_lab.meta_init.lab import explorer as widgets


def test_a_run_on_shared_ranks_draws_the_picture_and_the_sentences(cluster_of):
    shared = cluster_of(2)
    explorer = widgets.meta_init_explorer(model_mb=16, world_size=2, cluster=shared)
    assert explorer.cluster(2) is shared  # no new rank processes for the notebook's size
    outputs = explorer.draw()
    assert len(outputs) <= explorer.SLOTS
    figure, memory, agreement = outputs
    assert isinstance(figure, Figure) and len(figure.axes) == 2  # one panel per rank
    assert isinstance(memory, Markdown) and isinstance(agreement, Markdown)
    assert "resident memory at its peak" in memory.data and "after `malloc_trim`" in memory.data
    row = explorer.last_result["agreement"]
    sync, det = row["sync_module_states"]["time_s"], row["deterministic"]["time_s"]
    if abs(sync - det) > 0.1 * max(sync, det):  # the sentence names this run's faster approach
        faster = "`DeterministicInit`" if det < sync else "`sync_module_states`"
        assert f": {faster} was " in agreement.data
    explorer.close()
    assert shared.run(sum, [1, 2]) == [3, 3]  # the shared ranks are still up


def test_a_size_the_explorer_does_not_offer_is_refused_with_the_nearest():
    with pytest.raises(ValueError, match=r"model_mb=60: the explorer offers .* Fix: model_mb=64"):
        widgets.MetaInitExplorer(model_mb=60)
