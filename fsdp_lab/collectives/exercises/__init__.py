"""The exercises of the collectives lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    all_reduce_mean.py         `all_reduce_mean`
    gather_shards.py           `gather_shards`
"""

from fsdp_lab.collectives.exercises.all_reduce_mean import ALL_REDUCE_MEAN
from fsdp_lab.collectives.exercises.gather_shards import GATHER_SHARDS

EXERCISES = (ALL_REDUCE_MEAN, GATHER_SHARDS)
