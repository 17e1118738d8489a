"""Lab 03 — weight tying under wrap policies: one matrix, two modules, one wrap unit.

TinyGPT's language-model head *is* its token embedding (`head.weight is tok_emb.weight`, as in
GPT-2). The lab finds the tie and draws valid and invalid wrap plans (`plans.py`); on the ranks
(`measure.py`) it shards the model with a valid plan and checks the tie after training (and
the parameters against a single process), runs the live audit of an invalid plan through
FSDP1, FSDP2 and ours (`audit.py`), shows that `to_empty` unties (and that `shard` refuses
until `retie`), and traces what it costs to leave the tied pair to the root unit — the spike,
read in `analysis.py`, said in `report.py`, drawn in `figures.py`.

Every section runs on TinyGPT at the config's sizes (``vocab``, ``dim``, ``layers``, ``heads``,
``seq_len``) and batch. With ``model="module:factory"`` (``fsdp-lab tying --model ...``) the
verification and the audit run on that model instead, at its own sizes, with plans made from
its first tie (`plans.tie_plans`); the plan diagrams, the to_empty demonstration (TinyGPT's
`init_weights`) and the spike stay on TinyGPT. The result's ``sections`` says, per section,
which model it built and its sizes, read off that model.
"""

from fsdp_lab.labs.registry import LABS
from fsdp_lab.tying.lab.config import TyingConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.tying.lab.figures import figures

LAB = LABS["tying"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "TyingConfig", "figures", "run", "summary"]
