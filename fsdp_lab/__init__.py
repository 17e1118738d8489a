"""fsdp_lab — build the machinery of large-model training from scratch, run it on real ranks,
measure it live, next to the theory and next to PyTorch's own implementation.

Public names (everything else may change):

- `Cluster`, `RankError`: live rank processes for notebooks (`cluster.run(fn)`).
- `rank()`, `world_size()`, `device()`: where am I, inside a rank.
- `trace.MemoryTracker`, `trace.Timeline`: measured memory and compute/communication spans.
- `comm`: the collectives, with byte and time accounting.
- `shard(model, units=..., strategy=...)`, `MixedPrecision`: FSDP/ZeRO from scratch.
- `LabResult`: what every `fsdp_lab.labs.<lab>.run(...)` returns.
"""

from fsdp_lab import comm, trace
from fsdp_lab.cluster import Cluster, RankError, device, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.sharding import MixedPrecision, shard

__all__ = [
    "Cluster",
    "LabResult",
    "MixedPrecision",
    "RankError",
    "comm",
    "device",
    "rank",
    "shard",
    "trace",
    "world_size",
]
__version__ = "0.1.0"
