"""Hybrid sharding (HSDP): ZeRO-3 inside each shard group (a node), the shard's gradient
all-reduced across the replicas.

The mechanism is sharding's own: `fsdp_lab.sharding.mesh` (the 2-D mesh and its groups) and the
two-step reduce of `fsdp_lab.sharding.steps.reduce_grad_shard`. Here: `lab/` (notebook 06,
``fsdp-lab hsdp``: bytes per group, memory per rank, emulated nodes) and `exercises/`
(`hsdp_reduce_grad`, `mesh_groups`).
"""
