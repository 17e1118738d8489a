"""The exercises of the meta-init lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    param_shard.py             `param_shard`
    retie.py                   `retie`
"""

from fsdp_lab.meta_init.exercises.param_shard import PARAM_SHARD
from fsdp_lab.meta_init.exercises.retie import RETIE

EXERCISES = (PARAM_SHARD, RETIE)
