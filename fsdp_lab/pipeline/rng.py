"""Seeding a pipeline: four ways to initialise its stages, and which equal the unsplit model.

The unsplit model is initialised by ``torch.manual_seed(s); init(model)`` — for `PipeGPT`
``model.init_weights()``, for any model its init as `fsdp_lab.pipeline.init_order.model_init`
finds it: one sequential random stream, read module after module (`PipeGPT.init_order()`). A
stage owns a slice of those modules. What it draws depends on where in the stream it starts:

    seed_checkpoint   rank 0 builds and initialises the *whole* model, saves it; every stage
                      loads its part. Equal to the unsplit init; needs the whole model once.
    same_seed         every stage: manual_seed(s), init its modules. Stage 1's first layer
                      reads the stream from the start, exactly as stage 0's first layer did:
                      identical weights in different layers (the classic bug).
    per_stage_seed    seeds drawn on rank 0 and broadcast, one per stage. Distinct weights,
                      trains fine, but not the unsplit init (a run is not reproducible across
                      pipeline layouts).
    rng_replay        run the init in its order on every stage: the stage owning the module
                      being initialised draws; when the init moves on to a module of another
                      stage, the generator state is sent to that stage. Equal to the unsplit
                      init, and no rank ever builds the whole model.

What makes (c) and (d) what they are is one step each, an argument of the strategy:
`draw_stage_seeds` (rank 0's seeds) and `hand_over_generator` (run at each change of owner).
The course's exercises (`fsdp_lab.pipeline.exercises.stage_seeds`) put a learner's version there.

How a stage "initialises its modules" is the same for all four, and for any model: build the
whole model on meta, make this stage's modules real (`materialise`), run the model's own init
over the whole model — the modules left on meta draw nothing — then cut the stage out
(`fsdp_lab.pipeline.split`). The init runs watched (`fsdp_lab.pipeline.init_order.watch_init`:
every call, and which module's tensor it touches), on meta tensors as on real ones, so every
rank sees the same sequence of modules; rng_replay hands the generator on at each change of
owner in it. A model whose init walks modules in an unexpected order (the head before the
layers, say) is therefore replayed right: ownership passes back and forth, one message per
change. `record_init_order` shows that sequence for a meta model.

Every rank checks what it can before its first message — the split (`plan_stages`), that there
is an init (`model_init`), the checkpoint folder — and what it learns from running the init
(every parameter and buffer touched) it learns on every rank alike, so a model that cannot be
seeded fails on every rank at once. What only rank 0 does (write
the seed checkpoint) it reports through the broadcast the others wait on: they raise too,
instead of waiting for a message that will not come.

Where the real thing goes further: torchtitan's seed checkpoint (``--checkpoint.create_seed_
checkpoint``) is approach (a), and its pipeline stages otherwise get a seed each, approach (c);
on CUDA, DTensor's random ops give each shard an offset into a counter-based (Philox) stream —
no messages, replicas alike, shards distinct, though (pytorch/pytorch#168058) not the values one
device would draw. `fsdp_lab.meta_init.counter_init` builds the counter idea by hand, exactly. Tensor-
parallel shards of one layer need per-shard offsets too.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_lab import comm
from fsdp_lab.choices import SEEDING_STRATEGIES as STRATEGIES
from fsdp_lab.pipeline.init_order import (
    InitFn,
    Model,
    Stages,
    materialise,
    own_stage,
    prepare,
    record_init_order,  # noqa: F401  (here for the lab and the diagrams, which import it so)
    run_init,
    whole_on_meta,
)
from fsdp_lab.pipeline.split import plan_stages
from fsdp_lab.pipeline.stages import StageInfo, build_stage

CHECKPOINT_NAME = "pp_seed_checkpoint.pt"


def stage_of_module(
    model: Model, stages: int | Stages, layers_per_stage: list[int] | None = None
) -> Callable[[str], int | None]:
    """module name -> the stage that owns it ("layers.3.attn" -> layer 3's), None if none."""
    return plan_stages(whole_on_meta(model), stages, layers_per_stage).stage_of


# -- the two steps a strategy can be given (the course's exercises replace them) ---------------

SeedDraw = Callable[[int, int], torch.Tensor]  # (seed, stages) -> one seed per stage
HandOver = Callable[[int | None, int, int, int, Callable[[int], int], Any], None]


def draw_stage_seeds(seed: int, stages: int) -> torch.Tensor:
    """(c)'s seeds: `stages` int64 values in [0, 2**62) from a generator seeded with `seed`.

    A function of `seed` alone (the same run again gets the same seeds, whatever the program
    drew before); one draw each, so two stages, or two base seeds, do not share a stream the
    way ``seed + stage`` would (seed 1's stage 0 is seed 0's stage 1)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2**62, (stages,), generator=g)


def _checked_seeds(drawn: Any, stages: int) -> torch.Tensor:
    ok = isinstance(drawn, torch.Tensor) and not drawn.is_floating_point()
    if not ok or tuple(drawn.shape) != (stages,):
        raise ValueError(
            f"the stage seeds must be an integer tensor of shape ({stages},), one per stage; "
            f"got {type(drawn).__name__} {getattr(drawn, 'shape', drawn)!r:.80}"
        )
    if bool((drawn < 0).any()):
        raise ValueError(
            f"stage seeds must be >= 0; got {drawn.tolist()}: draw them in [0, 2**62), as "
            "draw_stage_seeds does"
        )
    return drawn


def hand_over_generator(
    holder: int | None,
    owner: int,
    stage: int,
    seed: int,
    rank_of: Callable[[int], int],
    device: torch.device | str = "cpu",
) -> None:
    """(d)'s step at a change of owner, run on every rank: the init moves from a module of stage
    `holder` (None: the init is starting) to one of stage `owner`; this rank is stage `stage`.

    At the start the owner seeds, as the unsplit init does. Later the holder — whose modules
    have drawn their values — sends its generator's state to the owner, which continues from
    it: the stream reads on as if one process drew everything. `rank_of(stage)` is the global
    rank of a stage of this pipeline."""
    if holder is None:  # the init's first module: its stage seeds, as the unsplit init
        if stage == owner:
            _seed(device, seed)
    elif stage == holder:  # ownership moves on: so does the generator's state
        comm.send(generator_state(device), dst=rank_of(owner))
    elif stage == owner:
        state = generator_state(device)  # a buffer of the right size, overwritten by recv
        comm.recv(state, src=rank_of(holder))
        set_generator_state(device, state)


# -- the four strategies (each runs on every rank; returns this stage, initialised) -----------


def seed_checkpoint(
    model: Model,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    stages: Stages = None,
    init: InitFn | None = None,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """(a) Rank 0 initialises the whole model and saves it; each stage loads its own keys."""
    if checkpoint_dir is None or not Path(checkpoint_dir).is_dir():
        raise ValueError(
            f"checkpoint_dir={checkpoint_dir!r}: seed_checkpoint needs an existing folder every "
            "rank can read (e.g. tempfile.mkdtemp() on rank 0, its path sent to the others)"
        )
    whole, plan, init_fn = prepare(model, info, layers_per_stage, stages, init)
    path = Path(checkpoint_dir) / CHECKPOINT_NAME
    size = torch.zeros(1, dtype=torch.int64, device=_comm_device(device))
    failed: Exception | None = None
    if info.rank == 0:
        try:
            full = copy.deepcopy(whole)  # meta: free
            materialise([full], device)
            torch.manual_seed(seed)
            run_init(full, plan, init_fn)
            tmp = path.with_suffix(".tmp")
            torch.save(stage_tensors(full), tmp)
            os.replace(tmp, path)  # atomic: a reader never sees half a checkpoint
            size.fill_(path.stat().st_size)
            del full
        except Exception as exc:  # the others wait in the broadcast below: tell them
            failed = exc
            size.fill_(-1)
    # "the checkpoint is there" (and how big), a counted message
    comm.broadcast(size, src=world_rank(group, 0), group=group)
    if failed is not None:
        raise failed
    if int(size) < 0:
        raise RuntimeError(
            "rank 0 could not write the seed checkpoint (its error is reported with rank 0's), "
            "so this rank has nothing to load"
        )
    spec = own_stage(whole, plan, info, device)
    stage = build_stage(whole, spec)
    # mmap: only the tensors this stage copies are read from the file, not the whole model.
    saved = torch.load(path, map_location=device, mmap=True, weights_only=True)
    with torch.no_grad():
        for name, tensor in stage_tensors(stage).items():
            tensor.copy_(saved[name])
    del saved
    return stage


def same_seed(
    model: Model,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    *,
    stages: Stages = None,
    init: InitFn | None = None,
    group: dist.ProcessGroup | None = None,  # it sends nothing: accepted like the others
) -> nn.Module:
    """(b) The bug: every stage seeds the same and initialises its own modules."""
    whole, plan, init_fn = prepare(model, info, layers_per_stage, stages, init)
    spec = own_stage(whole, plan, info, device)
    torch.manual_seed(seed)
    run_init(whole, plan, init_fn)  # the modules left on meta draw nothing
    return build_stage(whole, spec)


def per_stage_seed(
    model: Model,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    *,
    stages: Stages = None,
    init: InitFn | None = None,
    group: dist.ProcessGroup | None = None,
    stage_seeds: SeedDraw = draw_stage_seeds,
) -> nn.Module:
    """(c) Rank 0 draws one seed per stage and broadcasts them; each stage uses its own.

    `stage_seeds(seed, stages)` is how rank 0 draws them (default `draw_stage_seeds`; the
    course's exercise puts a learner's version here)."""
    whole, plan, init_fn = prepare(model, info, layers_per_stage, stages, init)
    seeds = torch.zeros(info.stages, dtype=torch.int64, device=_comm_device(device))
    failed: Exception | None = None
    if info.rank == 0:
        try:
            seeds.copy_(_checked_seeds(stage_seeds(seed, info.stages), info.stages))
        except Exception as exc:  # the others wait in the broadcast below: tell them
            failed = exc
            seeds.fill_(-1)  # a seed is >= 0: -1 says "no seeds"
    comm.broadcast(seeds, src=world_rank(group, 0), group=group)
    if failed is not None:
        raise failed
    if int(seeds[0]) < 0:
        raise RuntimeError(
            "rank 0 could not draw the stage seeds (its error is reported with rank 0's), so "
            "this stage has no seed"
        )
    spec = own_stage(whole, plan, info, device)
    torch.manual_seed(int(seeds[info.stage]))
    run_init(whole, plan, init_fn)
    return build_stage(whole, spec)


def rng_replay(
    model: Model,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    *,
    stages: Stages = None,
    init: InitFn | None = None,
    group: dist.ProcessGroup | None = None,
    hand_over: HandOver = hand_over_generator,
) -> nn.Module:
    """(d) Run the init in its order everywhere; the generator state travels to each next owner.

    `hand_over` is the step run on every rank at each change of owner (default
    `hand_over_generator`; the course's exercise puts a learner's version here)."""
    whole, plan, init_fn = prepare(model, info, layers_per_stage, stages, init)
    spec = own_stage(whole, plan, info, device)

    def rank_of(stage: int) -> int:  # the same pipeline (dp replica), another stage
        return world_rank(group, info.dp_rank * info.stages + stage)

    holder: int | None = None  # the stage whose generator the init is drawing from

    def hand_on(module_name: str) -> None:  # called before the op on `module_name` runs
        nonlocal holder
        owner = plan.stage_of(module_name)
        if owner is None or owner == holder:
            return
        hand_over(holder, owner, info.stage, seed, rank_of, device)
        holder = owner

    # Every rank runs the whole init and sees every call (the modules it does not own are on
    # meta: watched, not drawn), so all agree on when ownership changes: sends meet recvs.
    run_init(whole, plan, init_fn, hand_on)
    return build_stage(whole, spec)


INIT = {
    "seed_checkpoint": seed_checkpoint,
    "same_seed": same_seed,
    "per_stage_seed": per_stage_seed,
    "rng_replay": rng_replay,
}


def init_stage(
    strategy: str,
    model: Model,
    info: StageInfo,
    seed: int,
    layers_per_stage: list[int] | None = None,
    device: torch.device | str = "cpu",
    checkpoint_dir: str | os.PathLike | None = None,
    *,
    stages: Stages = None,
    init: InitFn | None = None,
    group: dist.ProcessGroup | None = None,
) -> nn.Module:
    """This rank's stage, initialised with `strategy` (one of the four above).

    Args:
        strategy: one of `STRATEGIES`.
        model: a `PipeGPTConfig`, or the whole model to seed, any nn.Module (its values are not
            used: build it on meta, ``with torch.device("meta"): model = Model()``).
        info: this rank's place (`stage_info`).
        seed: the seed of the unsplit init, ``torch.manual_seed(seed); init(model)``.
        layers_per_stage: the default split's layers per stage (`partition`).
        device: where the stage's tensors live.
        checkpoint_dir: seed_checkpoint's folder, readable by every rank.
        stages: the module names of each stage, or a `StagePlan` (default: the default split
            into ``info.stages`` stages; see `fsdp_lab.pipeline.split`).
        init: the model's init as a function of the whole model (default: `model_init`).
        group: the ranks the pipeline(s) run on, `info` being this rank's place among them
            (default: every rank). The broadcasts of (a) and (c) go over it, and (d)'s
            handoffs to its ranks; the ranks outside it take no part.
    """
    if strategy not in INIT:
        raise ValueError(f"strategy={strategy!r} is unknown: allowed {list(STRATEGIES)}")
    kwargs: dict[str, Any] = {"stages": stages, "init": init, "group": group}
    if strategy == "seed_checkpoint":
        kwargs["checkpoint_dir"] = checkpoint_dir
    return INIT[strategy](model, info, seed, layers_per_stage, device, **kwargs)


def stage_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a seed checkpoint holds: the state_dict, plus non-persistent buffers (a rotary
    cache is not in a state_dict, but a stage that loads instead of initialising needs it)."""
    tensors = model.state_dict()
    for name, buffer in model.named_buffers():
        tensors.setdefault(name, buffer)
    return tensors


def world_rank(group: dist.ProcessGroup | None, group_rank: int) -> int:
    """The world rank of `group`'s rank `group_rank` (the world's: itself)."""
    return group_rank if group is None else dist.get_global_rank(group, group_rank)


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


def set_generator_state(device: torch.device | str, state: torch.Tensor) -> None:
    """Make this device's generator continue from `state` (what `generator_state` returned)."""
    if _is_cuda(device):
        torch.cuda.set_rng_state(state.cpu(), torch.device(device))
    else:
        torch.set_rng_state(state)
