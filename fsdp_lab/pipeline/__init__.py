"""Pipeline parallelism from scratch: split a model into stages, run GPipe across ranks.

- `model`: `PipeGPT`, a GPT whose embeddings, layers (a ModuleDict) and head may be absent,
  with one documented init order drawn from the global RNG (the pp-seed lab's subject).
- `split`: `plan_stages` names and checks each stage's modules for any nn.Module (a default
  split of its `layers`/`blocks`/`h`, or names given), `split_model` cuts one stage out;
  `probe` finds what flows between the stages by running a probe batch through them.
- `stages`: `partition` the layers, `StagePlan`, the stage module (`SequentialStage`, or the
  model with the other stages' modules removed), `stage_info` for this rank's place in a
  pp × dp mesh.
- `init_order` and `rng`: the model's init watched call by call, and four ways to seed the
  stages (`init_stage`).
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
from fsdp_lab.pipeline.split import plan_stages, split_model
from fsdp_lab.pipeline.stages import (
    SequentialStage,
    StageInfo,
    StagePlan,
    partition,
    stage_info,
    stage_module_names,
)

__all__ = [
    "PipeGPT",
    "PipeGPTConfig",
    "SequentialStage",
    "StageInfo",
    "StagePlan",
    "average_gradients",
    "check_stage",
    "dp_group",
    "gpipe_step",
    "init_module",
    "partition",
    "pipe_gpt",
    "plan_stages",
    "split_model",
    "stage_info",
    "stage_module_names",
    "train_pipeline",
]
