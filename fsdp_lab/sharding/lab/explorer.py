"""The sharding lab's explorer: world size, strategy and prefetch under controls; Run measures
memory, bytes and the timeline on live ranks.
"""

from __future__ import annotations

from typing import Any

from IPython.display import Markdown

from fsdp_lab.explorer import MAX_RANKS, Explorer, control
from fsdp_lab.sharding.lab.config import ShardConfig


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
        self.world_size = control(ShardConfig, "world_size", world_size, "ranks", max=MAX_RANKS)
        self.strategy = control(ShardConfig, "strategy", strategy, "strategy")
        self.prefetch = control(ShardConfig, "prefetch", prefetch, "prefetch")
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
