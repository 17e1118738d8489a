"""Lab 00 — the four collectives every sharding scheme is made of, run on real ranks.

    broadcast        one rank's tensor copied to all            (ZeRO / meta-init: sync states)
    all-gather       every rank's shard concatenated on all     (FSDP: unshard before use)
    reduce-scatter   sum over ranks, each keeps its own chunk   (FSDP: shard the gradients)
    all-reduce       sum over ranks, everyone keeps the whole   (DDP: average the gradients)

First on tiny tensors whose values say where they came from (who holds what, before and
after), then on a tensor of `numel` elements per rank, measured: bytes each rank moved
(counted by `fsdp_lab.comm`) beside the ring-algorithm formulas (`fsdp_lab.theory`), time per
call, and the memory trace of the buffers involved.
"""

from fsdp_lab.collectives.lab.config import CollectivesConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.collectives.lab.figures import figures
from fsdp_lab.labs.registry import LABS

LAB = LABS["collectives"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "CollectivesConfig", "figures", "run", "summary"]
