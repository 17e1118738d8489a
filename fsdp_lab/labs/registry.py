"""Every lab, in the order the course takes them: `fsdp-lab <name>`, the tour and the notebooks
find a lab here and nowhere else. Adding a lab is one line (docs/architecture.md)."""

from __future__ import annotations

from fsdp_lab.labs.contract import Lab, LabPackage

_LABS: tuple[Lab, ...] = (
    LabPackage("collectives", "fsdp_lab.labs.collectives"),
    LabPackage("shard", "fsdp_lab.labs.shard"),
    LabPackage("checkpoint", "fsdp_lab.labs.checkpoint"),
    LabPackage("tying", "fsdp_lab.labs.tying"),
    LabPackage("meta-init", "fsdp_lab.labs.meta_init"),
    LabPackage("pp-seed", "fsdp_lab.labs.pp_seed"),
    LabPackage("hsdp", "fsdp_lab.labs.hsdp"),
)
LABS: dict[str, Lab] = {lab.name: lab for lab in _LABS}
PLANNED: dict[str, str] = {}  # name -> what it will be: `fsdp-lab <name>` says "planned"
