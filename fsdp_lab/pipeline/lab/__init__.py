"""Lab 05 — pipeline-parallel RNG seeding: four ways to initialise a pipeline's stages, and
which of them equal the unsplit model bitwise, at what cost.

The unsplit model is initialised by ``PipeGPT(config); torch.manual_seed(s);
model.init_weights()``: one random stream, read module after module. A stage owns a slice of
the modules, and each strategy of `fsdp_lab.pipeline.rng` initialises that slice differently:

    seed_checkpoint   rank 0 builds the whole model, saves it, every stage loads its keys
    same_seed         every stage seeds alike (the bug: later stages repeat stage 0's draws)
    per_stage_seed    one broadcast seed per stage (distinct, but not the unsplit init)
    rng_replay        the recorded init order replayed, the generator state handed on

`measure.py` initialises every rank's stage with each (repeated, timed in wall and CPU time,
its peak memory and messages taken around `init_stage`), trains each pipeline with GPipe beside
single-process training of the reference, grows the model to show what the seed checkpoint
costs rank 0, and if asked times the init again on 1, 2, ... ranks (`scale_ranks`) and trains
the unsplit and the same-seed inits on a learnable task (`convergence.py`). `analysis.py`
compares every stage with the reference and the stages with each other, and, with more ranks
than stages (pp x dp), the replicas of each stage; `timing.py` turns the repeats into medians
and trends. `report.py` says what was measured in sentences and tables built from the result (with
the course-note claims "exact seeding makes init O(1) in the number of nodes" and "the same seed
on every stage harms convergence", judged), `figures.py` draws it. Mirrors
torchtitan's seed checkpoint (``--checkpoint.create_seed_checkpoint``) and
``torch.distributed.pipelining``.
"""

from fsdp_lab.labs.registry import LABS
from fsdp_lab.pipeline.lab.config import PPSeedConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.pipeline.lab.figures import figures

LAB = LABS["pp-seed"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "PPSeedConfig", "figures", "run", "summary"]
