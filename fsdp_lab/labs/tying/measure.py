"""Lab 03, on the ranks: the tie verified after sharding and training, `to_empty` untying it,
the live audit (`audit.py`), and the memory of the root-unit spike, traced.

The tie is found and the plans are judged here before any rank starts (`plans.py`), so that a
model without a usable tie stops at once. Tensors do not leave this module: the sharded run is
compared with one process here, and plain data goes on to `analysis.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab import reference
from fsdp_lab.cluster import AttachedCluster, Cluster, borrow, device, rank, world_size
from fsdp_lab.labs.tying.audit import audit_worker
from fsdp_lab.labs.tying.config import LAB_MODEL, SPIKE_SYSTEMS, WRAPPINGS, TyingConfig
from fsdp_lab.labs.tying.plans import as_units, describe_plans, detect_ties, tie_plans
from fsdp_lab.model_spec import check_on_rank0, load_factory
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.trace import MemoryTracker, mark
from fsdp_lab.tying import record_ties, retie, verify_weight_tying
from fsdp_lab.wrap import build_plan


def preflight(config: TyingConfig) -> None:
    """What `fsdp-lab tying` checks before starting any rank: ``--model`` has a tie to shard."""
    if config.model is not None:
        try:
            tie_plans(load_factory(config.model)())
        except ValueError as exc:
            raise ValueError(f"--model {config.model!r}: {exc}") from None


def verification_worker(
    spec: list, steps: int, lr: float, global_batch: int, model_spec: str, vocab_size: int | None
) -> dict[str, Any]:
    """On every rank: shard the model with `spec`, verify the tie, train `steps` SGD steps,
    verify again; rank 0 sends the full parameters for the comparison with one process."""
    model = load_factory(model_spec)().to(device())
    record_ties(model)
    shard(model, units=as_units(spec), strategy="full")
    right_after = verify_weight_tying(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    n = world_size()
    reference.train_steps(
        model,
        opt,
        steps,
        global_batch=global_batch,
        rank=rank(),
        world=n,
        device=device(),
        vocab_size=vocab_size,
    )
    params = reference.full_parameters(model)  # a collective: every rank takes part
    return {
        "right_after_shard": right_after,
        "after_steps": verify_weight_tying(model),
        "units": [u.label for u in sharding_state(model).units],
        "params": params if rank() == 0 else None,
    }


def _tied(model: torch.nn.Module) -> bool:
    return model.head.weight is model.tok_emb.weight


def to_empty_worker(lr: float) -> dict[str, Any]:
    """On every rank: meta build -> to_empty; does the tie survive, does `shard` take the
    model? Then the repair: record on meta, to_empty, retie, *then* initialise (torchtitan's
    order), shard and train a step."""
    with torch.device("meta"):
        untied = tiny_gpt()
    ties = record_ties(untied)
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "ties": [list(t.names) for t in ties],
        "tied_on_meta": _tied(untied),
    }
    untied.to_empty(device=device())  # a new Parameter in each owner's slot (torch 2.13)
    out["tied_after_to_empty"] = _tied(untied)
    out["problems_after_to_empty"] = verify_weight_tying(untied, ties)
    try:
        shard(untied, units={Block})
        out["shard_refused"], out["shard_error"] = False, None
    except ValueError as exc:
        out["shard_refused"], out["shard_error"] = True, str(exc)

    with torch.device("meta"):
        model = tiny_gpt()
    ties = record_ties(model)
    model.to_empty(device=device())
    retie(model, ties)
    torch.manual_seed(0)
    model.init_weights()  # one matrix left, so one initialisation
    out["tied_after_retie"] = _tied(model)
    shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = world_size()
    reference.train_steps(model, opt, 1, global_batch=2 * n, rank=rank(), world=n, device=device())
    out["shard_accepted_after_retie"] = True
    out["problems_after_retie_and_a_step"] = verify_weight_tying(model)
    return out


def _wrap_for_spike(model: torch.nn.Module, system: str, spec: list) -> None:
    """`spec` applied by our `shard` or by FSDP2's `fully_shard` (a unit per entry, then the
    root)."""
    units = as_units(spec)
    if system == "fsdp_lab":
        plan = build_plan(model, units)
        # Like FSDP2, the root unit is not freed after forward: its backward comes right next.
        shard(model, units=plan, strategy="full", reshard_after_forward=plan.units[1:])
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device().type, (world_size(),))
    for unit in units:  # a tuple is one group: fully_shard([model.tok_emb, model.head])
        group = [model.get_submodule(m) for m in unit] if isinstance(unit, tuple) else None
        fully_shard(group or model.get_submodule(unit), mesh=mesh)
    fully_shard(model, mesh=mesh)


def spike_worker(config: TyingConfig, system: str, spec: list) -> dict[str, Any]:
    """On every rank: wrap the large-vocabulary TinyGPT with `spec`, train `spike_steps` steps
    under the memory tracker; the trace (`analysis.phase_bytes` reads it)."""
    model = tiny_gpt(**config.gpt()).to(device())
    _wrap_for_spike(model, system, spec)
    # Registered after wrapping: "embedding done" comes after a joint unit is freed, and
    # (prepended) "head start" before it is gathered again — the window where the blocks run.
    model.tok_emb.register_forward_hook(lambda *_: mark("embedding done"))
    model.head.register_forward_pre_hook(lambda *_: mark("head start"), prepend=True)
    opt = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=0.9)
    n = world_size()
    with MemoryTracker(device(), rank=rank()) as mem:
        mem.track(model)
        mem.track(opt)
        if system == "fsdp_lab":  # its resize_ (gather/free) is seen only on a tracked buffer
            for unit in sharding_state(model).units:
                mem.track(unit.flat.unsharded, "comm_buffers")
        mem.mark("wrapped")
        reference.train_steps(
            model,
            opt,
            config.spike_steps,
            global_batch=config.batch * n,
            seq_len=config.seq_len,
            rank=rank(),
            world=n,
            device=device(),
        )
    return mem.trace()


def measure(config: TyingConfig, cluster: Cluster | AttachedCluster | None = None) -> dict:
    """Ties and plans here, then on the ranks: verification, audit, to_empty, spike."""
    ties = {LAB_MODEL: detect_ties(tiny_gpt())}
    model_spec = config.model or LAB_MODEL
    model = load_factory(model_spec)()
    ties[model_spec] = detect_ties(model)
    specs = tie_plans(model)  # ValueError before any rank starts if it has no usable tie
    first, *_, last = ties[model_spec][0]["names"]  # TinyGPT: tok_emb.weight ... head.weight
    del model
    plans = describe_plans(config.gpt())
    with borrow(cluster, config.world_size, config.backend) as ranks:
        global_batch = 2 * ranks.world_size
        # The --model contract, on rank 0 where it trains, before anything is sharded.
        vocab = ranks.run(check_on_rank0, model_spec)[0]
        single = reference.single_process(
            load_factory(model_spec),
            lambda params: torch.optim.SGD(params, lr=config.lr, momentum=0.9),
            config.steps,
            global_batch=global_batch,
            vocab_size=vocab,
        )
        verification = {}
        for name in WRAPPINGS:
            args = (specs[name], config.steps, config.lr, global_batch, model_spec, vocab)
            per_rank = ranks.run(verification_worker, *args)
            params = per_rank[0].pop("params")
            verification[name] = {
                "per_rank": per_rank,
                "max_abs_diff_vs_single_process": reference.max_abs_diff(params, single),
                "head_equals_embedding": bool(torch.equal(params[last], params[first])),
            }
        systems = SPIKE_SYSTEMS if config.compare_fsdp2 else SPIKE_SYSTEMS[:1]
        return {
            "world_size": ranks.world_size,
            "backend": ranks.backend,
            "model": model_spec,
            "vocab_size": vocab,
            "tie_plans": specs,
            "ties": ties,
            "plans": plans,
            "verification": verification,
            "audit": ranks.run(audit_worker, model_spec, vocab)[0],
            "to_empty": ranks.run(to_empty_worker, config.lr),
            "spike": {
                s: {w: ranks.run(spike_worker, config, s, plans[w]["units"]) for w in WRAPPINGS}
                for s in systems
            },
        }
