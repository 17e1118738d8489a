"""Every lab, in the order the course takes them: `fsdp-lab <name>`, the tour and the notebooks
find a lab here and nowhere else. Adding a lab is one line (docs/architecture.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from fsdp_lab.labs.contract import Lab, LabPackage, LabResult


@dataclass(frozen=True)
class _FlatLab:
    """A lab not yet split into its package (one run module + one config module). Temporary."""

    name: str
    module: str
    config_module: str
    config: str

    @property
    def config_class(self) -> type:
        return getattr(importlib.import_module(self.config_module), self.config)

    @property
    def title(self) -> str:
        doc = importlib.import_module(self.config_module).__doc__ or self.name
        return doc.strip().split("\n")[0]

    @property
    def tour(self) -> dict[str, Any]:
        return dict(getattr(importlib.import_module(self.config_module), "TOUR", {}))

    def run(self, config: Any = None, cluster: Any = None) -> LabResult:
        config = self.config_class() if config is None else config
        return importlib.import_module(self.module).run(config, cluster=cluster)

    def preflight(self, config: Any) -> None:
        check = getattr(importlib.import_module(self.module), "preflight", None)
        if check is not None:
            check(config)

    def report(self, result: LabResult) -> str:
        return importlib.import_module(self.module).summary(result)

    def figures(self, result: LabResult) -> dict[str, Any]:
        return importlib.import_module(self.module).figures(result)


_LABS: tuple[Lab, ...] = (
    LabPackage("collectives", "fsdp_lab.labs.collectives"),
    LabPackage("shard", "fsdp_lab.labs.shard"),
    LabPackage("checkpoint", "fsdp_lab.labs.checkpoint"),
    LabPackage("tying", "fsdp_lab.labs.tying"),
    LabPackage("meta-init", "fsdp_lab.labs.meta_init"),
    LabPackage("pp-seed", "fsdp_lab.labs.pp_seed"),
)
LABS: dict[str, Lab] = {lab.name: lab for lab in _LABS}
PLANNED = {"hsdp": "the hybrid-sharding lab (HSDP: a 2-D replicate x shard mesh)"}
