"""Lab 06 — hybrid sharding (HSDP): shard inside a node, replicate across nodes.

With N ranks in nodes of S GPUs, full FSDP all-gathers (N−1)/N·Ψ·b per rank per all-gather over
the whole world — across the slow inter-node network as soon as there are two nodes. HSDP
shards over the S ranks of a node ((S−1)/S·Ψ·b on the fast link) and all-reduces each rank's
gradient shard across the N/S replicas: the per-rank volume barely differs, what differs is
which link carries it — and the inter-node all-reduce HSDP adds, which textbook formulas often
leave out. HSDP's capacity is S×VRAM, not N×VRAM.

One run, on a 2-D (R, S) mesh of real ranks:
  1. full FSDP, `hybrid` and `hybrid_zero2` (`fsdp_lab.shard(..., mesh=(R, S))`), each measured
     as it trains: bytes per group and op, model state per rank
  2. PyTorch's HSDP on the same 2-D DeviceMesh: fully_shard and FSDP1's HYBRID_SHARD
  3. single-process training on the whole batch
— compared parameter by parameter and against `theory.hybrid_step`; then the capacity argument
and an alpha-beta network model (`fsdp_lab.netsim`) from 1 to 256 nodes.

    config.py    HsdpConfig: mesh, steps, optimizer, model, network-model knobs (CLI options)
    measure.py   the runs on the ranks, and one process
    analysis.py  agreement, bytes per group, memory, NIC bytes, capacity, the network model
    report.py    the tables and the notebook's paragraphs
    figures.py   the mesh diagram and the figures
"""

from fsdp_lab.hsdp.lab.config import HsdpConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.hsdp.lab.figures import figures
from fsdp_lab.labs.registry import LABS

LAB = LABS["hsdp"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "HsdpConfig", "figures", "run", "summary"]
