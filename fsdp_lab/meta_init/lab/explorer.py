"""The meta-init lab's explorer: model size and world size under controls; the host-memory
picture and the two ways ranks agree on values.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import Markdown

from fsdp_lab.cluster import Cluster
from fsdp_lab.explorer import MAX_RANKS, Explorer, choice, control
from fsdp_lab.meta_init.lab.config import MetaInitConfig


class MetaInitExplorer(Explorer):
    """Model size and world size for lab 04: the host-memory picture and both ways to agree.

    A run builds the lab's Llama of the chosen size on every rank three ways (ordinary, meta +
    unit-by-unit init, meta + `DeterministicInit` slices) under an `RssSampler` and a
    `MemoryTracker`, then shards it with `sync_module_states` and with `DeterministicInit`,
    each checked bitwise against one process; what the numbers say is written from them
    (`report.memory_text`, `report.agreement_time_text`). The ordinary build needs about
    (ranks + 1) x size of host memory; the lab refuses a size that would not fit.

    Args:
        model_mb: the starting size, one of `SIZES` (MiB of fp32 parameters).
        world_size: the starting number of ranks (1-4).
        seed: the init seed.
        backend: the ranks' backend for clusters the explorer starts.
        cluster: ranks to reuse when the chosen world size is theirs (the notebook's, so that a
            run does not start new processes); the explorer never closes them.
    """

    SIZES = (("16 MiB", 16), ("64 MiB", 64), ("256 MiB", 256), ("512 MiB", 512), ("1 GiB", 1024))
    SLOTS = 3

    def __init__(
        self,
        model_mb: int = 64,
        world_size: int = 2,
        seed: int = 0,
        backend: str = "auto",
        cluster: Cluster | None = None,
    ) -> None:
        self.model_mb = choice("model_mb", list(self.SIZES), model_mb, "model", W.SelectionSlider)
        self.world_size = control(MetaInitConfig, "world_size", world_size, "ranks", max=MAX_RANKS)
        self.seed = seed
        super().__init__([self.model_mb, self.world_size], backend, cluster)
        self.last_result: dict[str, Any] | None = None

    def draw(self) -> list[Any]:
        from fsdp_lab.meta_init.lab import analysis, measure, report
        from fsdp_lab.meta_init.lab.figures import rss_figure

        n, mb = self.world_size.value, self.model_mb.value
        cluster = self.cluster(n)
        memory = analysis.materialisation(measure.measure_materialisation(mb, self.seed, cluster))
        row = analysis.agreement_row(measure.measure_size(mb, self.seed, cluster))
        self.last_result = {"materialise": memory, "agreement": row}
        return [
            rss_figure(memory),
            Markdown(report.memory_table(memory) + "\n\n" + report.memory_text(memory)),
            Markdown(report.agreement_table([row]) + "\n\n" + report.agreement_time_text([row])),
        ]


def meta_init_explorer(
    model_mb: int = 64, world_size: int = 2, cluster: Cluster | None = None
) -> MetaInitExplorer:
    """Controls for model size and ranks; press Run to build, shard and compare the ranks.
    `cluster`: the notebook's ranks, reused for their world size."""
    return MetaInitExplorer(model_mb, world_size, cluster=cluster)
