"""The exercises of the checkpoint lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    rerun_with_forward_rng.py  `rerun_with_forward_rng`
    sqrt_segment_starts.py     `sqrt_segment_starts`
"""

from fsdp_lab.checkpointing.exercises.rerun_with_forward_rng import RERUN_WITH_FORWARD_RNG
from fsdp_lab.checkpointing.exercises.sqrt_segment_starts import SQRT_SEGMENT_STARTS

EXERCISES = (RERUN_WITH_FORWARD_RNG, SQRT_SEGMENT_STARTS)
