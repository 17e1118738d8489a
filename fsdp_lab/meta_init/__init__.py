"""Meta-device init: build any size without memory, then give every rank its shard's values.

Read in this order: `meta_device.py` (a build on the meta device that skips init fills),
`counter_init.py` (a counter-based init: any slice of any parameter, alone, bit for bit), then
`fsdp_lab.sharding.materialize` (ordinary init module by module, straight into the shards) and
`fsdp_lab.sharding.ties.to_empty_tied` (ties kept through `to_empty`). Beside them: `lab/` (notebook
04, ``fsdp-lab meta-init``) and `exercises/` (`param_shard`, `retie`).
"""
