"""ipywidgets controls for the notebooks: pick a setting, press Run, see a fresh measurement.

Each explorer owns the clusters it starts (one per world size, reused while the explorer
lives) and closes them with `close()`, so re-running a notebook cell leaves no rank behind.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

import ipywidgets as W
from IPython.display import Markdown, display

from fsdp_lab.cluster import Cluster


class _Slots:
    """Output slots under a set of controls, filled by `display_id` updates.

    A measurement is shown as ordinary cell outputs (figures, Markdown), not inside an ipywidgets
    `Output`: JupyterLab saves ordinary outputs with the notebook, so an export to HTML still
    shows the last measurement, and a new run replaces the old one in place, below the controls.
    The controls themselves carry a readable text fallback instead of `VBox(children=...)`.
    """

    def __init__(self, widget: W.Widget, count: int, describe: Callable[[], str]) -> None:
        self.widget, self.count, self.describe = widget, count, describe
        self.handles: list[Any] = []
        self.outputs: list[Any] = [Markdown("*Press **Run** to measure.*")]

    def fill(self, outputs: list[Any]) -> None:
        """Remember `outputs` and, where the slots are on screen, replace what they show."""
        if len(outputs) > self.count:  # the last slot takes the rest, as one Markdown note
            outputs = [*outputs[: self.count - 1], Markdown("*(more outputs than slots)*")]
        self.outputs = outputs
        if self.handles:  # the controls' text names the settings the new outputs were made with
            self.handles[0].update(self._controls(), raw=True)
        for i, handle in enumerate(self.handles[1:]):
            item, kwargs = _shown(outputs[i] if i < len(outputs) else None)
            handle.update(item, **kwargs)

    def _controls(self) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_()
        bundle["text/plain"] = self.describe()
        return bundle

    def display(self) -> None:
        self.handles = [display(self._controls(), raw=True, display_id=True)]
        for i in range(self.count):
            item, kwargs = _shown(self.outputs[i] if i < len(self.outputs) else None)
            self.handles.append(display(item, display_id=True, **kwargs))


def _shown(item: Any) -> tuple[Any, dict[str, bool]]:
    """What `display`/`update` take to show `item`; None shows nothing (an empty slot)."""
    return (item, {}) if item is not None else ({"text/plain": ""}, {"raw": True})


class _Explorer:
    """A Run button over a set of controls; subclasses say what a run measures and draws.

    `show()` measures once with the controls' settings (the button calls it too); its figures
    and tables appear below the controls wherever the explorer is displayed, and each run
    replaces the previous one. `SLOTS` is the most outputs one run of the explorer draws.
    """

    SLOTS = 4

    def __init__(self, controls: list[W.Widget], backend: str = "auto") -> None:
        self.backend = backend
        self.controls = controls
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.button.on_click(lambda _: self.refresh())
        self._clusters: dict[int, Cluster] = {}
        self.widget = W.HBox([*controls, self.button])
        self.slots = _Slots(self.widget, self.SLOTS, self._describe)

    def cluster(self, n: int) -> Cluster:
        if n not in self._clusters:
            self._clusters[n] = Cluster(n, self.backend, verbose=False)
        return self._clusters[n]

    def _describe(self) -> str:
        return _settings_text(self)

    def show(self) -> None:
        """Measure once with the current settings and show it below the controls."""
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):  # rank output joins the measurement's slots
            outputs = self.draw()
        if captured.getvalue().strip():
            outputs = [Markdown(f"```\n{captured.getvalue().rstrip()}\n```"), *outputs]
        self.slots.fill(outputs)

    def refresh(self) -> None:
        """What the Run button does: `show()`, an error shown in the slots instead of lost."""
        self.button.disabled, self.button.description = True, "Running…"
        try:
            self.show()
        except Exception as err:  # a button callback has no cell to raise into
            self.slots.fill([Markdown(f"**The run failed:** `{type(err).__name__}: {err}`")])
        finally:
            self.button.disabled, self.button.description = False, "Run"

    def draw(self) -> list[Any]:  # pragma: no cover - defined by subclasses
        """Run one measurement; return what to show, in order (figures, Markdown)."""
        raise NotImplementedError

    def close(self) -> None:
        for cluster in self._clusters.values():
            cluster.close()
        self._clusters.clear()

    def _ipython_display_(self) -> None:
        self.slots.display()


def _settings_text(explorer: Any) -> str:
    """The controls as text: what an HTML export or a plain console shows in their place."""

    def shown(control: W.Widget) -> str:
        labels = getattr(control, "_options_labels", None)  # a selection's shown text ("4 KiB");
        if labels and control.index is not None:  # its `label` is '' until the index first moves
            return str(labels[control.index])
        return str(control.value)

    settings = ", ".join(f"{c.description} = {shown(c)}" for c in explorer.controls)
    return (
        f"[{type(explorer).__name__}: {settings}; open the notebook in JupyterLab to change them]"
    )


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

    SLOTS = 2

    def draw(self) -> list[Any]:
        from fsdp_lab.labs import collectives
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

    def draw(self) -> list[Any]:
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
        summary = Markdown(shard.summary(result))
        return [figures["memory_trace"], figures["bytes_vs_theory"], summary, figures["timeline"]]


def shard_explorer(
    world_size: int = 2, strategy: str = "full", prefetch: bool = True
) -> ShardExplorer:
    """Controls for ranks, strategy and prefetch; press Run to train and measure 3 steps."""
    return ShardExplorer(world_size, strategy, prefetch)


class CheckpointExplorer(_Explorer):
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
        """Name and range of the argument: k, C or s in 1..N, budget in min_budget(N)..N."""
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

    SLOTS = 3

    def draw(self) -> list[Any]:
        import torch

        from fsdp_lab import schedules
        from fsdp_lab.labs.checkpoint.measure import measure_schedules
        from fsdp_lab.labs.checkpoint.report import explorer_note, schedule_table
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


class MetaInitExplorer(_Explorer):
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
        sizes = dict(self.SIZES).values()
        if model_mb not in sizes:
            raise ValueError(
                f"model_mb={model_mb!r}: the explorer offers {list(sizes)} (MiB). "
                f"Fix: model_mb={min(sizes, key=lambda s: abs(s - model_mb))}"
            )
        self.model_mb = W.SelectionSlider(options=self.SIZES, value=model_mb, description="model")
        self.world_size = W.IntSlider(value=world_size, min=1, max=4, description="ranks")
        self.seed = seed
        self.shared = cluster
        super().__init__([self.model_mb, self.world_size], backend)
        self.last_result: dict[str, Any] | None = None

    def cluster(self, n: int) -> Cluster:
        """The shared ranks if they are `n`, else the explorer's own (started once, then kept)."""
        if self.shared is not None and self.shared.world_size == n:
            return self.shared
        return super().cluster(n)

    def draw(self) -> list[Any]:
        from fsdp_lab.labs.meta_init import analysis, measure, report

        n, mb = self.world_size.value, self.model_mb.value
        cluster = self.cluster(n)
        memory = analysis.materialisation(measure.measure_materialisation(mb, self.seed, cluster))
        row = analysis.agreement_row(measure.measure_size(mb, self.seed, cluster))
        self.last_result = {"materialise": memory, "agreement": row}
        return [
            report.rss_figure(memory),
            Markdown(report.memory_table(memory) + "\n\n" + report.memory_text(memory)),
            Markdown(report.agreement_table([row]) + "\n\n" + report.agreement_time_text([row])),
        ]


