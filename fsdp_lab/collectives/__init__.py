"""Collectives: the four messages every parallelism is built from (all-reduce, all-gather,
reduce-scatter, broadcast), their bytes per rank beside the ring formulas.

The mechanism is `fsdp_lab.comm`, shared by every topic (each collective is counted there).
Here: `lab/` (notebook 00, ``fsdp-lab collectives``: measured bytes and times, and the map of
data, context, pipeline and tensor parallelism in `lab/parallelism.py`) and `exercises/`
(`all_reduce_mean`, `gather_shards`).
"""
