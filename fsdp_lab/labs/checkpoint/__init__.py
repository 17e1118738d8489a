"""Lab 02 — activation checkpointing: recompute instead of store, every textbook schedule.

For chains of N layers (default 8, 16, 32): each schedule of `fsdp_lab.schedules` is run and
measured — peak activation bytes (MemoryTracker), layer forward calls (hooks), time — with
its gradients compared to store-all, and its (memory, calls) predicted by `theory`. Then our
autograd-integrated `checkpoint` against `torch.utils.checkpoint` on the same segments, and a
sharded chain on real ranks: where the checkpoint sits relative to a wrap unit decides
whether the recompute costs an extra all-gather.

[Note: the textbook table] "store all O(N) memory / O(N) compute; recompute all O(1) / O(N²);
checkpoint every C layers O(C) / O(N²/C); √N" mixes two schemes: its "every C" row recomputes
each layer from its nearest checkpoint (our `every(C)`), but the √N row is Chen et al.'s
segments, recomputed once each (`segments(k)`, O(N/k + k) memory for one extra forward).
"""

from fsdp_lab.labs.checkpoint.config import CheckpointConfig
from fsdp_lab.labs.registry import LABS

LAB = LABS["checkpoint"]
run, summary, figures = LAB.run, LAB.report, LAB.figures

__all__ = ["LAB", "CheckpointConfig", "figures", "run", "summary"]
