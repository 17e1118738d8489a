"""Measuring what really happens on a rank: live tensor memory and compute/communication spans.

`memory.MemoryTracker` counts the bytes of tensor storages that exist (created and freed),
`timeline.Timeline` records when a rank computed and when it communicated, `rss.RssSampler`
samples the process's resident memory (what the operating system sees), `cuda_memory` reads a
process's GPU memory beyond its tensors (allocator reserve, CUDA context). Every memory or
timing figure a lab reports comes from here, never from a mechanism's own bookkeeping.
"""

from fsdp_lab.trace.memory import CATEGORIES, MemoryTracker, category, mark
from fsdp_lab.trace.rss import RssSampler
from fsdp_lab.trace.timeline import Timeline, compute_span

__all__ = [
    "CATEGORIES",
    "MemoryTracker",
    "RssSampler",
    "Timeline",
    "category",
    "compute_span",
    "mark",
]
