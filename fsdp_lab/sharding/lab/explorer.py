"""The sharding lab's explorer: world size, strategy and prefetch under controls; Run measures
memory, bytes and the timeline on live ranks.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import Markdown

from fsdp_lab.explorer import Explorer


class ShardExplorer(Explorer):
    """World size, strategy and prefetch for lab 01; shows memory, bytes, summary, timeline."""

    def __init__(
        self,
        world_size: int = 2,
        strategy: str = "full",
        prefetch: bool = True,
        steps: int = 3,
        backend: str = "auto",
    ) -> None:
        from fsdp_lab.choices import SHARDING_STRATEGIES as STRATEGIES

        self.world_size = W.IntSlider(value=world_size, min=1, max=4, description="ranks")
        self.strategy = W.Dropdown(options=list(STRATEGIES), value=strategy, description="strategy")
        self.prefetch = W.Checkbox(value=prefetch, description="prefetch")
        self.steps = steps
        super().__init__([self.world_size, self.strategy, self.prefetch], backend)
        self.last_result: Any = None

    def draw(self) -> list[Any]:
        from fsdp_lab.sharding import lab as shard

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
        summary = Markdown(shard.summary(result))
        return [figures["memory_trace"], figures["bytes_vs_theory"], summary, figures["timeline"]]


def shard_explorer(
    world_size: int = 2, strategy: str = "full", prefetch: bool = True
) -> ShardExplorer:
    """Controls for ranks, strategy and prefetch; press Run to train and measure 3 steps."""
    return ShardExplorer(world_size, strategy, prefetch)
