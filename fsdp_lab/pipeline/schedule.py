"""GPipe from scratch: M micro-batches through S stages, all forwards, then all backwards.

GPipe (Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline
Parallelism"; PyTorch: ``torch.distributed.pipelining.ScheduleGPipe``, which torchtitan
drives) cuts the batch into M micro-batches so that stage s can work on micro-batch i while
stage s+1 works on micro-batch i-1. One step, on every stage, in the order it happens:

    forward, i = 0..M-1:   x_i = recv(prev)  (stage 0: slice i of the token ids)
                           out_i = stage(x_i)              keep x_i and out_i for backward
                           send(out_i, next)  (last stage: loss_i = CE(out_i, y_i) / M)
    backward, i = M-1..0:  g = recv(next)     (last stage: loss_i.backward())
                           out_i.backward(g)               parameter grads accumulate
                           send(x_i.grad, prev)  (stage 0 has nothing to send)

Each loss is divided by M, so the accumulated gradients are those of the mean loss over the
whole batch — what single-process training computes in one go. Only activations (B/M, T, dim)
and their gradients cross stage boundaries: per step a pipeline sends
2 (S-1) M (B/M T dim 4) bytes in fp32, whatever the layers hold. The price is the bubble:
stage s idles for s micro-batch slots before its first forward and as long after its last
backward, a fraction (S-1)/(M+S-1) of the step, which a `fsdp_lab.trace.Timeline` shows
(compute spans "forward mb i"/"backward mb i", comm spans "send"/"recv": a recv that waits is
the bubble). GPipe also keeps all M micro-batches' activations alive at the turn from forward
to backward; 1F1B schedules (PipeDream-Flush) bound that to S — where the real thing goes
further.

Data parallelism on top (a 2-D mesh pp × dp, see `fsdp_lab.pipeline.stages`): each pipeline
trains its slice of the global batch and every stage averages its gradients with the same
stage of the other pipelines before the optimizer step (`dp_group`, `average_gradients`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab import comm
from fsdp_lab.cluster import rank, world_size
from fsdp_lab.models import synthetic_batch
from fsdp_lab.pipeline.stages import StageInfo, StageSpec
from fsdp_lab.reference import local_slice
from fsdp_lab.trace import category, compute_span, mark


def check_stage(model: nn.Module, info: StageInfo) -> StageSpec:
    """Raise a clear error unless this process and `model` are the stage `info` describes;
    return the model's `StageSpec` (what it receives and sends)."""
    world = world_size()
    if info.stages * info.dp_size != world:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"StageInfo is for S={info.stages} stages x dp={info.dp_size} pipelines = "
            f"{info.stages * info.dp_size} ranks, but world_size={world}: allowed S in "
            f"{divisors}; build it with stage_info(rank(), world_size(), S, n_layers)"
        )
    if info.rank != rank():
        raise ValueError(f"StageInfo is for rank {info.rank}, but this is rank {rank()}")
    spec = getattr(model, "stage_spec", None)
    if not isinstance(spec, StageSpec):
        raise ValueError(
            f"this {type(model).__name__} is not a pipeline stage (it has no .stage_spec): "
            f"pass the module split_model(model, {info.stage}, stages) returns, where stages is "
            f"{info.stages} (the default split) or the module names of each stage"
        )
    held = spec.plan.layers(spec.index)
    wrong_layers = bool(info.layers) and held != list(info.layers)
    if spec.index != info.stage or spec.plan.stages != info.stages or wrong_layers:
        raise ValueError(
            f"the model holds layers {held} (modules {list(spec.names)}: stage {spec.index} "
            f"of {spec.plan.stages}), but stage {info.stage} of {info.stages} owns layers "
            f"{list(info.layers)}: call split_model(model, {info.stage}, {info.stages}, "
            "layers_per_stage) with the split the StageInfo was built with"
        )
    return spec


def _check_microbatches(batch: int, microbatches: int) -> None:
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches={microbatches!r}: allowed an int >= 1")
    if batch % microbatches:
        divisors = [d for d in range(1, batch + 1) if batch % d == 0]
        raise ValueError(
            f"a batch of B={batch} does not split into microbatches={microbatches}: "
            f"allowed M in {divisors} (the divisors of B)"
        )


