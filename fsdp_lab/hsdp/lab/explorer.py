"""The HSDP lab's explorer: the network model (`fsdp_lab.netsim`) under sliders — model size,
bandwidths, shard group size, overlap. Pure arithmetic: it redraws as a slider moves.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W

from fsdp_lab.explorer import Slots, settings_text


class ScalingExplorer:
    """The HSDP lab's network model (`fsdp_lab.netsim`) under sliders: model size, bandwidth
    between nodes and inside a node, the shard group S and the overlap. Pure arithmetic, no
    ranks: the picture redraws as a slider moves, the quoted chart's points stay beside it."""

    def __init__(
        self, params_b: float = 7.0, inter_node_gbit: float = 100.0, overlap: float = 1.0
    ) -> None:
        from fsdp_lab.hsdp.lab.config import HsdpConfig

        # the lab's own checks, in its words: a size or a link it would refuse is not drawn
        HsdpConfig(params_b=params_b, inter_node_gbit=inter_node_gbit, overlap=overlap)
        style = {"description_width": "initial"}

        def pick(options: list[float], value: float, description: str) -> W.SelectionSlider:
            # Sizes and links as they are sold: a log slider would show 7.08B for 7B.
            options = sorted({*options, value})
            return W.SelectionSlider(
                options=options, value=value, description=description, style=style
            )

        self.params_b = pick([1, 3, 7, 13, 34, 70, 175, 405], params_b, "params (B)")
        self.inter = pick(
            [10, 25, 100, 200, 400, 800, 1600, 3200], inter_node_gbit, "between nodes (Gbit/s)"
        )
        self.intra = pick([50, 100, 200, 450, 900], 450, "inside a node (GB/s)")
        self.shard = W.Dropdown(options=[1, 2, 4, 8], value=8, description="S", style=style)
        self.overlap = W.FloatSlider(
            value=overlap, min=0, max=1, step=0.05, description="overlap", style=style
        )
        self.controls = [self.params_b, self.inter, self.intra, self.shard, self.overlap]
        for control in self.controls:
            control.observe(lambda _: self.show(), names="value")
        self.widget = W.VBox([W.HBox(self.controls[:3]), W.HBox(self.controls[3:])])
        self.slots = Slots(self.widget, 1, lambda: settings_text(self))
        self.show()

    def model(self) -> dict[str, Any]:
        """The network model at the sliders' settings (`hsdp.analysis.network_model`)."""
        from fsdp_lab.hsdp.lab.analysis import network_model

        return network_model(
            self.params_b.value,
            self.inter.value,
            overlap=self.overlap.value,
            shard=self.shard.value,
            intra_gb_s=self.intra.value,
        )

    def show(self) -> None:
        """Draw the model at the sliders' settings below them (instant: no ranks)."""
        from fsdp_lab.hsdp.lab.figures import draw_scaling

        self.slots.fill([draw_scaling(self.model())])

    def _ipython_display_(self) -> None:
        self.slots.display()


def scaling_explorer(params_b: float = 7.0, inter_node_gbit: float = 100.0) -> ScalingExplorer:
    """Sliders over the HSDP lab's network model; the scaling picture redraws as they move."""
    return ScalingExplorer(params_b, inter_node_gbit)
