"""FSDP / ZeRO from scratch: flat parameters, gather/free per unit, reduce-scatter, prefetch.

Read in this order — `shard()`'s lifecycle, in this folder, each file once: `apply.py`
(`shard()`, the lifecycle in five steps, and what it refuses before any message), `mesh.py`
(the process groups), `wrap.py` (which modules form a unit), `ties.py` (tied parameters, which
a plan must keep in one unit), `policy.py` (what one unit does differently: "replicate" and
DDP's gradient buckets, its precision, CPU offload), `flat_param.py` (a unit's flat storage and
its builder), `materialize.py` (meta models, unit by unit, and the whole view a model's own
init code sees), `unit.py` (one unit's step, hook by hook), `steps.py` (the five steps a
learner writes), `state.py` (what the units share). Beside the lifecycle: `state_dict.py` (full
checkpoints, grad clipping), `sharded_checkpoint.py` (crash-safe sharded checkpoints),
`sharded_optimizer.py` (ZeRO-1 as an optimizer beside DDP, PyTorch's ZeroRedundancyOptimizer).

[Note: our names in PyTorch's] The same lifecycle under three vocabularies, so that each lesson
maps onto the code a learner meets next:

    fsdp_lab                      FSDP1 (FullyShardedDataParallel)   FSDP2 (fully_shard)
    ----------------------------  ---------------------------------  ---------------------------
    unit (ShardedUnit)            FSDP instance / its handle         FSDPParamGroup (a module's
                                  (FlatParamHandle)                  params), FSDPState per module
    FlatParameter (flat_param.py) FlatParameter: one flat padded     no flat buffer: a DTensor per
                                  1-D tensor per unit, shard r kept  parameter (FSDPParam), Shard(0)
    per-parameter views           use_orig_params=True               the default (DTensor params)
    ShardingState (state.py)      the root FSDP instance's state     FSDPState of the root module
    strategy "full"/"grad_op"/    ShardingStrategy.FULL_SHARD /      reshard_after_forward=True /
      "none"                        SHARD_GRAD_OP / NO_SHARD           False / (replicate / DDP)
    reshard_after_forward         FULL_SHARD frees after forward     reshard_after_forward
    unshard / reshard             _unshard / _reshard                unshard / reshard
    finalize_backward             _post_backward_final_callback      finalize_backward (root's
                                                                     _root_post_backward_final_
                                                                     callback runs it per group)
    prefetch (recorded order)     forward_prefetch / backward_       implicit prefetch of the next
                                  prefetch=BACKWARD_PRE              group; set_modules_to_*_prefetch
    TrainingState                 TrainingState / HandleTrainingState  TrainingState
    MixedPrecision(param_dtype,   MixedPrecision(param_dtype,         MixedPrecisionPolicy(
      reduce_dtype, output_dtype,   reduce_dtype, buffer_dtype,         param_dtype, reduce_dtype,
      cast_forward_inputs)          cast_forward_inputs)                output_dtype,
                                                                        cast_forward_inputs)

Where they differ in substance: FSDP1 flattens like we do (one all-gather per unit, views into
it); FSDP2 keeps each parameter a DTensor sharded on dim 0 and copies into/out of a per-group
all-gather buffer, which frees it from a flat parameter's restrictions (mixed requires_grad,
per-parameter dtypes) at the cost of those copies.
"""

from fsdp_lab.lazy import lazy_names

# Public name -> the module that defines it, imported on first use (torch-free until then: the
# labs' configs live in this package).
_PUBLIC = {
    "MixedPrecision": "fsdp_lab.sharding.policy",
    "UnitPolicy": "fsdp_lab.sharding.policy",
    "shard": "fsdp_lab.sharding.apply",
    "CorruptCheckpointError": "fsdp_lab.sharding.sharded_checkpoint",
    "load_sharded": "fsdp_lab.sharding.sharded_checkpoint",
    "save_sharded": "fsdp_lab.sharding.sharded_checkpoint",
    "ShardedOptimizer": "fsdp_lab.sharding.sharded_optimizer",
    "sharding_state": "fsdp_lab.sharding.state",
    "clip_grad_norm_": "fsdp_lab.sharding.state_dict",
    "full_state_dict": "fsdp_lab.sharding.state_dict",
    "load_full_state_dict": "fsdp_lab.sharding.state_dict",
    "ShardingSteps": "fsdp_lab.sharding.steps",
    "full_init": "fsdp_lab.sharding.materialize",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
