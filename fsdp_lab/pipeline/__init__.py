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

from fsdp_lab.lazy import lazy_names

# Public name -> the module that defines it, imported on first use (torch-free until then: the
# labs' configs live in this package).
_PUBLIC = {
    "PipeGPT": "fsdp_lab.pipeline.model",
    "PipeGPTConfig": "fsdp_lab.pipeline.model",
    "init_module": "fsdp_lab.pipeline.model",
    "pipe_gpt": "fsdp_lab.pipeline.model",
    "average_gradients": "fsdp_lab.pipeline.schedule",
    "check_stage": "fsdp_lab.pipeline.schedule",
    "dp_group": "fsdp_lab.pipeline.schedule",
    "gpipe_step": "fsdp_lab.pipeline.schedule",
    "train_pipeline": "fsdp_lab.pipeline.schedule",
    "plan_stages": "fsdp_lab.pipeline.split",
    "split_model": "fsdp_lab.pipeline.split",
    "SequentialStage": "fsdp_lab.pipeline.stages",
    "StageInfo": "fsdp_lab.pipeline.stages",
    "StagePlan": "fsdp_lab.pipeline.stages",
    "partition": "fsdp_lab.pipeline.stages",
    "stage_info": "fsdp_lab.pipeline.stages",
    "stage_module_names": "fsdp_lab.pipeline.stages",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
