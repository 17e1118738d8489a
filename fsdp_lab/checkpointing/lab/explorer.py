"""The checkpointing lab's explorer: chain length, schedule and its argument under controls;
Run measures that schedule beside store-all.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
from IPython.display import Markdown

from fsdp_lab.explorer import Explorer, choice


class CheckpointExplorer(Explorer):
    """Chain length, schedule and its argument for lab 02; measures it beside store-all.

    A run builds a `Chain` of N layers and measures the chosen schedule and store-all with the
    lab's `measure_schedules`: kept inputs and calls beside `theory.checkpoint_cost`, the
    median time of repeated runs, gradients compared, and one forward + backward of each under
    a `MemoryTracker` with a marker at every layer call. The table's peaks and the figures come
    from that same recording, so they agree. No ranks: everything runs here.
    """

    _ARG_NAMES = {"every": "C", "segments": "k", "optimal": "budget", "revolve": "s"}

    def __init__(
        self,
        n: int = 16,
        schedule: str = "segments",
        arg: int | None = None,
        dim: int = 32,
        batch: int = 256,
    ) -> None:
        from fsdp_lab.checkpointing import schedules

        self.n = W.IntSlider(value=n, min=2, max=32, description="N layers")
        self.schedule = choice("schedule", list(schedules.SCHEDULES), schedule, "schedule")
        self.arg = W.IntSlider(value=1, min=1, max=n, description="arg")
        self.dim, self.batch = dim, batch
        super().__init__([self.n, self.schedule, self.arg])
        self._update_arg(reset=True)
        if arg is not None:
            self.arg.value = arg
        self.n.observe(lambda _: self._update_arg(reset=False), names="value")
        self.schedule.observe(lambda _: self._update_arg(reset=True), names="value")
        self.last_rows: list[dict[str, Any]] = []

    def _update_arg(self, reset: bool) -> None:
        """Name and range of the argument: k, C or s in 1..N, budget in min_budget(N)..N."""
        from fsdp_lab.checkpointing import schedules

        n, name = self.n.value, self.schedule.value
        low = schedules.min_budget(n) if name == "optimal" else 1
        self.arg.description = self._ARG_NAMES.get(name, "(none)")
        self.arg.disabled = name not in self._ARG_NAMES
        self.arg.min = low  # low <= 2 <= the old max, so min first, then max, is always valid
        self.arg.max = n  # the slider clamps its value into the new range
        if reset:  # a fresh schedule starts at √N, the textbook's choice
            self.arg.value = max(low, min(n, round(n**0.5)))

    def current_schedule(self) -> Any:
        from fsdp_lab.checkpointing import schedules

        name = self.schedule.value
        arg = self.arg.value if name in self._ARG_NAMES else None
        return schedules.Schedule(name, arg)

    SLOTS = 3

    def draw(self) -> list[Any]:
        import torch

        from fsdp_lab.checkpointing import schedules
        from fsdp_lab.checkpointing.lab.measure import measure_schedules
        from fsdp_lab.checkpointing.lab.report import explorer_note, schedule_table
        from fsdp_lab.models import Chain
        from fsdp_lab.plots import plot_memory_trace

        n, chosen = self.n.value, self.current_schedule()
        torch.manual_seed(0)
        chain, x = Chain(n, self.dim), torch.randn(self.batch, self.dim)  # x: (B, dim)
        runs = [schedules.store_all] + ([chosen] if chosen != schedules.store_all else [])
        # Gradients compared with store_all's; every run's recording kept for its figure.
        rows = measure_schedules(chain, x, runs, traced=[str(s) for s in runs])
        traces = [r.pop("trace") for r in rows]
        self.last_rows = rows
        text = [
            f"**N = {n}** layers, dim {self.dim}, batch {self.batch}",
            "",
            schedule_table(rows, against=" vs store_all"),
            "",
            explorer_note(rows),
        ]
        return [Markdown("\n".join(text))] + [
            plot_memory_trace(trace, title=f"one forward + backward, {r['schedule']} (N = {n})")
            for r, trace in zip(rows, traces, strict=True)
        ]


def checkpoint_explorer(
    n: int = 16, schedule: str = "segments", arg: int | None = None
) -> CheckpointExplorer:
    """Controls for N, schedule and its k / C / budget; press Run to measure it vs store-all."""
    return CheckpointExplorer(n, schedule, arg)
