"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

One run: the same model and data trained three ways —
  1. single process, whole batch                  (the ground truth)
  2. `fsdp_lab.shard` on N ranks, one strategy     (ours: every byte counted, memory traced)
  3. PyTorch's `fully_shard` (FSDP2) on N ranks    (the real thing)
— then compared parameter by parameter, and our measured memory and bytes per step set
beside the formulas of `fsdp_lab.theory` (Ψ parameters, N ranks, b bytes per element).

With strategy="optimizer" (ZeRO-1 as a whole-model transformation) the run also trains ZeRO-1
as an optimizer: DDP (``shard(strategy="none")``) + `ShardedOptimizer`, PyTorch's
ZeroRedundancyOptimizer contract, and measures its optimizer state and bytes beside it.

    config.py       ShardConfig: strategy, steps, optimizer, model, ... (the CLI's options)
    measure.py      the runs, on the ranks and in one process
    analysis.py     agreement, peaks and bytes against `theory.sharding_step`
    report.py       the sentences and tables
    figures.py      the figures (also the walkthrough's stages)
    walkthrough.py  one tiny unit through one step, stage by stage: notebook 01's section 3
"""

from fsdp_lab.labs.registry import LABS
from fsdp_lab.sharding.lab.config import ShardConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.sharding.lab.figures import figures

LAB = LABS["shard"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "ShardConfig", "figures", "run", "summary"]
