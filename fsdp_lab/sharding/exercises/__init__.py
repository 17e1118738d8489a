"""The exercises of the shard lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    reduce_scatter_grad.py     `reduce_scatter_grad`
    free_unsharded.py          `free_unsharded`
    unit_to_prefetch.py        `unit_to_prefetch`
    cast_floats.py             `cast_floats`
"""

from fsdp_lab.sharding.exercises.cast_floats import CAST_FLOATS
from fsdp_lab.sharding.exercises.free_unsharded import FREE_UNSHARDED
from fsdp_lab.sharding.exercises.reduce_scatter_grad import REDUCE_SCATTER_GRAD
from fsdp_lab.sharding.exercises.unit_to_prefetch import UNIT_TO_PREFETCH

EXERCISES = (REDUCE_SCATTER_GRAD, FREE_UNSHARDED, UNIT_TO_PREFETCH, CAST_FLOATS)
