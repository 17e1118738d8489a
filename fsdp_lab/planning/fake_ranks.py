"""One rank of a real-size run, simulated: our `shard()` on fake ranks, measured.

PyTorch ships the two pieces that make a 70B, 64-GPU step runnable on a laptop CPU:

- a *fake process group* (``torch.testing._internal.distributed.fake_pg``): every collective
  returns at once and moves nothing, so one process can be rank 0 of a world of 1,024;
- ``FakeTensorMode``: every tensor has a shape, a dtype and a storage size but no memory, and
  every operator computes only the shapes of its outputs.

Under both, the lab's own code runs unchanged: `shard()` cuts the model into units, gathers
and frees them, reduces gradients; Adam makes its state; the forward and backward of the
real-size model run on a real-size batch. `MemoryTracker` counts the (fake) storages that
exist, by category, exactly as it does on real ranks, and `comm.CommLog` the bytes each
collective would move. Nothing is estimated: what is measured here is what the mechanism
allocates and sends — only the values are missing.

Beside it, PyTorch's `fully_shard` under the same fake mode, measured by its own
`FSDPMemTracker` (``torch.distributed._tools.fsdp2_mem_tracker``).

Each run is a fresh Python process (`run_in_subprocess`): a fake process group is a process's
default group, and the peak resident memory of the run is then its own.

    python -m fsdp_lab.planning.fake_ranks '[{"model": "llama3-70b", "world": 64, ...}, ...]'
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

# The parts of the run a planner asks about; `Run` is the JSON that crosses the process line.


@dataclass(frozen=True)
class Run:
    """One simulated rank: what to build, how to shard it, what to train it on.

    Args:
        model: a preset of `planning.models` ("llama3-70b", "llama3-8b-twin", ...) or a
            ``module:factory`` spec, built on meta.
        world: ranks in the (fake) world; this process is `rank` of them.
        strategy: `shard()`'s strategy ("none", "optimizer", "grad_op", "full", "hybrid").
        mesh: (replicas, shard) for "hybrid", else None.
        precision: "fp32" or "bf16-mixed" (bf16 compute and gathers, fp32 reduction).
        checkpoint: "none", "blocks" (every block recomputed in backward), "selective"
            (every second block: 1, 3, 5, ..., as torchtitan's layer-selective option 2) or
            "selective-op" (torchtitan's per-op policy, `planning.selective`).
        seq, micro_batch: tokens per sequence, sequences per rank per forward.
        grad_accumulation: forwards and backwards per optimizer step.
        system: "ours" or "fsdp2" (`fully_shard` and its `FSDPMemTracker`).
        steps: training steps (the peak is taken over all of them, after sharding).
    """

    model: str
    world: int
    strategy: str = "full"
    mesh: tuple[int, int] | None = None
    precision: str = "bf16-mixed"
    checkpoint: str = "none"
    seq: int = 2048
    micro_batch: int = 1
    grad_accumulation: int = 1
    system: str = "ours"
    steps: int = 2
    rank: int = 0


def run_in_subprocess(*runs: Run, timeout_s: float = 900) -> Any:
    """`measure` of each run, one after another in one fresh Python process (torch imported
    once); its result — a list for several runs — or a RuntimeError with the child's last
    lines. (The peak resident memory of a later run includes the earlier ones'.)"""
    specs = json.dumps([asdict(run) for run in runs])
    models = ", ".join(dict.fromkeys(run.model for run in runs))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp_lab.planning.fake_ranks", specs],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env={**os.environ, "PYTHONUNBUFFERED": "1",
                 "PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)},
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"the fake-rank run of {models} did not finish in {timeout_s:.0f} s (stopped)"
        ) from None
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not lines[-1].startswith("["):
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-12:])
        raise RuntimeError(
            f"the fake-rank run of {models} failed (exit code {proc.returncode}"
            f"{', no answer' if proc.returncode == 0 else ''}):\n{tail or 'no message'}"
        )
    results = json.loads(lines[-1])
    return results[0] if len(runs) == 1 else results


def measure(run: Run) -> dict[str, Any]:
    """In this process (it becomes a fake rank): build, shard, train `run.steps` steps under
    `FakeTensorMode`; memory by category at the peak, bytes per collective per step."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_lab.planning.models import build_on_meta

    started = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=run.rank, world_size=run.world)
    mesh = _mesh(run)  # outside the fake mode: a mesh's groups are real objects
    torch.manual_seed(0)
    with FakeTensorMode():
        measured = _train(run, build_on_meta(run.model, run.seq), mesh, fake=True)
    dist.destroy_process_group()
    return {
        **measured,
        "run": asdict(run),
        "wall_s": time.perf_counter() - started,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def on_real_rank(run: Run) -> dict[str, Any]:
    """The same run on this rank of a real process group (``cluster.run(on_real_rank, run)``):
    real tensors, real messages, the same measurement — what the fake rank must equal."""
    import torch
    import torch.distributed as dist

    from fsdp_lab.planning.models import build_on_meta

    run = replace(run, rank=dist.get_rank())
    mesh = _mesh(run)
    torch.manual_seed(0)
    return _train(run, build_on_meta(run.model, run.seq), mesh, fake=False)


def _mesh(run: Run) -> Any:
    """The DeviceMesh HSDP and fully_shard take (None for our 1-D strategies)."""
    if not (run.strategy.startswith("hybrid") or run.system == "fsdp2"):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    shape = tuple(run.mesh) if run.mesh else (run.world,)
    names = ("replicate", "shard") if len(shape) == 2 else None
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _train(run: Run, model: Any, mesh: Any, fake: bool) -> dict[str, Any]:
    from fsdp_lab.planning.models import block_classes

    train = _ours if run.system == "ours" else _fsdp2
    return train(run, model, block_classes(model), mesh, fake)


def _batch(run: Run) -> dict[str, Any]:
    """`reference.train_steps`' keywords: each rank gets `micro_batch` sequences of `seq`."""
    replicas = run.world  # every rank is a data-parallel rank under FSDP and HSDP alike
    return dict(
        global_batch=run.micro_batch * replicas,
        seq_len=run.seq,
        rank=run.rank,
        world=run.world,
        micro_batches=run.grad_accumulation,
    )


