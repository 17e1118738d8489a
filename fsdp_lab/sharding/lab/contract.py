"""Notebook 01, section 8: FSDP2's contract beyond one strategy per model, on the ranks.

Each function trains the lab's Llama (`fsdp_lab.models.llama`: a unit per Linear and Embedding,
and for mixed precision per RMSNorm too; what no unit claims is the root unit) under one of ours
and PyTorch's systems of `reference.SYSTEMS` with the same settings, and returns what was
measured:

    precision_run   the norms kept whole and in fp32 inside a bf16 model: the dtype each module
                    computed in, the bytes by collective, the gradient norm clipping saw
    offload_run     shards, gradients and optimizer state in host memory: the copies each way
    bucket_run      DDP's gradient buckets: when each all-reduce left, against backward's end
    ignored_run     `ignored_params`: parameters neither sharded nor reduced

Each also returns the trained parameters, whole, to compare ours with PyTorch's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab import comm, reference
from fsdp_lab.markdown import max_diff
from fsdp_lab.models import synthetic_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, RMSNorm
from fsdp_lab.sharding import MixedPrecision, UnitPolicy, clip_grad_norm_
from fsdp_lab.trace import Timeline

UNITS = (nn.Linear, nn.Embedding)
STEPS, BATCH, LR, MAX_NORM = 2, 8, 1e-2, 0.5
# The recipe in docs/labs.md: every Linear and Embedding computes in bf16; each norm is a unit of its
# own, whole on every rank, computing in fp32 — its bf16 input cast up on the way in
# (`cast_forward_inputs`), its output cast back to bf16 on the way out (`output_dtype`).
BF16 = MixedPrecision(torch.bfloat16, torch.float32)
NORM_FP32 = MixedPrecision(torch.float32, torch.float32, output_dtype=torch.bfloat16)


def _model() -> Llama:
    torch.manual_seed(0)  # every rank and every system builds the same weights
    return Llama(LlamaConfig())


def _train(model: nn.Module, clip: Any = None, on_backward: Any = None) -> list[float]:
    """`STEPS` AdamW steps on this rank's slice of the global batch; the gradient norm before
    clipping at each step (if `clip`)."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    rank, world = dist.get_rank(), dist.get_world_size()
    norms = []
    for step in range(STEPS):
        x, y = (reference.local_slice(t, rank, world) for t in synthetic_batch(64, BATCH, 16, step))
        loss = F.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1))
        start = time.perf_counter()
        loss.backward()
        if on_backward is not None:
            on_backward(start, time.perf_counter())
        if clip is not None:
            norms.append(float(clip(model)))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return norms


def _computed_in(model: nn.Module) -> dict[str, str]:
    """Per kind of module, the dtypes its input and weight had inside its forward (hooks)."""
    seen: dict[str, str] = {}
    for module in model.modules():
        if isinstance(module, (*UNITS, RMSNorm)):

            def note(m: nn.Module, args: tuple, kind: str = type(module).__name__) -> None:
                dtypes = (args[0].dtype if args[0].is_floating_point() else None, m.weight.dtype)
                seen.setdefault(kind, "input {} · weight {}".format(*map(_short, dtypes)))

            module.register_forward_pre_hook(note)  # after the unit's own: sees its casts
    return seen


def _short(dtype: torch.dtype | None) -> str:
    return "ids" if dtype is None else str(dtype).removeprefix("torch.")


def precision_run(system: str) -> dict[str, Any]:
    """bf16 units and fp32 norms, the norms replicated: ours by `UnitPolicy(strategy=
    "replicate")`, fully_shard by an (N, 1) mesh for them (HSDP with one-rank shard groups)."""
    from fsdp_lab.sharding.mesh import device_mesh

    model, units = _model(), (*UNITS, RMSNorm)
    if system == "ours:full":
        norms = UnitPolicy(strategy="replicate", mixed_precision=NORM_FP32)
        model = reference.wrap(
            model, system, units, mixed_precision=BF16, policies={RMSNorm: norms}
        )
    else:
        norms = {"mesh": device_mesh(dist.get_world_size(), 1), "mp_policy": _policy(NORM_FP32)}
        model = reference.wrap(
            model, system, units, mp_policy=_policy(BF16), own_options={RMSNorm: norms}
        )
    seen = _computed_in(model)
    with comm.CommLog() as log:
        norms_seen = _train(model, clip=_clip(system))
    numel = sum(
        p.numel() for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()
    )
    return {
        "norm_numel": numel,
        "computed_in": seen,
        "bytes_per_step": {op: b / STEPS for op, b in log.bytes_by_op().items()},
        "grad_norms": norms_seen,
        "params": reference.full_parameters(model),
    }