def gpipe_step(
    model: nn.Module,
    info: StageInfo,
    x: torch.Tensor | None,
    y: torch.Tensor | None,
    microbatches: int,
    *,
    batch_shape: tuple[int, int] | None = None,
) -> float | None:
    """One step's forward and backward on this stage (no optimizer step); GPipe order.

    Args:
        model: this stage's part of the model (`split_model`: any model, see
            `fsdp_lab.pipeline.split`).
        info: this rank's place in the pipeline (`stage_info`).
        x: token ids (B, T) on the first stage; elsewhere None (or the ids, for their shape).
        y: targets (B, T) on the last stage; ignored elsewhere.
        microbatches: M, must divide B.
        batch_shape: (B, T) on stages without `x`: the size of what they receive.

    Returns:
        On the last stage the mean loss over the batch, None elsewhere.
    """
    spec = check_stage(model, info)
    if x is not None:
        batch_shape = (x.shape[0], x.shape[1])
    if batch_shape is None:
        raise ValueError(
            f"stage {info.stage} got neither x nor batch_shape: pass batch_shape=(B, T) so it "
            "can size the activations it receives"
        )
    if info.is_first and x is None:
        raise ValueError("the first stage needs x, the token ids (B, T)")
    if info.is_last and (y is None or tuple(y.shape) != tuple(batch_shape)):
        got = None if y is None else tuple(y.shape)
        raise ValueError(f"the last stage needs y, targets of shape {batch_shape}; got {got}")
    B, T = batch_shape
    M = microbatches
    _check_microbatches(B, M)
    device = next(model.parameters()).device  # every stage holds a parameter (split checks)
    # What crosses each boundary, (B/M, T, ...): probed on the whole model when it was split.
    recv_shape, recv_dtype = spec.receives() or ((), None)
    send_shape, send_dtype = spec.sends() or ((), None)
    inp_shape, out_shape = (B // M, T, *recv_shape), (B // M, T, *send_shape)
    xs = x.chunk(M) if info.is_first else [None] * M
    ys = y.chunk(M) if info.is_last else [None] * M

    inputs: list[torch.Tensor | None] = [None] * M
    outputs: list[torch.Tensor | None] = [None] * M  # loss_i on the last stage, out_i elsewhere
    losses: list[float] = []
    for i in range(M):
        with category("activations"):
            if info.is_first:
                inp = xs[i]  # (B/M, T) token ids
            else:
                inp = torch.empty(inp_shape, device=device, dtype=recv_dtype)
                comm.recv(inp, info.prev_rank)
                inp.requires_grad_()  # so backward gives us its gradient to send back
            with compute_span(f"forward mb {i}"):
                out = model(inp)  # (B/M, T, dim), or logits (B/M, T, V) on the last stage
                if info.is_last:
                    logits = out.float().reshape(-1, out.shape[-1])
                    out = F.cross_entropy(logits, ys[i].reshape(-1)) / M
                    losses.append(out.item())
            if not info.is_last:
                _check_sent(out, out_shape, send_dtype, info)
                comm.send(out.detach().contiguous(), info.next_rank)
        inputs[i], outputs[i] = inp, out
    mark(f"stage {info.stage}: {M} forwards done")

    for i in reversed(range(M)):
        with category("activations"):
            if info.is_last:
                with compute_span(f"backward mb {i}"):
                    outputs[i].backward()
            else:
                grad = torch.empty(out_shape, device=device, dtype=send_dtype)
                comm.recv(grad, info.next_rank)  # d loss / d out_i, from the next stage
                with compute_span(f"backward mb {i}"):
                    outputs[i].backward(grad)
            if not info.is_first:
                comm.send(inputs[i].grad, info.prev_rank)
        inputs[i] = outputs[i] = None  # this micro-batch's activations can go now
    mark(f"stage {info.stage}: {M} backwards done")
    return sum(losses) if info.is_last else None  # each is loss_i / M: their sum is the mean


def _check_sent(
    out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, info: StageInfo
) -> None:
    # The receiver sized its buffer from the plan: anything else would fail inside gloo/NCCL.
    if tuple(out.shape) != shape or out.dtype != dtype:
        raise ValueError(
            f"stage {info.stage} computed {out.dtype} {tuple(out.shape)}, but stage "
            f"{info.stage + 1} expects {dtype} {shape} (probed when the model was split): "
            "a stage's output must keep the shape the split saw; convert the model's dtype "
            "before split_model, not after"
        )


def dp_group(info: StageInfo) -> dist.ProcessGroup | None:
    """This stage's data-parallel group ({stage, stage+S, ...}); None when dp_size is 1.

    Every rank must call this together: ``dist.new_group`` is collective over the world and
    must be called for every group in the same order, so each rank creates all S groups and
    keeps its own. Create it once and pass it to `train_pipeline` (groups are not freed).
    """
    if info.dp_size == 1:
        return None
    mine = None
    for stage in range(info.stages):
        group = dist.new_group([d * info.stages + stage for d in range(info.dp_size)])
        if stage == info.stage:
            mine = group
    return mine


def average_gradients(model: nn.Module, group: dist.ProcessGroup | None, dp_size: int) -> None:
    """Mean of each gradient over the stage's dp group (sum, then / dp_size: gloo has no AVG)."""
    for p in model.parameters():
        if p.grad is not None:
            comm.all_reduce(p.grad, group=group)
            p.grad /= dp_size


def train_pipeline(
    model: nn.Module,
    info: StageInfo,
    optimizer: torch.optim.Optimizer,
    steps: int,
    microbatches: int,
    global_batch: int = 12,
    seq_len: int = 16,
    vocab_size: int | None = None,
    *,
    group: dist.ProcessGroup | None = None,
) -> list[float] | None:
    """Train `steps` GPipe steps on `fsdp_lab.reference.train_steps`'s data.

    Args:
        model, info: this rank's stage (`split_model`, `stage_info`).
        optimizer: built on this stage's parameters.
        steps: optimizer steps; step k uses ``synthetic_batch(vocab, global_batch, seq_len, k)``.
        microbatches: M per pipeline, must divide global_batch / dp_size.
        global_batch, seq_len: the batch all pipelines together train on each step.
        vocab_size: defaults to the split's (``model.stage_spec.plan.vocab_size``: the
            model's ``vocab_size``, else its logits' last dimension).
        group: this stage's dp group when dp_size > 1 (default: `dp_group(info)`, which every
            rank then creates together).

    Returns:
        On the last stage the loss of each step on this pipeline's slice of the batch (the
        mean over the pipelines is the single-process loss), None on other stages.
    """
    spec = check_stage(model, info)
    if global_batch % info.dp_size:
        raise ValueError(
            f"global_batch={global_batch} does not split over dp={info.dp_size} pipelines: "
            f"allowed a multiple of {info.dp_size}"
        )
    _check_microbatches(global_batch // info.dp_size, microbatches)
    if info.dp_size > 1 and group is None:
        group = dp_group(info)
    vocab = spec.plan.vocab_size if vocab_size is None else vocab_size
    device = next(model.parameters()).device
    losses = []
    for step in range(steps):
        x, y = synthetic_batch(vocab, global_batch, seq_len, step)  # the same on every rank
        x = local_slice(x, info.dp_rank, info.dp_size).to(device)  # (B/dp, T)
        y = local_slice(y, info.dp_rank, info.dp_size).to(device)
        optimizer.zero_grad(set_to_none=True)
        loss = gpipe_step(
            model,
            info,
            x if info.is_first else None,
            y if info.is_last else None,
            microbatches,
            batch_shape=(x.shape[0], x.shape[1]),
        )
        if info.dp_size > 1:
            average_gradients(model, group, info.dp_size)
        with compute_span("optimizer step"):
            optimizer.step()
        mark(f"step {step} optimizer step")
        if loss is not None:
            losses.append(loss)
    return losses if info.is_last else None
