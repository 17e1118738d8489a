"""Activation checkpointing: keep fewer activations, recompute the rest in backward.

Read in this order: `recompute.py` (the checkpoint itself: run a segment without saving its
activations, rerun it in backward with the forward's random state; `checkpoint_modules`), then
`schedules.py` (where the checkpoints go — every c-th layer, √N segments, an optimal schedule
for a memory budget, revolve — and a chain that measures each). Beside them: `lab/` (notebook
02, ``fsdp-lab checkpoint``) and `exercises/` (`rerun_with_forward_rng`, `sqrt_segment_starts`).
"""
