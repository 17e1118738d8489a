"""FSDP / ZeRO from scratch: flat parameters, gather/free per unit, reduce-scatter, prefetch.

Read in this order: `flat_param.py` (the storage), `unit.py` (one unit's step, hook by hook),
`shard.py` (the entry point and strategies), `materialize.py` (meta models, unit by unit),
`whole_view.py` (a model's own init code on its shards), `state_dict.py` (checkpoints, grad
clipping); `sharded_optimizer.py` (ZeRO-1 as an optimizer beside DDP, PyTorch's
ZeroRedundancyOptimizer).
"""

from fsdp_lab.choices import SHARDING_STRATEGIES as STRATEGIES
from fsdp_lab.sharding.shard import MixedPrecision, shard, sharding_state
from fsdp_lab.sharding.sharded_optimizer import ShardedOptimizer
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
    "ShardedOptimizer",
    "clip_grad_norm_",
    "full_init",
    "full_state_dict",
    "load_full_state_dict",
    "load_sharded",
    "save_sharded",
    "shard",
    "sharding_state",
]
