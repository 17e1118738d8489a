"""fsdp_lab — build the machinery of large-model training from scratch, run it on real ranks,
measure it live, next to the theory and next to PyTorch's own implementation.

Public names (everything else may change):

- `Cluster`, `RankError`: live rank processes for notebooks (`cluster.run(fn)`).
- `rank()`, `world_size()`, `device()`: where am I, inside a rank.
- `trace.MemoryTracker`, `trace.Timeline`: measured memory and compute/communication spans.
- `comm`: the collectives, with byte and time accounting.
- `shard(model, units=..., strategy=...)`, `MixedPrecision`: FSDP/ZeRO from scratch.
- `ShardedOptimizer(params, optimizer_class, **kwargs)`: ZeRO-1 as an optimizer, with
  PyTorch's `ZeroRedundancyOptimizer` contract (beside DDP).
- `LabResult`: what every `fsdp_lab.<topic>.lab.run(...)` returns.
- `plan(model, gpus, ...)`: a real run planned (memory, bytes, step time), `verify="fake"` runs
  it on a fake rank.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fsdp_lab.lazy import lazy_names

# Loaded on first use (PEP 562), not here: `import fsdp_lab` must not import torch, which takes
# seconds, so that `fsdp-lab --help` and the labs' configs load at once.
_PUBLIC = {  # public name -> the module that defines it
    "Cluster": "fsdp_lab.cluster",
    "LabResult": "fsdp_lab.labs",
    "MixedPrecision": "fsdp_lab.sharding",
    "RankError": "fsdp_lab.cluster",
    "ShardedOptimizer": "fsdp_lab.sharding",
    "comm": "fsdp_lab.comm",  # a module: the name is the module itself
    "plan": "fsdp_lab.planning.planner",
    "device": "fsdp_lab.cluster",
    "rank": "fsdp_lab.cluster",
    "shard": "fsdp_lab.sharding",
    "trace": "fsdp_lab.trace",
    "world_size": "fsdp_lab.cluster",
}

if TYPE_CHECKING:  # what type checkers and editors see: the names, eagerly
    from fsdp_lab import comm, trace
    from fsdp_lab.cluster import Cluster, RankError, device, rank, world_size
    from fsdp_lab.labs import LabResult
    from fsdp_lab.planning.planner import plan
    from fsdp_lab.sharding import MixedPrecision, ShardedOptimizer, shard

__all__ = [
    "Cluster",
    "LabResult",
    "MixedPrecision",
    "RankError",
    "ShardedOptimizer",
    "comm",
    "plan",
    "device",
    "rank",
    "shard",
    "trace",
    "world_size",
]
__version__ = "0.1.0"

__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
