"""The labs: one package each, one shape (`contract.py`), one registry (`registry.py`).

    from fsdp_lab.collectives import lab as collectives
    result = collectives.run()                  # measure on fresh ranks, analyse: a LabResult
    collectives.summary(result), collectives.figures(result)

The notebook, the CLI (``fsdp-lab <lab>``) and the tests all call the same ``run``, so all three
show the same measured numbers. Importing this package (and a lab's config) is torch-free, so
that ``fsdp-lab --help`` answers at once.
"""

from fsdp_lab.labs.contract import Lab, LabPackage, LabResult

__all__ = ["Lab", "LabPackage", "LabResult"]
