"""What every lab is: the `Lab` protocol, its `LabResult`, and the package shape behind it.

A lab is a package ``fsdp_lab/labs/<lab>/`` with the same four parts, in the order data flows:

    config.py    the frozen config dataclass (``CONFIG``), validated with messages in Python
                 terms (``steps=0: ...  Fix: steps=5``); torch-free, so that ``fsdp-lab --help``
                 answers at once. Its fields *are* the command-line options (`options.py`).
    measure.py   ``measure(config, cluster=None) -> dict``: what runs on the ranks (and any
                 fresh process), borrowed through `fsdp_lab.cluster.borrow`; plain data back.
                 Optionally ``preflight(config)``: checks of this machine before ranks start.
    analysis.py  ``analyse(config, measured) -> dict``: pure functions from measured data to
                 figures and verdicts (the LabResult's data); testable without a cluster.
    report.py    ``summary(result) -> str``: every sentence and table (markdown), each a
                 function of the result; torch- and matplotlib-free.
    figures.py   ``figures(result) -> {stem: figure}``, built with `fsdp_lab.plots` /
                 `fsdp_lab.diagrams` (imported when drawn).
    explorer.py  optional: the notebook's widget (`fsdp_lab.explorer`).

`LabPackage` implements the protocol over those modules, importing each only when it is
needed; `fsdp_lab.labs.registry.LABS` lists the labs, and `cli.py`, the tour and the notebooks
all go through it, so a new lab is registered in one place (docs/architecture.md, "How to add
a lab").
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Protocol


@dataclass
class LabResult:
    """Everything a lab measured, as plain JSON-serialisable data.

    Args:
        lab: the lab's CLI name ("collectives", "shard", ...).
        data: the measured figures, per-rank traces and tables (JSON types only).
    """

    lab: str
    data: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def to_dict(self) -> dict[str, Any]:
        return {"lab": self.lab, **self.data}

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LabResult:
        d = dict(d)
        return cls(d.pop("lab"), d)


class Lab(Protocol):
    """What the CLI, the tour and the notebooks need of a lab."""

    name: str

    @property
    def config_class(self) -> type: ...

    @property
    def title(self) -> str: ...

    @property
    def tour(self) -> dict[str, Any]: ...

    def run(self, config: Any = None, cluster: Any = None) -> LabResult: ...

    def preflight(self, config: Any) -> None: ...

    def report(self, result: LabResult) -> str: ...

    def figures(self, result: LabResult) -> dict[str, Any]: ...


class LabInterrupted(KeyboardInterrupt):
    """A lab stopped by Ctrl-C or the notebook's stop button. In a notebook it shows as one
    line — what became of the ranks, and that the cells below need the cell run again — not as
    a traceback through whatever library code the interrupt landed in."""

    def __init__(self, lab: str, detail: str = "") -> None:
        ranks = detail.removeprefix("fsdp_lab: ").strip() or "no rank was running a call"
        super().__init__(
            f"the {lab} lab was interrupted ({ranks}); it has no result: run the cell again "
            "before the cells below, which read it"
        )

    def _render_traceback_(self) -> list[str]:  # IPython: instead of the traceback
        return [f"Interrupted: {self}"]


@dataclass(frozen=True)
class LabPackage:
    """A lab laid out as ``<package>/{config,measure,analysis,report,figures}.py``.

    Args:
        name: the CLI name (``fsdp-lab <name>``) and the LabResult's ``lab``.
        package: the dotted package, e.g. ``"fsdp_lab.sharding.lab"``.
    """

    name: str
    package: str

    def part(self, part: str) -> ModuleType:
        """One of the lab's modules: "config", "measure", "analysis", "report" or "figures"."""
        return importlib.import_module(f"{self.package}.{part}")

    @property
    def config_class(self) -> type:
        return self.part("config").CONFIG

    @property
    def title(self) -> str:
        """The first line of the config module's docstring: "Lab 01 — ..."."""
        return (self.part("config").__doc__ or self.name).strip().split("\n")[0]

    @property
    def tour(self) -> dict[str, Any]:
        """Overrides that make the lab laptop-sized in `fsdp-lab tour` (the config's TOUR)."""
        return dict(getattr(self.part("config"), "TOUR", {}))

    def run(self, config: Any = None, cluster: Any = None) -> LabResult:
        """Measure (on `cluster` if given, its world size wins; else on ranks started and
        stopped here), then analyse: what the notebook, the CLI and the tests all call."""
        config = self.config_class() if config is None else config
        try:
            measured = self.part("measure").measure(config, cluster)
        except KeyboardInterrupt as exc:  # the stop button: one line, wherever it landed
            raise LabInterrupted(self.name, str(exc)) from None
        return LabResult(self.name, self.part("analysis").analyse(config, measured))

    def preflight(self, config: Any) -> None:
        """The lab's own checks of this machine (e.g. host memory), before any rank starts."""
        check = getattr(self.part("measure"), "preflight", None)
        if check is not None:
            check(config)

    def report(self, result: LabResult) -> str:
        return self.part("report").summary(result)

    def figures(self, result: LabResult) -> dict[str, Any]:
        return self.part("figures").figures(result)
