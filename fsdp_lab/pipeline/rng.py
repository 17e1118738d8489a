"""Seeding a pipeline: four ways to initialise its stages, and which equal the unsplit model.

The unsplit model is initialised by ``torch.manual_seed(s); model.init_weights()``: one
sequential random stream, read module after module in `PipeGPT.init_order()`. A stage owns a
slice of those modules. What it draws depends on where in the stream it starts:

    seed_checkpoint   rank 0 builds and initialises the *whole* model, saves it; every stage
                      loads its part. Equal to the unsplit init; needs the whole model once.
    same_seed         every stage: manual_seed(s), init its modules. Stage 1's first layer
                      reads the stream from the start, exactly as stage 0's first layer did:
                      identical weights in different layers (the classic bug).
    per_stage_seed    seeds drawn on rank 0 and broadcast, one per stage. Distinct weights,
                      trains fine, but not the unsplit init (a run is not reproducible across
                      pipeline layouts).
    rng_replay        record the init order on the meta model (before splitting), then walk it
                      on every stage: the stage owning the next module initialises it; when
                      ownership moves on, the generator state is sent to the next owner.
                      Equal to the unsplit init, and no rank ever builds the whole model.

The recording is real: `record_init_order` runs `init_weights` on a meta copy under a
`TorchFunctionMode` and notes which module each initialising call touched — so a model whose
`init_weights` walks modules in an unexpected order (the head before the layers, say) is still
replayed right: ownership then passes back and forth, one message per change of owner.

Where the real thing goes further: torchtitan's seed checkpoint (``--checkpoint.create_seed_
checkpoint``) is approach (a); on CUDA, DTensor's random ops give each shard an offset into a
counter-based (Philox) stream, which is approach (d) without messages — `fsdp_lab.meta_init`
builds the same idea by hand. Tensor-parallel shards of one layer need per-shard offsets too.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fsdp_lab import comm
from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig, init_module
from fsdp_lab.pipeline.stages import StageInfo, split_model, stage_module_names
from fsdp_lab.trace import MemoryTracker

CHECKPOINT_NAME = "pp_seed_checkpoint.pt"


# -- recording the init order on meta ---------------------------------------------------------


class _InitRecorder(TorchFunctionMode):
    """Notes the owning module of every parameter an operation is applied to, in call order."""

    def __init__(self, owner_of: dict[int, str]) -> None:
        super().__init__()
        self.owner_of, self.order = owner_of, []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        # nn.init functions pass the tensor by keyword (``tensor=``), Tensor methods as self.
        for t in (*args, *kwargs.values()):
            if id(t) in self.owner_of:
                name = self.owner_of[id(t)]
                if not self.order or self.order[-1] != name:
                    self.order.append(name)
                break
        return func(*args, **kwargs)


def record_init_order(model: nn.Module) -> list[str]:
    """The modules `model.init_weights()` initialises, in the order it does (run on meta).

    Args:
        model: a whole model on the meta device (nothing is drawn or written there).
    """
    params = list(model.parameters())
    if not params or not all(p.is_meta for p in params):
        raise ValueError("record_init_order runs init_weights on a model built on meta")
    owner_of = {
        id(p): name for name, m in model.named_modules() for p in m.parameters(recurse=False)
    }
    with torch.no_grad(), _InitRecorder(owner_of) as recorder:
        model.init_weights()
    return recorder.order


# -- building one stage -----------------------------------------------------------------------


def empty_stage(
    config: PipeGPTConfig,
    info: StageInfo,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> PipeGPT:
    """The whole model on meta, split to this stage, then made real (values: garbage)."""
    with torch.device("meta"):
        model = PipeGPT(config)
    split_model(model, info.stage, info.stages, layers_per_stage)
    return model.to_empty(device=device)


def stage_of_module(
    config: PipeGPTConfig, stages: int, layers_per_stage: list[int] | None
) -> Callable[[str], int]:
    """module name -> the stage that owns it (by its top-level name: "layers.3.attn" -> 3's)."""
    top = {
        name: s
        for s in range(stages)
        for name in stage_module_names(config, s, stages, layers_per_stage)
    }

    def stage_of(module_name: str) -> int:
        parts = module_name.split(".")
        return top[".".join(parts[:2]) if parts[0] == "layers" else parts[0]]

    return stage_of


# -- the four strategies (each runs on every rank; returns this stage, initialised) -----------


def seed_checkpoint(
    config: PipeGPTConfig,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
) -> PipeGPT:
    """(a) Rank 0 initialises the whole model and saves it; each stage loads its own keys."""
    if checkpoint_dir is None:
        raise ValueError("seed_checkpoint needs checkpoint_dir: a folder every rank can read")
    path = Path(checkpoint_dir) / CHECKPOINT_NAME
    size = torch.zeros(1, dtype=torch.int64, device=_comm_device(device))
    if info.rank == 0:
        full = PipeGPT(config).to(device)
        torch.manual_seed(seed)
        full.init_weights()
        tmp = path.with_suffix(".tmp")
        torch.save(full.state_dict(), tmp)
        os.replace(tmp, path)  # atomic: a reader never sees half a checkpoint
        size.fill_(path.stat().st_size)
        del full
    comm.broadcast(size, src=0)  # "the checkpoint is there" (and how big), a counted message
    model = empty_stage(config, info, layers_per_stage, device)
    # mmap: only the tensors this stage copies are read from the file, not the whole model.
    saved = torch.load(path, map_location=device, mmap=True, weights_only=True)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(saved[name])
    del saved
    return model


def same_seed(
    config: PipeGPTConfig,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> PipeGPT:
    """(b) The bug: every stage seeds the same and initialises its own modules."""
    model = empty_stage(config, info, layers_per_stage, device)
    torch.manual_seed(seed)
    model.init_weights()
    return model


def per_stage_seed(
    config: PipeGPTConfig,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> PipeGPT:
    """(c) Rank 0 draws one seed per stage and broadcasts them; each stage uses its own."""
    seeds = torch.zeros(info.stages, dtype=torch.int64, device=_comm_device(device))
    if info.rank == 0:
        g = torch.Generator().manual_seed(seed)
        seeds.copy_(torch.randint(0, 2**62, (info.stages,), generator=g))
    comm.broadcast(seeds, src=0)
    model = empty_stage(config, info, layers_per_stage, device)
    torch.manual_seed(int(seeds[info.stage]))
    model.init_weights()
    return model


def rng_replay(
    config: PipeGPTConfig,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
) -> PipeGPT:
    """(d) Replay the recorded init order; the generator state travels to each next owner."""
    with torch.device("meta"):
        order = record_init_order(PipeGPT(config))  # before splitting: the whole model's order
    model = empty_stage(config, info, layers_per_stage, device)
    modules = dict(model.named_modules())
    stage_of = stage_of_module(config, info.stages, layers_per_stage)

    def rank_of(stage: int) -> int:  # the same pipeline (dp replica), another stage
        return info.dp_rank * info.stages + stage

    holder = stage_of(order[0])
    if info.stage == holder:
        _seed(device, seed)
    for name in order:
        owner = stage_of(name)
        if owner != holder:  # ownership moves on: so does the generator's state
            if info.stage == holder:
                comm.send(generator_state(device), dst=rank_of(owner))
            elif info.stage == owner:
                state = generator_state(device)
                comm.recv(state, src=rank_of(holder))
                _set_rng_state(device, state)
            holder = owner
        if info.stage == owner:
            init_module(name, modules[name])
    return model


INIT = {
    "seed_checkpoint": seed_checkpoint,
    "same_seed": same_seed,
    "per_stage_seed": per_stage_seed,
    "rng_replay": rng_replay,
}


def init_stage(
    strategy: str,
    config: PipeGPTConfig,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
) -> tuple[PipeGPT, dict[str, Any]]:
    """Initialise this stage with `strategy`, measured: (model, {init_time_s, peak_bytes,
    bytes_moved, messages}). Peak: live tensor bytes during the init (MemoryTracker)."""
    if strategy not in INIT:
        raise ValueError(f"strategy={strategy!r} is unknown: allowed {list(STRATEGIES)}")
    kwargs = {"checkpoint_dir": checkpoint_dir} if strategy == "seed_checkpoint" else {}
    tracker = MemoryTracker(device if str(device).startswith("cuda") else None)
    with comm.CommLog() as log, tracker:
        start = time.perf_counter()
        model = INIT[strategy](config, info, seed, layers_per_stage, device, **kwargs)
        seconds = time.perf_counter() - start
    sent = sum(log.bytes_by_op().get(op, 0) for op in ("send", "broadcast"))
    return model, {
        "init_time_s": seconds,
        "peak_bytes": tracker.peak_bytes,
        "bytes_moved": sent,
        "messages": sum(log.calls_by_op().values()),
    }


# -- generator state, CPU or CUDA ---------------------------------------------------------------


def _is_cuda(device: torch.device | str) -> bool:
    return torch.device(device).type == "cuda"


def _comm_device(device: torch.device | str) -> torch.device:
    # NCCL moves CUDA tensors only; gloo moves CPU tensors.
    return torch.device(device) if _is_cuda(device) else torch.device("cpu")


def _seed(device: torch.device | str, seed: int) -> None:
    torch.manual_seed(seed)  # seeds the CPU generator and every CUDA generator


def generator_state(device: torch.device | str) -> torch.Tensor:
    """The state of the generator this device's init draws from, as a sendable tensor."""
    if _is_cuda(device):
        return torch.cuda.get_rng_state(torch.device(device)).to(device)
    return torch.get_rng_state()


def _set_rng_state(device: torch.device | str, state: torch.Tensor) -> None:
    if _is_cuda(device):
        torch.cuda.set_rng_state(state.cpu(), torch.device(device))
    else:
        torch.set_rng_state(state)
