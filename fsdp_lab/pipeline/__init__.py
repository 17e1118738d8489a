"""Pipeline parallelism from scratch: split a model into stages, run GPipe across ranks.

- `model`: `PipeGPT`, a GPT whose embeddings, layers (a ModuleDict) and head may be absent,
  with one documented init order drawn from the global RNG (the pp-seed lab's subject).
- `stages`: `partition` the layers, `split_model` a whole model into one stage, `stage_info`
  for this rank's place in a pp × dp mesh.
- `schedule`: `gpipe_step` (M micro-batches, send/recv of activations and their gradients)
  and `train_pipeline` (the reference's data, optional data parallelism across pipelines).

Mirrors torchtitan's ``pipeline_module_split`` and ``torch.distributed.pipelining``
(``PipelineStage``, ``ScheduleGPipe``).
"""

from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig, init_module, pipe_gpt
from fsdp_lab.pipeline.schedule import (
    average_gradients,
    check_stage,
    dp_group,
    gpipe_step,
    train_pipeline,
)
from fsdp_lab.pipeline.stages import (
    StageInfo,
    partition,
    split_model,
    stage_info,
    stage_module_names,
)

__all__ = [
    "PipeGPT",
    "PipeGPTConfig",
    "StageInfo",
    "average_gradients",
    "check_stage",
    "dp_group",
    "gpipe_step",
    "init_module",
    "partition",
    "pipe_gpt",
    "split_model",
    "stage_info",
    "stage_module_names",
    "train_pipeline",
]
