"""Lab 03, on the ranks: the tie verified after sharding and training, `to_empty` untying it,
the live audit (`audit.py`), and the memory of the root-unit spike, traced.

The tie is found and the plans are judged here before any rank starts (`plans.py`), so that a
model without a usable tie stops at once. Tensors do not leave this module: the sharded run is
compared with one process here, and plain data goes on to `analysis.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab import reference, theory
from fsdp_lab.cluster import (
    AttachedCluster,
    Cluster,
    borrow,
    device,
    in_rank_threads,
    rank,
    world_size,
)
from fsdp_lab.host import check_fits
from fsdp_lab.meta_init.meta_device import meta_device
from fsdp_lab.model_spec import SEQ_LEN, check_on_rank0, load_factory
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.sharding.ties import record_ties, retie, verify_weight_tying
from fsdp_lab.trace import MemoryTracker, mark
from fsdp_lab.tying.lab.audit import audit_worker
from fsdp_lab.tying.lab.config import LAB_MODEL, SPIKE_SYSTEMS, WRAPPINGS, TyingConfig
from fsdp_lab.tying.lab.plans import (
    as_units,
    build_model,
    describe_plans,
    detect_ties,
    model_sizes,
    tie_plans,
)


def preflight(config: TyingConfig) -> None:
    """What `fsdp-lab tying` checks before starting any rank: the spike's TinyGPT fits this
    host (each rank and the one-process run build it whole and train it: `theory.gpt_host_bytes`),
    and ``--model`` has a tie to shard."""
    params = theory.gpt_parameters(config.vocab, config.dim, config.layers, config.seq_len)
    tokens = 2 * config.world_size * config.batch * config.seq_len  # the ranks, then one process
    check_fits(
        theory.gpt_host_bytes(params, config.world_size + 1, tokens, config.vocab),
        f"vocab={config.vocab}, dim={config.dim}, layers={config.layers} "
        f"({params / 1e6:.0f}M parameters), batch={config.batch} x seq_len={config.seq_len} "
        f"on {config.world_size} ranks",
        "vocab=32768, dim=256, layers=4, batch=2, seq_len=64 (the defaults)",
    )
    if config.model is not None:
        try:
            tie_plans(load_factory(config.model)())
        except ValueError as exc:
            raise ValueError(f"--model {config.model!r}: {exc}") from None


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def verification_worker(
    spec: list, steps: int, lr: float, workload: dict[str, Any]
) -> dict[str, Any]:
    """On every rank: shard the `workload`'s model with `spec`, verify the tie, train `steps`
    SGD steps, verify again; rank 0 sends the full parameters for the comparison with one
    process, and what it built."""
    model = build_model(workload["model"], workload["gpt"]).to(device())
    built = model_sizes(model, workload["model"])
    record_ties(model)
    shard(model, units=as_units(spec), strategy="full")
    right_after = verify_weight_tying(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    _train(model, opt, steps, workload, vocab_size=workload["vocab"])
    params = reference.full_parameters(model)  # a collective: every rank takes part
    return {
        "right_after_shard": right_after,
        "after_steps": verify_weight_tying(model),
        "units": [u.label for u in sharding_state(model).units],
        "params": params if rank() == 0 else None,
        "model": built,
    }


def _train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    steps: int,
    workload: dict[str, Any],
    vocab_size: int | None = None,
) -> None:
    """`steps` steps of this rank's slice of the workload's batches (its sizes, on its device)."""
    n = world_size()
    reference.train_steps(
        model,
        opt,
        steps,
        global_batch=workload["batch"] * n,
        seq_len=workload["seq_len"],
        rank=rank(),
        world=n,
        device=device(),
        vocab_size=vocab_size,
    )


def single_process(
    workload: dict[str, Any], steps: int, lr: float, world: int
) -> dict[str, torch.Tensor]:
    """The verification's reference: the same model and global batches in one process."""
    return reference.single_process(
        lambda: build_model(workload["model"], workload["gpt"]),
        lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9),
        steps,
        global_batch=workload["batch"] * world,
        vocab_size=workload["vocab"],
        seq_len=workload["seq_len"],
    )


