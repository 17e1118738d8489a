"""Lab 04 — meta-device init: build any size without memory, materialise only each rank's shard.

1. Shapes without storage: Llama-3-70B's shape built under ``torch.device("meta")`` in a fresh
   process, timed, its resident memory sampled (`meta_init.build_on_meta`, `RssSampler`);
   parameters and bytes by dtype, and the per-rank model state of each ZeRO stage.
2. The host-memory picture, on the ranks: resident memory over time while a Llama of `model_mb`
   is built the ordinary way and then sharded (every rank holds the whole model: a spike), and
   while the same model is built on meta and `shard` materialises it unit by unit (model/N
   plus one unit) or fills each shard directly (`shard_init`: model/N).
3. During those `shard` calls the `MemoryTracker` measures each rank's peak tensor bytes.
4. Is the materialised model right? A tied Llama keeps its tie through `shard`, which refuses
   one that `to_empty` untied; buffers equal an ordinary build's; the ranks agree —
   `sync_module_states` against `DeterministicInit`, each bitwise against one process, time
   and bytes as the model grows — and why ``kaiming_uniform_`` on a shard cannot do it.
5. Init code on a parent module (TinyGPT's ``init_weights()`` on its root): the course-note
   recipe "``reset_parameters()`` on every module that owns parameters" against `shard`'s
   order (children first, the parent last) and torchtitan's ``init_weights()`` on the shards,
   each bitwise against one process.

Every sentence the notebook and ``fsdp-lab meta-init`` show that compares two measurements is
written by `report` from the result.

This is torchtitan's order (meta build -> parallelise -> ``to_empty`` -> ``init_weights``) and
FSDP1's ``param_init_fn`` / ``sync_module_states``, each step measured. The parts, in the order
the data flows: `config` · `measure` (the ranks and the fresh process; `parent_init`, part 5
on the ranks) · `one_process` (the references the ranks must equal, no ranks) · `analysis` ·
`report` (the sentences, the tables and the summary) and `figures`.
"""

from fsdp_lab.labs.registry import LABS
from fsdp_lab.meta_init.lab.config import MetaInitConfig

# Its module first, then this name: `figures` is the function (the module is `figures.py`).
from fsdp_lab.meta_init.lab.figures import figures

LAB = LABS["meta-init"]
run, summary = LAB.run, LAB.report

__all__ = ["LAB", "MetaInitConfig", "figures", "run", "summary"]
