"""What every lab's explorer widget shares: pick a setting, press Run, see a fresh measurement.

Each explorer (`fsdp_lab/<topic>/lab/explorer.py`) owns the clusters it starts (one per world
size, reused while the explorer lives) and closes them with `close()`, so re-running a notebook
cell leaves no rank behind; a notebook's own ranks, lent to it, are used at their world size and
left open. Its controls come from its lab's config fields (`control`): a setting the config would
refuse is not on offer.
"""

from __future__ import annotations

import contextlib
import difflib
import io
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import ipywidgets as W
from IPython.display import Markdown, display

from fsdp_lab.cluster import Cluster


class Slots:
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
            item, kwargs = shown_item(outputs[i] if i < len(outputs) else None)
            handle.update(item, **kwargs)

    def _controls(self) -> dict[str, Any]:
        bundle = self.widget._repr_mimebundle_()
        bundle["text/plain"] = self.describe()
        return bundle

    def display(self) -> None:
        self.handles = [display(self._controls(), raw=True, display_id=True)]
        for i in range(self.count):
            item, kwargs = shown_item(self.outputs[i] if i < len(self.outputs) else None)
            self.handles.append(display(item, display_id=True, **kwargs))


def shown_item(item: Any) -> tuple[Any, dict[str, bool]]:
    """What `display`/`update` take to show `item`; None shows nothing (an empty slot)."""
    return (item, {}) if item is not None else ({"text/plain": ""}, {"raw": True})


class Explorer:
    """A Run button over a set of controls; subclasses say what a run measures and draws.

    `show()` measures once with the controls' settings (the button calls it too); its figures
    and tables appear below the controls wherever the explorer is displayed, and each run
    replaces the previous one. `SLOTS` is the most outputs one run of the explorer draws.
    """

    SLOTS = 4

    def __init__(
        self, controls: list[W.Widget], backend: str = "auto", cluster: Cluster | None = None
    ) -> None:
        self.backend = backend
        self.lent = cluster  # the notebook's ranks: used at their world size, never closed
        self.controls = controls
        self.button = W.Button(description="Run", button_style="primary", icon="play")
        self.button.on_click(lambda _: self.refresh())
        self._clusters: dict[int, Cluster] = {}
        self.widget = W.HBox([*controls, self.button])
        self.slots = Slots(self.widget, self.SLOTS, self._describe)

    def cluster(self, n: int) -> Cluster:
        """Ranks for a run of `n`: the lent cluster if it has `n`, else the explorer's own."""
        if self.lent is not None and self.lent.world_size == n:
            return self.lent
        if n not in self._clusters:
            self._clusters[n] = Cluster(n, self.backend, verbose=False)
        return self._clusters[n]

    def _describe(self) -> str:
        return settings_text(self)

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


MAX_RANKS = 4  # what an explorer starts on a laptop: more ranks than cores measure contention


def offered(name: str, value: Any, options: list[Any]) -> None:
    """Raise a ValueError naming `value`, what the explorer offers and the nearest offer,
    unless `value` is one of `options` (values, or a selection's (label, value) pairs)."""
    values = [o[1] if isinstance(o, tuple) else o for o in options]
    if any(type(value) is type(v) and value == v for v in values):
        return
    near = values[0]
    if isinstance(value, int | float) and all(isinstance(v, int | float) for v in values):
        near = min(values, key=lambda v: abs(v - value)) if value == value else near  # nan
    elif isinstance(value, str):  # a typo: the closest spelling offered
        strings = [v for v in values if isinstance(v, str)]
        near = (difflib.get_close_matches(value, strings, n=1) or [near])[0]
    raise ValueError(f"{name}={value!r}: the explorer offers {values}. Fix: {name}={near!r}")


def choice(
    name: str, options: list[Any], value: Any, description: str, widget: type = W.Dropdown
) -> W.Widget:
    """`widget` (a dropdown, a selection slider) over `options`, set to `value` — which must be
    one of them (`offered`)."""
    offered(name, value, options)
    return widget(options=options, value=value, description=description)


def control(config: type, name: str, value: Any, description: str, **limits: Any) -> W.Widget:
    """A widget for the field `name` of a lab's `config`, from its `knob`: its choices as a
    dropdown, a bool as a checkbox, an int as a slider over the knob's range, narrowed by
    `limits` (``max=MAX_RANKS``). A starting `value` it does not offer is a ValueError, not a
    slider that quietly moves it."""
    f = next(f for f in fields(config) if f.name == name)
    if "choices" in f.metadata:
        return choice(name, f.metadata["choices"], value, description)
    if str(f.type) == "bool":
        offered(name, value, [True, False])
        return W.Checkbox(value=value, description=description)
    low, high = f.metadata["range"]
    top = min(b for b in (high, limits.get("max")) if b is not None)
    offered(name, value, list(range(low, top + 1)))
    return W.IntSlider(value=value, min=low, max=top, description=description)


def settings_text(explorer: Any) -> str:
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
