"""The exercises of the hsdp lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    hsdp_reduce_grad.py        `hsdp_reduce_grad`
    mesh_groups.py             `mesh_groups`
"""

from fsdp_lab.hsdp.exercises.hsdp_reduce_grad import HSDP_REDUCE_GRAD
from fsdp_lab.hsdp.exercises.mesh_groups import MESH_GROUPS

EXERCISES = (HSDP_REDUCE_GRAD, MESH_GROUPS)