def _tied(model: torch.nn.Module) -> bool:
    return model.head.weight is model.tok_emb.weight


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def to_empty_worker(lr: float, workload: dict[str, Any]) -> dict[str, Any]:
    """On every rank: meta build -> to_empty; does the tie survive, does `shard` take the
    model? Then the repair: record on meta, to_empty, retie, *then* initialise (torchtitan's
    order), shard and train a step. On the `workload`'s TinyGPT (its `init_weights`)."""
    with meta_device():  # no init fills on meta: no torch._dynamo import (seconds)
        untied = tiny_gpt(**workload["gpt"])
    ties = record_ties(untied)
    out: dict[str, Any] = {
        "torch": torch.__version__,
        "ties": [list(t.names) for t in ties],
        "tied_on_meta": _tied(untied),
        "model": model_sizes(untied, LAB_MODEL),
    }
    untied.to_empty(device=device())  # a new Parameter in each owner's slot (torch 2.13)
    out["tied_after_to_empty"] = _tied(untied)
    out["problems_after_to_empty"] = verify_weight_tying(untied, ties)
    try:
        shard(untied, units={Block})
        out["shard_refused"], out["shard_error"] = False, None
    except ValueError as exc:
        out["shard_refused"], out["shard_error"] = True, str(exc)

    with meta_device():  # no init fills on meta: no torch._dynamo import (seconds)
        model = tiny_gpt(**workload["gpt"])
    ties = record_ties(model)
    model.to_empty(device=device())
    retie(model, ties)
    torch.manual_seed(0)
    model.init_weights()  # one matrix left, so one initialisation
    out["tied_after_retie"] = _tied(model)
    shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    _train(model, opt, 1, workload)
    out["shard_accepted_after_retie"] = True
    out["problems_after_retie_and_a_step"] = verify_weight_tying(model)
    return out


def _wrap_for_spike(model: torch.nn.Module, system: str, spec: list) -> None:
    """`spec` applied by our `shard` or by FSDP2's `fully_shard` (a unit per entry, then the
    root)."""
    # Both at their defaults: every unit but the root freed after forward. A tuple is one
    # group unit (FSDP2: fully_shard([model.tok_emb, model.head])).
    reference.wrap(model, "ours:full" if system == "fsdp_lab" else "fully_shard", as_units(spec))


def freed_after_forward(model: torch.nn.Module, system: str) -> dict[str, bool] | None:
    """Per unit ("root" for the root unit): whether it was freed after forward, as the run
    left it. FSDP2 decides for its root at the first forward (it keeps it: the backward comes
    next), so this is read after training, from its param groups; None if this torch's FSDP2
    keeps that elsewhere."""
    if system == "fsdp_lab":
        return {u.label: u.reshard_after_forward for u in sharding_state(model).units}
    freed: dict[str, bool] = {}
    for name, module in model.named_modules():
        state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
        for group in getattr(state, "_fsdp_param_groups", None) or []:
            if not hasattr(group, "post_forward_mesh_info"):
                return None  # a torch that keeps it elsewhere: not read, not guessed
            fqn = getattr(group, "_module_fqn", None) or name  # a group: "tok_emb, head"
            label = "root" if fqn == "" else fqn.replace(", ", "+")  # our unit labels
            freed[label] = group.post_forward_mesh_info is not None
    return freed or None


@in_rank_threads  # N ranks x default threads oversubscribe the cores
def spike_worker(config: TyingConfig, system: str, spec: list) -> dict[str, Any]:
    """On every rank: wrap the large-vocabulary TinyGPT with `spec`, train `spike_steps` steps
    under the memory tracker; the trace (`analysis.phase_bytes` reads it), what was built and
    which units were freed after forward."""
    model = tiny_gpt(**config.gpt()).to(device())
    built = model_sizes(model, LAB_MODEL)
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
    return {
        "trace": mem.trace(),
        "model": built,
        "freed_after_forward": freed_after_forward(model, system),
    }


