"""The collectives lab's explorer: world size and tensor size under controls; Run measures
bytes per rank beside the formulas, and the memory trace.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from fsdp_lab.collectives.lab.config import CollectivesConfig
from fsdp_lab.explorer import MAX_RANKS, Explorer, choice, control


class CollectivesExplorer(Explorer):
    """World size and tensor size for lab 00; shows bytes vs theory and the memory trace."""

    def __init__(self, world_size: int = 2, numel: int = 1 << 16, backend: str = "auto") -> None:
        self.world_size = control(
            CollectivesConfig, "world_size", world_size, "ranks", max=MAX_RANKS
        )
        sizes = [("4 KiB", 1 << 10), ("256 KiB", 1 << 16), ("4 MiB", 1 << 20), ("16 MiB", 1 << 22)]
        self.numel = choice("numel", sizes, numel, "shard", W.SelectionSlider)
        super().__init__([self.world_size, self.numel], backend)
        self.last_result: Any = None

    SLOTS = 2

    def draw(self) -> list[Any]:
        from fsdp_lab.collectives import lab as collectives
        from fsdp_lab.plots import plot_measured_vs_theory, plot_memory_trace

        n = self.world_size.value
        config = collectives.CollectivesConfig(world_size=n, numel=self.numel.value, repeats=3)
        result = collectives.run(config, cluster=self.cluster(n))
        self.last_result = result
        return [
            plot_measured_vs_theory(
                result["comm_bytes_per_rank"][0],
                result["theory_comm_bytes"],
                title=f"{n} ranks: bytes per rank per call, measured vs (N-1)/N formulas",
            ),
            plot_memory_trace(result["memory_traces"], title="live bytes on each rank"),
        ]


def collectives_explorer(world_size: int = 2, numel: int = 1 << 16) -> CollectivesExplorer:
    """Controls for world size and shard size; press Run to measure the four collectives."""
    return CollectivesExplorer(world_size, numel)