def _policy(precision: MixedPrecision) -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(**vars(precision))  # the same four fields


def _clip(system: str) -> Any:
    """Clip the whole gradient to `MAX_NORM`: ours across the shards (`clip_grad_norm_`)."""
    if system.startswith("ours"):
        return lambda model: clip_grad_norm_(model, MAX_NORM)
    return _clip_by_mesh


def _clip_by_mesh(model: nn.Module) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` refuses DTensors on different meshes (the norms' (N, 1)
    one and the rest's): each mesh's norm, then the total, then every gradient scaled by the
    same clamped coefficient as torch's."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    by_mesh: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by_mesh.setdefault(g.device_mesh, []).append(g)
    each = [torch.nn.utils.get_total_norm(gs).full_tensor() for gs in by_mesh.values()]
    total = torch.stack(each).norm()
    coef = float(torch.clamp(MAX_NORM / (total + 1e-6), max=1.0))
    for g in grads:
        g.mul_(coef)
    return total


def offload_run(system: str) -> dict[str, Any]:
    """Every unit's shard, gradient and optimizer state in host memory (ours `offload=True`,
    fully_shard `CPUOffloadPolicy`); ours' copies each way per step, and a unit's shard bytes."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    if system == "ours:full":
        model = reference.wrap(_model(), system, UNITS, offload=True)
    else:  # pin_memory=False: there is no GPU to pin for on a CPU machine
        model = reference.wrap(
            _model(), system, UNITS, offload_policy=CPUOffloadPolicy(pin_memory=False)
        )
    with comm.CommLog() as log:
        _train(model)
    out: dict[str, Any] = {"params": reference.full_parameters(model)}
    if system == "ours:full":
        from fsdp_lab.sharding import sharding_state

        units = sharding_state(model).units
        out["bytes_per_step"] = {op: b / STEPS for op, b in log.bytes_by_op().items()}
        out["shard_bytes"] = {u.label: u.flat.shard_numel * 4 for u in units}
        out["freed_after_forward"] = [u.label for u in units if u.reshard_after_forward]
    return out


def bucket_run(system: str, bucket_cap_mb: float) -> dict[str, Any]:
    """Ours "none" or DDP with buckets of `bucket_cap_mb`: each step's backward and the bucket
    all-reduces, as spans on one timeline (DDP's through a communication hook that times the
    all-reduce it launches, dividing by N first as DDP's own hook does)."""
    with Timeline(dist.get_rank()) as timeline:
        if system == "ddp":
            model = reference.wrap(_model(), system, bucket_cap_mb=bucket_cap_mb)
            model.register_comm_hook(timeline, _timed_all_reduce)
        else:
            model = reference.wrap(_model(), system, bucket_cap_mb=bucket_cap_mb)

        def backward_span(start: float, end: float) -> None:
            timeline.add("compute", "backward", start, end)

        _train(model, on_backward=backward_span)
    return {"timeline": timeline.to_dict(), "params": reference.full_parameters(model)}


def _timed_all_reduce(timeline, bucket):  # type: ignore[no-untyped-def]
    # No annotations: DDP checks them against dist.GradBucket, and this module's are strings.
    buffer = bucket.buffer().div_(dist.get_world_size())
    start = time.perf_counter()
    future = dist.all_reduce(buffer, async_op=True).get_future()

    def done(f: torch.futures.Future) -> torch.Tensor:
        nbytes = buffer.numel() * buffer.element_size()
        timeline.add("comm", "all_reduce", start, time.perf_counter(), nbytes)
        return f.value()[0]

    return future.then(done)


def ignored_run(system: str) -> dict[str, Any]:
    """The norms as `ignored_params`: not sharded, not moved, their gradients not reduced —
    so each rank's copy follows its own half of the batch."""
    model = _model()
    norms = {p for m in model.modules() if isinstance(m, RMSNorm) for p in m.parameters()}
    if system == "ours:full":
        model = reference.wrap(model, system, UNITS, ignored_params=list(norms))
    else:
        model = reference.wrap(model, system, UNITS, own_options={"": {"ignored_params": norms}})
    _train(model)
    kept = {n: p.detach().clone() for n, p in model.named_parameters() if p in norms}
    return {"params": reference.full_parameters(model), "ignored": kept}


# -- what the notebook prints (rank 0's view unless said) --------------------------------------


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def precision_summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: what each kind of module computed in, the values, the norms, ours' bytes."""
    ours, theirs = runs["ours:full"][0], runs["fully_shard"][0]
    theirs_in = {k.removeprefix("FSDP"): v for k, v in theirs["computed_in"].items()}
    rows = [f"| {k} | {v} | {theirs_in.get(k)} |" for k, v in sorted(ours["computed_in"].items())]
    n, sent = len(runs["ours:full"]), ours["bytes_per_step"]
    norms = 2 * (n - 1) / n * ours["norm_numel"] * 4
    clipped = ", ".join(
        f"{g:.6f} → scaled by {min(1.0, MAX_NORM / g):.4f}" for g in ours["grad_norms"]
    )
    return "\n".join(
        [
            "| module | ours computed with | fully_shard computed with |",
            "|---|---|---|",
            *rows,
            "",
            f"- over every parameter after {STEPS} AdamW steps, "
            + max_diff("ours", "fully_shard", _max_diff(ours["params"], theirs["params"])),
            f"- total gradient norm before clipping to {MAX_NORM}, per step: ours {clipped} · "
            "fully_shard " + ", ".join(f"{g:.6f}" for g in theirs["grad_norms"]),
            f"- ours' bytes per rank and step: all-gather {sent['all_gather_into_tensor']:,.0f}, "
            f"reduce-scatter {sent['reduce_scatter_tensor']:,.0f}, all-reduce "
            f"{sent['all_reduce']:,.0f} — of which {norms:,.0f} = 2(N−1)/N · "
            f"{ours['norm_numel']} norm weights · 4 B, the replicated norms' fp32 gradients, and "
            f"{sent['all_reduce'] - norms:,.0f} the clipping's sums of squares",
        ]
    )


def offload_summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    ours, theirs = runs["ours:full"][0], runs["fully_shard"][0]
    shards = ours["shard_bytes"]
    again = sum(shards[u] for u in ours["freed_after_forward"])
    sent = ours["bytes_per_step"]
    return "\n".join(
        [
            "| per rank and step | measured (ledger) | from the shards' sizes |",
            "|---|---|---|",
            f"| host → device | {sent['host_to_device']:,.0f} B | every shard once for forward "
            f"({sum(shards.values()):,} B) + again for backward where freed ({again:,} B) |",
            f"| device → host | {sent['device_to_host']:,.0f} B | every gradient shard once "
            f"({sum(shards.values()):,} B) |",
            "",
            f"After {STEPS} steps, "
            + max_diff(
                "ours",
                "fully_shard(offload_policy=CPUOffloadPolicy())",
                _max_diff(ours["params"], theirs["params"]),
            )
            + ".",
        ]
    )


def last_backward(timeline: dict[str, Any]) -> dict[str, Any]:
    """The timeline cut to the last step's backward span (ours' own compute spans dropped)."""
    ends = [s for s in timeline["spans"] if s["name"] == "backward"]
    start, end = ends[-1]["start"], ends[-1]["end"]
    kept = [
        s
        for s in timeline["spans"]
        if start <= s["start"] <= end and (s["kind"] == "comm" or s["name"] == "backward")
    ]
    return {**timeline, "spans": kept}


def bucket_summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = []
    for system, per_rank in runs.items():
        spans = last_backward(per_rank[0]["timeline"])["spans"]
        starts = sorted(s["start"] for s in spans if s["kind"] == "comm")
        backward = next(s for s in spans if s["name"] == "backward")
        lines.append(
            f"- {system}: {len(starts)} all-reduces in the last step's backward "
            f"({(backward['end'] - backward['start']) * 1e3:.1f} ms, its wait included); the "
            f"first left {(starts[-1] - starts[0]) * 1e3:.1f} ms before the last, "
            f"{(starts[0] - backward['start']) * 1e3:.1f} ms after backward began"
        )
    ours, ddp = runs["ours:none"][0]["params"], runs["ddp"][0]["params"]
    lines.append(f"- after {STEPS} steps, " + max_diff("ours", "DDP", _max_diff(ours, ddp)))
    return "\n".join(lines)


def ignored_summary(runs: dict[str, list[dict[str, Any]]]) -> str:
    ours, theirs = runs["ours:full"], runs["fully_shard"]
    same = max(_max_diff(o["ignored"], t["ignored"]) for o, t in zip(ours, theirs, strict=True))
    apart = {s: _max_diff(r[0]["ignored"], r[1]["ignored"]) for s, r in runs.items()}
    shared = max(_max_diff(o["params"], t["params"]) for o, t in zip(ours, theirs, strict=True))
    return "\n".join(
        [
            f"- the ignored norms, ours against fully_shard on the same rank: max difference "
            f"{same:.2g}",
            "- the ignored norms, rank 0 against rank 1: "
            + ", ".join(f"{s} {d:.2g}" for s, d in apart.items()),
            f"- every other parameter, ours against fully_shard: {shared:.2g}",
        ]
    )