def meta_init_explorer(
    model_mb: int = 64, world_size: int = 2, cluster: Cluster | None = None
) -> MetaInitExplorer:
    """Controls for model size and ranks; press Run to build, shard and compare the ranks.
    `cluster`: the notebook's ranks, reused for their world size."""
    return MetaInitExplorer(model_mb, world_size, cluster=cluster)


class PPSeedExplorer(_Explorer):
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

        self.stages = W.IntSlider(value=stages, min=1, max=4, description="S stages")
        self.layers = W.IntSlider(value=layers, min=1, max=12, description="L layers")
        self.strategy = W.Dropdown(options=list(STRATEGIES), value=strategy, description="init")
        self.steps = steps
        super().__init__([self.stages, self.layers, self.strategy], backend)
        self._borrowed = cluster
        if cluster is not None:
            self._clusters[cluster.world_size] = cluster
        self.last_result: Any = None

    def close(self) -> None:
        if self._borrowed is not None and self._clusters.get(self._borrowed.world_size) is (
            self._borrowed
        ):
            del self._clusters[self._borrowed.world_size]  # not ours to close
        super().close()

    def draw(self) -> list[Any]:
        from fsdp_lab.diagrams import pipeline_diagram
        from fsdp_lab.labs import pp_seed
        from fsdp_lab.labs.pp_seed import pictures, report, tables

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
        text = [tables.results_table(result), report.exactness_sentence(result)]
        text += [tables.overlap_table(result), report.loss_sentence(result)]
        outputs = [diagram, Markdown("\n\n".join(text)), pictures.loss_figure(result)]
        if strategy == "same_seed" and s > 1:
            outputs.append(pictures.same_seed_figure(result))
        return outputs


def pp_seed_explorer(
    stages: int = 2, layers: int = 4, strategy: str = "rng_replay", cluster: Cluster | None = None
) -> PPSeedExplorer:
    """Controls for S, L and the init strategy; press Run to initialise, compare and train."""
    return PPSeedExplorer(stages, layers, strategy, cluster=cluster)


class ScalingExplorer:
    """The HSDP lab's network model (`fsdp_lab.netsim`) under sliders: model size, bandwidth
    between nodes and inside a node, the shard group S and the overlap. Pure arithmetic, no
    ranks: the picture redraws as a slider moves, the quoted chart's points stay beside it."""

    def __init__(
        self, params_b: float = 7.0, inter_node_gbit: float = 100.0, overlap: float = 1.0
    ) -> None:
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
        self.slots = _Slots(self.widget, 1, lambda: _settings_text(self))
        self.show()

    def model(self) -> dict[str, Any]:
        """The network model at the sliders' settings (`hsdp.analysis.network_model`)."""
        from fsdp_lab.labs.hsdp.analysis import network_model

        return network_model(
            self.params_b.value,
            self.inter.value,
            overlap=self.overlap.value,
            shard=self.shard.value,
            intra_gb_s=self.intra.value,
        )

    def show(self) -> None:
        """Draw the model at the sliders' settings below them (instant: no ranks)."""
        from fsdp_lab.labs.hsdp.report import draw_scaling

        self.slots.fill([draw_scaling(self.model())])

    def _ipython_display_(self) -> None:
        self.slots.display()


def scaling_explorer(params_b: float = 7.0, inter_node_gbit: float = 100.0) -> ScalingExplorer:
    """Sliders over the HSDP lab's network model; the scaling picture redraws as they move."""
    return ScalingExplorer(params_b, inter_node_gbit)
