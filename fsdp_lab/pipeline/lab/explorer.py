"""The pp-seed lab's explorer: stages, layers and an init strategy under controls; who owns
which module, and what each stage draws.
"""

from __future__ import annotations

from typing import Any

from IPython.display import Markdown

from fsdp_lab.cluster import Cluster
from fsdp_lab.explorer import MAX_RANKS, Explorer, choice, control
from fsdp_lab.pipeline.lab.config import PPSeedConfig


class PPSeedExplorer(Explorer):
    """Stages S, layers L and an init strategy for lab 05: the picture of who owns which
    layers and where the seed or RNG state travels, then one measured run of that strategy.

    A run initialises a pipeline of S stages on S ranks with the chosen strategy, compares
    every stage with the unsplit init and the stages with each other, trains it `steps` GPipe
    steps beside single-process training, and shows the table rows and the loss curves.
    `cluster`: a live `Cluster` to use when S equals its size (the explorer leaves it open).
    """

    SLOTS = 5  # rank output, the diagram, the tables, the loss curves, the same-seed draws

    def __init__(
        self,
        stages: int = 2,
        layers: int = 4,
        strategy: str = "rng_replay",
        steps: int = 20,
        cluster: Cluster | None = None,
        backend: str = "auto",
    ) -> None:
        from fsdp_lab.pipeline.rng import STRATEGIES

        self.stages = control(PPSeedConfig, "stages", stages, "S stages", max=MAX_RANKS)
        self.layers = control(PPSeedConfig, "layers", layers, "L layers", max=12)
        self.strategy = choice("strategy", list(STRATEGIES), strategy, "init")
        self.steps = steps
        super().__init__([self.stages, self.layers, self.strategy], backend, cluster)
        self.last_result: Any = None

    def draw(self) -> list[Any]:
        from fsdp_lab.diagrams import pipeline_diagram
        from fsdp_lab.pipeline import lab as pp_seed
        from fsdp_lab.pipeline.lab import report
        from fsdp_lab.pipeline.lab.figures import loss_figure, same_seed_figure

        s, strategy = self.stages.value, self.strategy.value
        try:
            config = pp_seed.PPSeedConfig(
                stages=s,
                layers=self.layers.value,
                steps=self.steps,
                strategies=(strategy,),
                grow_dims=(),
                backend=self.backend,
            )
        except ValueError as err:  # e.g. more stages than layers: say why, run nothing
            return [Markdown(f"**Not run:** {err}")]
        diagram = pipeline_diagram(config.gpt(), s, strategy=strategy)
        result = pp_seed.run(config, cluster=self.cluster(s))
        self.last_result = result
        text = [report.results_table(result), report.exactness_sentence(result)]
        text += [report.overlap_table(result), report.loss_sentence(result)]
        outputs = [diagram, Markdown("\n\n".join(text)), loss_figure(result)]
        if strategy == "same_seed" and s > 1:
            outputs.append(same_seed_figure(result))
        return outputs


def pp_seed_explorer(
    stages: int = 2, layers: int = 4, strategy: str = "rng_replay", cluster: Cluster | None = None
) -> PPSeedExplorer:
    """Controls for S, L and the init strategy; press Run to initialise, compare and train."""
    return PPSeedExplorer(stages, layers, strategy, cluster=cluster)
