"""Notebook 08's widget: the planner under controls, the fake-rank verification one click away.

Every control redraws the plan at once (arithmetic on the model's units, built once per model
on meta); **Verify on a fake rank** runs rank 0 of the chosen world under PyTorch's fake
process group and FakeTensorMode (seconds for 8B, a minute for 405B) and sets its measurement
beside the plan, in the table and as a mark on the picture.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import Markdown

from fsdp_lab.explorer import Slots, settings_text
from fsdp_lab.planning import report
from fsdp_lab.planning.figures import draw_strategies
from fsdp_lab.planning.models import model_names
from fsdp_lab.planning.planner import (
    CHECKPOINTS,
    GPUS,
    PRECISIONS,
    SETTINGS,
    STRATEGIES,
    plan,
)

COMPARED = ("ddp", "zero1", "zero2", "zero3", "hsdp")  # the picture's bars


class PlanExplorer:
    """The planner's arguments as controls; `show()` plans, `verify()` also runs a fake rank."""

    def __init__(self, **defaults: Any) -> None:
        style = {"description_width": "initial"}
        d = {
            "model": "llama3-8b",
            "gpus": 64,
            "gpus_per_node": 8,
            "gpu": "h100",
            "strategy": "zero3",
            "mesh": "",
            "precision": "bf16-mixed",
            "checkpoint": "blocks",
            "seq": 8192,
            "micro_batch": 1,
            "grad_accumulation": 1,
            "mfu": None,
            **defaults,
        }

        def drop(options: list, key: str, description: str) -> W.Dropdown:
            return W.Dropdown(options=options, value=d[key], description=description, style=style)

        self.model = drop(model_names(), "model", "model")
        self.gpus = drop([8, 16, 32, 64, 128, 256, 512, 1024], "gpus", "GPUs")
        self.gpus_per_node = drop([1, 2, 4, 8], "gpus_per_node", "per node")
        self.gpu = drop(sorted(GPUS), "gpu", "GPU")
        self.strategy = drop(list(STRATEGIES), "strategy", "strategy")
        self.mesh = W.Text(
            value=d["mesh"], placeholder="R,S (HSDP)", description="mesh", style=style
        )
        self.precision = drop(list(PRECISIONS), "precision", "precision")
        self.checkpoint = drop(list(CHECKPOINTS), "checkpoint", "checkpoint")
        self.seq = drop([1024, 2048, 4096, 8192, 16384, 32768, 131072], "seq", "sequence")
        self.micro_batch = drop([1, 2, 4, 8, 16], "micro_batch", "micro-batch")
        self.grad_accumulation = drop([1, 2, 4, 8, 16], "grad_accumulation", "accumulation")
        mfus = [("the GPU's", None)] + [(f"{m:.0%}", m) for m in (0.3, 0.4, 0.5, 0.6, 0.7)]
        self.mfu = drop(mfus, "mfu", "MFU")
        self.controls = [
            self.model,
            self.gpus,
            self.gpus_per_node,
            self.gpu,
            self.strategy,
            self.mesh,
            self.precision,
            self.checkpoint,
            self.seq,
            self.micro_batch,
            self.grad_accumulation,
            self.mfu,
        ]
        for control in self.controls:
            control.observe(lambda _: self.show(), names="value")
        self.button = W.Button(
            description="Verify on a fake rank", icon="check", layout=W.Layout(width="auto")
        )
        self.button.on_click(lambda _: self.verify())
        rows = [W.HBox(self.controls[:5]), W.HBox(self.controls[5:10]), W.HBox(self.controls[10:])]
        self.widget = W.VBox([*rows, self.button])
        self.slots = Slots(self.widget, 3, lambda: settings_text(self))
        self.plan: dict[str, Any] | None = None
        self.show()

    def settings(self) -> dict[str, Any]:
        """The controls as `plan()`'s keywords."""
        mesh = tuple(int(x) for x in self.mesh.value.split(",")) if self.mesh.value else None
        return {c: getattr(self, c).value for c in SETTINGS} | {"mesh": mesh}

    def show(self, verify: str | None = None) -> dict[str, Any] | None:
        """Plan at the controls' settings (and verify when asked); draw the plan, the table and
        every strategy's bar. A setting the planner refuses is said in words."""
        try:
            settings = self.settings()
            self.plan = plan(**settings, verify=verify)
        except ValueError as exc:
            self.slots.fill([Markdown(f"**Not a plan:** {exc}")])
            return None
        bars = [  # every strategy at this size (HSDP on its default mesh: a node per group)
            self.plan
            if s == self.plan["strategy"]
            else plan(**{**settings, "mesh": None, "strategy": s})
            for s in COMPARED
        ]
        self.slots.fill(
            [
                Markdown(report.verdict(self.plan) + "\n\n" + report.memory_table(self.plan)),
                Markdown(report.comm_table(self.plan) + "\n\n" + report.zero_paper_line(self.plan)),
                draw_strategies(bars),
            ]
        )
        return self.plan

    def verify(self) -> dict[str, Any] | None:
        """`show()` with the plan run on a fake rank (the button)."""
        self.slots.fill([Markdown(f"*Running rank 0 of {self.gpus.value} on fake ranks ...*")])
        return self.show(verify="fake")

    def _ipython_display_(self) -> None:
        self.slots.display()


def plan_explorer(**defaults: Any) -> PlanExplorer:
    """The planner as a widget; keywords set the controls' first values (`plan()`'s names,
    ``mesh`` as "R,S")."""
    return PlanExplorer(**defaults)