def _ours(run: Run, model: Any, blocks: set[type], mesh: Any, fake: bool) -> dict[str, Any]:
    import torch
    from torch import nn

    from fsdp_lab import comm, reference
    from fsdp_lab.checkpointing.recompute import checkpoint_modules
    from fsdp_lab.sharding import MixedPrecision, shard, sharding_state
    from fsdp_lab.trace import MemoryTracker

    precision = MixedPrecision(torch.bfloat16, torch.float32) if run.precision != "fp32" else None
    if run.checkpoint in ("blocks", "selective"):  # as with fully_shard: checkpoint first,
        # shard the wrappers, so a unit's gather and free run outside the recomputed region
        def recomputed(name: str, module: nn.Module) -> bool:
            index = name.rsplit(".", 1)[-1]  # its place in its ModuleList
            odd = index.isdigit() and int(index) % 2 == 1  # selective: blocks 1, 3, 5, ...
            return type(module) in blocks and (run.checkpoint == "blocks" or odd)

        checkpoint_modules(model, recomputed)
    if run.checkpoint == "selective-op":  # PyTorch's own selective checkpointing per block
        from fsdp_lab.planning.selective import OpSelective

        for holder in [m for m in model.modules() if isinstance(m, nn.ModuleList)]:
            for i, block in enumerate(holder):
                holder[i] = OpSelective(block)
    if run.checkpoint != "none":  # blocks and wrappers of blocks side by side: units by name
        blocks = [
            f"{name}.{i}"
            for name, holder in model.named_modules()
            if isinstance(holder, nn.ModuleList)
            for i in range(len(holder))
        ]
    with MemoryTracker(rank=run.rank) as mem, comm.CommLog() as log:
        shard(
            model,
            units=blocks,
            strategy=run.strategy,
            mesh=mesh,
            mixed_precision=precision,
            param_init_fn="empty" if fake else None,  # fake: no values to compute anyway
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        mem.track(model)
        mem.track(optimizer)
        for unit in sharding_state(model).units:
            if not unit.flat.aliased:
                mem.track(unit.flat.unsharded, "comm_buffers")  # the gathered unit
        at_wrap = len(log.records)
        mem.mark("sharded")
        mem.reset_peak()
        reference.train_steps(model, optimizer, run.steps, **_batch(run))
    trace = mem.trace()
    steps = log.records[at_wrap:]
    by_group: dict[str, dict[str, float]] = {}
    for record in steps:
        ops = by_group.setdefault(record.group, {})
        ops[record.op] = ops.get(record.op, 0.0) + record.bytes / run.steps
    return {
        "peak_bytes": trace["peak_bytes"],
        "peak_by_category": trace["peak_by_category"],
        "comm_bytes_per_step": {op: b / run.steps for op, b in comm.bytes_by_op(steps).items()},
        "comm_bytes_per_step_by_group": by_group,
        "calls_per_step": {op: c / run.steps for op, c in comm.calls_by_op(steps).items()},
    }


def _fsdp2(run: Run, model: Any, blocks: set[type], mesh: Any, fake: bool) -> dict[str, Any]:
    import torch
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from fsdp_lab import reference

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if run.precision != "fp32"
        else MixedPrecisionPolicy()
    )
    reference.wrap(model, "fully_shard", tuple(blocks), mesh, mp_policy=policy)
    model.to_empty(device="cpu")  # FSDP2's meta recipe: shard on meta, then allocate shards
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    tracker = FSDPMemTracker(model, optimizer)
    with tracker:
        for _ in range(run.steps):  # it keeps one step's module stats: cleared between
            reference.train_steps(model, optimizer, 1, **_batch(run))
            tracker.reset_mod_stats()
    peak = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return {"peak_bytes": peak.get("Total", 0), "peak_by_category": peak}


if __name__ == "__main__":
    specs = json.loads(sys.argv[1])
    runs = [
        Run(**{**spec, "mesh": tuple(spec["mesh"]) if spec.get("mesh") else None})
        for spec in (specs if isinstance(specs, list) else [specs])
    ]
    print(json.dumps([measure(run) for run in runs]))
