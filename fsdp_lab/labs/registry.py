"""Every lab, in the order the course takes them: `fsdp-lab <name>`, the tour and the notebooks
find a lab here and nowhere else. Adding a lab is one line (docs/architecture.md)."""

from __future__ import annotations

from fsdp_lab.labs.contract import Lab, LabPackage

_LABS: tuple[Lab, ...] = (
    LabPackage("collectives", "fsdp_lab.collectives.lab"),
    LabPackage("shard", "fsdp_lab.sharding.lab"),
    LabPackage("checkpoint", "fsdp_lab.checkpointing.lab"),
    LabPackage("tying", "fsdp_lab.tying.lab"),
    LabPackage("meta-init", "fsdp_lab.meta_init.lab"),
    LabPackage("pp-seed", "fsdp_lab.pipeline.lab"),
    LabPackage("hsdp", "fsdp_lab.hsdp.lab"),
)
LABS: dict[str, Lab] = {lab.name: lab for lab in _LABS}
PLANNED: dict[str, str] = {}  # name -> what it will be: `fsdp-lab <name>` says "planned"
