"""ipywidgets controls for the notebooks: pick a setting, press Run, see a fresh measurement.

Each explorer owns the clusters it starts (one per world size, reused while the explorer
lives) and closes them with `close()`, so re-running a notebook cell leaves no rank behind.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import display

from fsdp_lab.cluster import Cluster


class _Explorer:
    """A Run button over a set of controls; subclasses say what a run measures and draws."""

    def __init__(self, controls: list[W.Widget], backend: str = "auto") -> None:
        self.backend = backend
        self.controls = controls
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.output = W.Output()
        self.button.on_click(lambda _: self.refresh())
        self._clusters: dict[int, Cluster] = {}
        self.widget = W.VBox([W.HBox([*controls, self.button]), self.output])

    def cluster(self, n: int) -> Cluster:
        if n not in self._clusters:
            self._clusters[n] = Cluster(n, self.backend, verbose=False)
        return self._clusters[n]

    def refresh(self) -> None:
        self.button.disabled = True
        self.output.clear_output(wait=True)
        with self.output:
            try:
                self.show()
            finally:
                self.button.disabled = False

    def show(self) -> None:  # pragma: no cover - defined by subclasses
        raise NotImplementedError

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()
        self._clusters.clear()

    def _ipython_display_(self) -> None:
        display(self.widget)


class CollectivesExplorer(_Explorer):
    """World size and tensor size for lab 00; shows bytes vs theory and the memory trace."""

    def __init__(self, world_size: int = 2, numel: int = 1 << 16, backend: str = "auto") -> None:
        self.world_size = W.IntSlider(value=world_size, min=1, max=4, description="ranks")
        self.numel = W.SelectionSlider(
            options=[
                ("4 KiB", 1 << 10),
                ("256 KiB", 1 << 16),
                ("4 MiB", 1 << 20),
                ("16 MiB", 1 << 22),
            ],
            value=numel,
            description="shard",
        )
        super().__init__([self.world_size, self.numel], backend)
        self.last_result: Any = None

    def show(self) -> None:
        from fsdp_lab.labs import collectives
        from fsdp_lab.plots import plot_measured_vs_theory, plot_memory_trace

        n = self.world_size.value
        config = collectives.CollectivesConfig(world_size=n, numel=self.numel.value, repeats=3)
        result = collectives.run(config, cluster=self.cluster(n))
        self.last_result = result
        display(
            plot_measured_vs_theory(
                result["comm_bytes_per_rank"][0],
                result["theory_comm_bytes"],
                title=f"{n} ranks: bytes per rank per call, measured vs (N-1)/N formulas",
            )
        )
        display(plot_memory_trace(result["memory_traces"], title="live bytes on each rank"))


def collectives_explorer(world_size: int = 2, numel: int = 1 << 16) -> CollectivesExplorer:
    """Controls for world size and shard size; press Run to measure the four collectives."""
    return CollectivesExplorer(world_size, numel)


class ShardExplorer(_Explorer):
    """World size, strategy and prefetch for lab 01; shows memory, bytes, summary, timeline."""

    def __init__(
        self,
        world_size: int = 2,
        strategy: str = "full",
        prefetch: bool = True,
        steps: int = 3,
        backend: str = "auto",
    ) -> None:
        from fsdp_lab.sharding import STRATEGIES

        self.world_size = W.IntSlider(value=world_size, min=1, max=4, description="ranks")
        self.strategy = W.Dropdown(options=list(STRATEGIES), value=strategy, description="strategy")
        self.prefetch = W.Checkbox(value=prefetch, description="prefetch")
        self.steps = steps
        super().__init__([self.world_size, self.strategy, self.prefetch], backend)
        self.last_result: Any = None

    def show(self) -> None:
        from IPython.display import Markdown

        from fsdp_lab.labs import shard

        n = self.world_size.value
        config = shard.ShardConfig(
            world_size=n,
            strategy=self.strategy.value,
            prefetch=self.prefetch.value,
            steps=self.steps,
            compare_fsdp2=False,
            backend=self.backend,
        )
        result = shard.run(config, cluster=self.cluster(n))
        self.last_result = result
        figures = shard.figures(result)
        display(figures["memory_trace"])
        display(figures["bytes_vs_theory"])
        display(Markdown(shard.summary(result)))
        display(figures["timeline"])


def shard_explorer(
    world_size: int = 2, strategy: str = "full", prefetch: bool = True
) -> ShardExplorer:
    """Controls for ranks, strategy and prefetch; press Run to train and measure 3 steps."""
    return ShardExplorer(world_size, strategy, prefetch)
