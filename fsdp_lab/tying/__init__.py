"""Weight tying under wrap policies: one set of numbers used by two modules must stay one copy
through sharding.

Read `fsdp_lab/sharding/ties.py` (find, record, put back and verify ties: sharding needs them,
so they live with it) beside `fsdp_lab/sharding/wrap.py` (the wrap plan that must keep a tie
inside one unit). Beside them: `lab/` (notebook 03,
``fsdp-lab tying``) and `exercises/` (`split_ties`, `group_tied_units`).
"""
