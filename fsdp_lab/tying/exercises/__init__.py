"""The exercises of the tying lab, in teaching order: one file each, named after the function
the learner writes (the reference solution, its cases, its judge and its classic bugs).

    split_ties.py              `split_ties`
    group_tied_units.py        `group_tied_units`
"""

from fsdp_lab.tying.exercises.group_tied_units import GROUP_TIED_UNITS
from fsdp_lab.tying.exercises.split_ties import SPLIT_TIES

EXERCISES = (SPLIT_TIES, GROUP_TIED_UNITS)
