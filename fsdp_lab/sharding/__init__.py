"""FSDP / ZeRO from scratch: flat parameters, gather/free per unit, reduce-scatter, prefetch.

Read in this order: `flat_param.py` (the storage), `unit.py` (one unit's step, hook by hook),
`shard.py` (the entry point and strategies), `materialize.py` (meta models, unit by unit),
`whole_view.py` (a model's own init code on its shards), `state_dict.py` (checkpoints, grad
clipping).
"""

from fsdp_lab.choices import SHARDING_STRATEGIES as STRATEGIES
from fsdp_lab.sharding.shard import MixedPrecision, shard, sharding_state
from fsdp_lab.sharding.state_dict import (
    CorruptCheckpointError,
    clip_grad_norm_,
    full_state_dict,
    load_full_state_dict,
    load_sharded,
    save_sharded,
)
from fsdp_lab.sharding.whole_view import full_init

__all__ = [
    "STRATEGIES",
    "CorruptCheckpointError",
    "MixedPrecision",
    "clip_grad_norm_",
    "full_init",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "save_sharded",
    "shard",
    "sharding_state",
]
