"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

For chains of N layers (default 8, 16, 32): each schedule of `fsdp_lab.checkpointing.schedules` is run and
measured — peak activation bytes (MemoryTracker), layer forward calls and kept layer inputs
(hooks), time (median of repeats) — with its gradients compared to store-all, and its (kept
inputs, calls) predicted by `theory`. Griewank's binomial law is measured on revolve(s). Then
our autograd-integrated `checkpoint` against `torch.utils.checkpoint` on the same segments,
and a sharded chain on real ranks: where the checkpoint sits relative to a wrap unit decides
whether the recompute costs an extra all-gather.

[Note: the textbook table] Course notes write "store all O(N) memory / O(N) compute; recompute
all O(1) / O(N²); checkpoint every C layers O(C) / O(N²/C); √N: O(√N) / O(N√N), theoretically
optimal". The "every C layers" row mixes two schemes: O(C) memory and O(N²/C) compute are C
checkpoints N/C layers apart, each layer rebuilt from its nearest one (our `every(C)`); a
checkpoint every C layers costs what its recompute makes of it — rebuilt layer by layer from the
nearest one, O(N/C) memory and O(N·C) calls; rerun once per segment (Chen et al.'s
`segments(C)`), ⌈N/C⌉ + C − 1 kept inputs (− 2 when C does not divide N) and under 2N
calls. The √N row gives
Chen et al.'s memory but not their compute: their segments (`segments(k)`, O(N/k + k) kept)
are recomputed once each — one extra forward, under 2N calls; O(N√N) is what every(√N)
costs. Nor is it optimal: at equal kept inputs `optimal(b)` never makes more calls, and
mostly fewer. Corrected, with
the measurement beside it: `report.corrected_table`, `report.textbook_verdicts`.
"""

from fsdp_lab.checkpointing.lab.config import CheckpointConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.checkpointing.lab.figures import figures
from fsdp_lab.labs.registry import LABS

LAB = LABS["checkpoint"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "CheckpointConfig", "figures", "run", "summary"]