def workloads(config: TyingConfig, vocab: int | None) -> dict[str, dict[str, Any]]:
    """What each section trains: ``lab`` is TinyGPT at the config's sizes and batch (the
    plans, to_empty and the spike; and everything without ``--model``); ``given`` is the
    ``--model`` (its own sizes: a factory takes no arguments) with the contract's probe
    sequence length, or the same TinyGPT."""
    lab = {
        "model": LAB_MODEL,
        "gpt": config.gpt(),
        "batch": config.batch,
        "seq_len": config.seq_len,
        "vocab": config.vocab,
    }
    if config.model is None:
        return {"lab": lab, "given": lab}
    given = {"model": config.model, "gpt": None, "batch": 2, "seq_len": SEQ_LEN, "vocab": vocab}
    return {"lab": lab, "given": given}


def _section(built: dict[str, Any], workload: dict[str, Any] | None, steps: int | None) -> dict:
    """A section's line of `sections`: the model it built, and the tokens and steps it ran."""
    tokens = {"batch_per_rank": None, "seq_len": None}
    if workload is not None:
        tokens = {"batch_per_rank": workload["batch"], "seq_len": workload["seq_len"]}
    return {**built, **tokens, "steps": steps}


def _built(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """Take each rank's ``model`` (what it built) out of its result; rank 0's."""
    return [r.pop("model") for r in per_rank][0]


def measure(config: TyingConfig, cluster: Cluster | AttachedCluster | None = None) -> dict:
    """Ties and plans here, then on the ranks: verification, audit, to_empty, spike."""
    model_spec = config.model or LAB_MODEL
    lab_model = tiny_gpt(**config.gpt())
    model = lab_model if config.model is None else build_model(config.model, None)
    specs = tie_plans(model)  # ValueError before any rank starts if it has no usable tie
    ties = {LAB_MODEL: detect_ties(lab_model), model_spec: detect_ties(model)}
    first, *_, last = ties[model_spec][0]["names"]  # TinyGPT: tok_emb.weight ... head.weight
    del model, lab_model
    with meta_device():  # no init fills on meta: no torch._dynamo import (seconds)
        lab_model = tiny_gpt(**config.gpt())
    plans = describe_plans(lab_model)
    sections = {"plans": _section(model_sizes(lab_model, LAB_MODEL), None, None)}
    with borrow(cluster, config.world_size, config.backend) as ranks:
        # The --model contract, on rank 0 where it trains, before anything is sharded.
        vocab = ranks.run(check_on_rank0, config.model)[0] if config.model else config.vocab
        work = workloads(config, vocab)
        single = single_process(work["given"], config.steps, config.lr, ranks.world_size)
        verification = {}
        for name in WRAPPINGS:
            per_rank = ranks.run(
                verification_worker, specs[name], config.steps, config.lr, work["given"]
            )
            params, built = per_rank[0].pop("params"), _built(per_rank)
            verification[name] = {
                "per_rank": per_rank,
                "max_abs_diff_vs_single_process": reference.max_abs_diff(params, single),
                "head_equals_embedding": bool(torch.equal(params[last], params[first])),
            }
        sections["verification"] = _section(built, work["given"], config.steps)
        audit = ranks.run(audit_worker, model_spec, work["given"])[0]
        sections["audit"] = _section(audit["model"], work["given"], 1)
        to_empty = ranks.run(to_empty_worker, config.lr, work["lab"])
        sections["to_empty"] = _section(_built(to_empty), work["lab"], 1)
        systems = SPIKE_SYSTEMS if config.compare_fsdp2 else SPIKE_SYSTEMS[:1]
        spike = {
            s: {w: ranks.run(spike_worker, config, s, plans[w]["units"]) for w in WRAPPINGS}
            for s in systems
        }
        first_run = spike[systems[0]][WRAPPINGS[0]][0]
        sections["spike"] = _section(first_run["model"], work["lab"], config.spike_steps)
        return {
            "world_size": ranks.world_size,
            "backend": ranks.backend,
            "model": model_spec,
            "vocab_size": vocab,
            "tie_plans": specs,
            "ties": ties,
            "plans": plans,
            "sections": sections,
            "verification": verification,
            "audit": audit["rows"],
            "to_empty": to_empty,
            "spike": spike,
        }
