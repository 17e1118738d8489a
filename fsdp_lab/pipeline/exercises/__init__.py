"""The exercises of the pp-seed lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    stage_seeds.py             `stage_seeds`
    hand_over.py               `hand_over`
"""

from fsdp_lab.pipeline.exercises.hand_over import HAND_OVER
from fsdp_lab.pipeline.exercises.stage_seeds import STAGE_SEEDS

EXERCISES = (STAGE_SEEDS, HAND_OVER)
