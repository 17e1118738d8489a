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


class CheckpointExplorer(_Explorer):
    """Chain length, schedule and its argument for lab 02; measures it beside store-all.

    A run builds a `Chain` of N layers, measures the chosen schedule and store-all with
    `schedules.measure_schedule` (peak activation bytes, layer calls and kept inputs beside
    `schedules.theory`, gradients compared), then draws one forward+backward of each under a
    `MemoryTracker`, with a marker at every layer call. No ranks: everything runs here.
    """

    _ARG_NAMES = {"every": "C", "segments": "k", "optimal": "budget"}

    def __init__(
        self,
        n: int = 16,
        schedule: str = "segments",
        arg: int | None = None,
        dim: int = 32,
        batch: int = 256,
    ) -> None:
        from fsdp_lab import schedules

        self.n = W.IntSlider(value=n, min=2, max=32, description="N layers")
        self.schedule = W.Dropdown(
            options=list(schedules.SCHEDULES), value=schedule, description="schedule"
        )
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
        """Name and range of the argument: k or C in 1..N, budget in min_budget(N)..N."""
        from fsdp_lab import schedules

        n, name = self.n.value, self.schedule.value
        low = schedules.min_budget(n) if name == "optimal" else 1
        self.arg.description = self._ARG_NAMES.get(name, "(none)")
        self.arg.disabled = name not in self._ARG_NAMES
        self.arg.min = low  # low <= 2 <= the old max, so min first, then max, is always valid
        self.arg.max = n  # the slider clamps its value into the new range
        if reset:  # a fresh schedule starts at √N, the textbook's choice
            self.arg.value = max(low, min(n, round(n**0.5)))

    def current_schedule(self) -> Any:
        from fsdp_lab import schedules

        name = self.schedule.value
        arg = self.arg.value if name in self._ARG_NAMES else None
        return schedules.Schedule(name, arg)

    def show(self) -> None:
        import torch
        from IPython.display import Markdown

        from fsdp_lab import schedules
        from fsdp_lab.models import Chain
        from fsdp_lab.plots import format_bytes, plot_memory_trace

        n, chosen = self.n.value, self.current_schedule()
        torch.manual_seed(0)
        chain, x = Chain(n, self.dim), torch.randn(self.batch, self.dim)  # x: (B, dim)
        runs = [schedules.store_all] + ([chosen] if chosen != schedules.store_all else [])
        rows = [
            schedules.measure_schedule(chain.layers, x, s, loss_fn=_mean_square, keep_grads=True)
            for s in runs
        ]
        base = rows[0]["grads"]
        lines = [
            f"**N = {n}** layers, dim {self.dim}, batch {self.batch}",
            "",
            "| schedule | peak activations | layer calls (theory) | inputs kept (theory) "
            "| time | max grad diff vs store_all |",
            "|---|---|---|---|---|---|",
        ]
        for row in rows:
            diff = max((row["grads"][k] - base[k]).abs().max().item() for k in base)
            lines.append(
                f"| {row['schedule']} | {format_bytes(row['peak_activation_bytes'])} "
                f"| {row['forward_calls']} ({row['theory_forward_calls']}) "
                f"| {row['stored_activations']} ({row['theory_stored_activations']}) "
                f"| {row['time_s'] * 1e3:.1f} ms | {diff:.1e} |"
            )
            del row["grads"]
        if len(rows) == 2:
            ratio = rows[1]["peak_activation_bytes"] / rows[0]["peak_activation_bytes"]
            calls = rows[1]["forward_calls"] / rows[0]["forward_calls"]
            lines += ["", f"{chosen}: {ratio:.2f}× the activation bytes for {calls:.2f}× the calls"]
        self.last_rows = rows
        display(Markdown("\n".join(lines)))
        for s in runs:
            trace = _chain_trace(chain, x, s)
            display(plot_memory_trace(trace, title=f"one forward + backward, {s} (N = {n})"))


def _mean_square(out: Any) -> Any:
    return out.pow(2).mean()


def _chain_trace(chain: Any, x: Any, schedule: Any, repeats: int = 3) -> dict[str, Any]:
    """One forward+backward of `schedule` under a MemoryTracker, a marker at each layer call:
    "L3" for a call under grad (its internals kept for backward), "adv L3" under no_grad.

    The time axis is wall-clock, so a run stalled by a busy CPU is stretched: the shortest of
    `repeats` recordings is kept (the bytes are the same in every one).
    """
    import torch

    from fsdp_lab import schedules
    from fsdp_lab.trace import MemoryTracker

    traces = []
    for _ in range(max(repeats, 1)):
        for p in chain.parameters():
            p.grad = None
        with MemoryTracker() as mem:

            def mark(i: int, mem: MemoryTracker = mem) -> Any:
                return lambda *_: mem.mark(f"L{i}" if torch.is_grad_enabled() else f"adv L{i}")

            handles = [m.register_forward_pre_hook(mark(i)) for i, m in enumerate(chain.layers)]
            try:
                schedules.run_chain(chain.layers, x, schedule, loss_fn=_mean_square)
            finally:
                for handle in handles:
                    handle.remove()
        traces.append(mem.trace())
    return min(traces, key=lambda trace: trace["t"][-1])


def checkpoint_explorer(
    n: int = 16, schedule: str = "segments", arg: int | None = None
) -> CheckpointExplorer:
    """Controls for N, schedule and its k / C / budget; press Run to measure it vs store-all."""
    return CheckpointExplorer(n, schedule, arg)
