"""Plan a real run at any scale: per-GPU memory, bytes and step time, verified by fake ranks.

    planner.py     `plan()`: the model's units on meta, `theory`'s formulas, the network model
    fake_ranks.py  one rank of the real run, simulated: our shard() under PyTorch's fake
                   process group and FakeTensorMode, measured by the lab's own tracker
    verify.py      the plan beside a measurement: each figure and its relative difference
    models.py      the models a plan is made for (Llama-3 presets, twins, any factory)
    report.py      a plan in words: tables beside the fake rank's measurement
    explorer.py    notebook 08's widget

`fsdp_lab.plan(...)` and ``fsdp-lab plan`` are the entry points.
"""

from fsdp_lab.lazy import lazy_names

_PUBLIC = {
    "plan": "fsdp_lab.planning.planner",
    "report": "fsdp_lab.planning.report",
    "Run": "fsdp_lab.planning.fake_ranks",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
