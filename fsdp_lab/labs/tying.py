"""Lab 03 — weight tying under wrap policies: one matrix, two modules, one wrap unit.

TinyGPT's language-model head *is* its token embedding (`head.weight is tok_emb.weight`, as in
GPT-2). The lab finds the tie, draws valid and invalid wrap plans, shards the model with a
valid plan and checks the tie on the ranks after training (and the parameters against a single
process), runs the live audit of an invalid plan through FSDP1, FSDP2 and ours, shows that
`to_empty` unties (and that `shard` refuses until `retie`), and measures what it costs to leave
the tied pair to the root unit (`fsdp_lab.labs.tying_spike`).

With ``model="module:factory"`` (``fsdp-lab tying --model ...``) the verification and the audit
run on that model instead, with plans made from its first tie (`tie_plans`); the plan diagrams,
the to_empty demonstration (TinyGPT's `init_weights`) and the spike (its ``--vocab``/``--dim``
sizes) stay on TinyGPT.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import torch

from fsdp_lab import reference
from fsdp_lab.audit import audit_table, audit_worker, block_names, split_tie
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank, world_size
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.tying_config import LAB_MODEL, TyingConfig
from fsdp_lab.labs.tying_spike import (
    PHASES,
    SYSTEM_NAMES,
    SYSTEMS,
    WRAPPINGS,
    as_units,
    measure_spike,
    plans,
    spike_bars,
    verdict,
)
from fsdp_lab.model_spec import check_on_rank0, load_factory
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.reference import max_abs_diff
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.tying import find_ties, record_ties, retie, untied_by_to_empty, verify_weight_tying
from fsdp_lab.wrap import PlanError, build_plan, ownership

# -- 1. detection and 2. plans ------------------------------------------------------------------


def detect_ties(model: torch.nn.Module) -> list[dict[str, Any]]:
    """`find_ties` as JSON: names, owning modules and their types, kind, shape, bytes."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return [
        {
            "names": list(t.names),
            "modules": list(t.modules),
            "module_types": [type(model.get_submodule(m)).__name__ for m in t.modules],
            "kind": t.kind,
            "shape": list(t.shape),
            "bytes": params[t.names[0]].numel() * params[t.names[0]].element_size(),
        }
        for t in find_ties(model)
    ]


def describe_plans(config: TyingConfig) -> dict[str, dict[str, Any]]:
    """Each plan resolved on the spike's TinyGPT (built on meta: no memory, no collective)."""
    with torch.device("meta"):
        model = tiny_gpt(**config.gpt())
    out = {}
    for name, spec in plans(config.layers).items():
        units = as_units(spec)
        conflicts = [
            {"param": o.ref.name, "owners": [m for m, _ in o.ref.owners], "units": list(o.units)}
            for o in ownership(model, units)
            if o.conflict
        ]
        try:
            described, error = build_plan(model, units).describe(), None
        except PlanError as exc:
            described, error = None, str(exc)
        out[name] = {
            "units": spec,
            "valid": error is None,
            "plan": described,
            "error": error,
            "conflicts": conflicts,
        }
    return out


def tie_plans(model: torch.nn.Module) -> dict[str, list]:
    """`plans` for any model with a tie, as JSON: its repeated blocks, its first tie's owners.

    On TinyGPT this is ``plans(n_layers)``. ValueError (``Fix: ...``) when the model has no tie
    or a valid plan is refused, so that a wrong ``--model`` stops before any rank starts.
    """
    try:
        tie, split = split_tie(model)
    except ValueError as exc:
        raise ValueError(
            f"{exc}: the tying lab shards, trains and audits a model's tie. Fix: a model whose "
            "head shares the embedding's Parameter (self.head.weight = self.tok_emb.weight), "
            "or `fsdp-lab shard --model ...` to train it"
        ) from None
    blocks = block_names(model)
    owners = list(dict.fromkeys(tie.modules))  # a module owning two names of the tie: once
    specs = {"root_unit": blocks, "joint_unit": [*blocks, owners], "split_tie": [split]}
    for name in ("root_unit", "joint_unit"):
        try:
            build_plan(model, as_units(specs[name]))
        except PlanError as exc:
            why = str(exc).partition(" Fix: ")[0].rstrip(".")  # its fix is for the plan's author
            raise ValueError(
                f"the tying lab's {name} plan {specs[name]} is refused on the "
                f"{type(model).__name__}: {why}. Fix: a model whose tied modules sit outside its "
                "repeated blocks (an embedding and a head, as in GPT-2)"
            ) from None
    return specs


def preflight(config: TyingConfig) -> None:
    """What `fsdp-lab tying` checks before starting any rank: ``--model`` has a tie to shard."""
    if config.model is not None:
        try:
            tie_plans(load_factory(config.model)())
        except ValueError as exc:
            raise ValueError(f"--model {config.model!r}: {exc}") from None


# -- 3. verification after sharding -------------------------------------------------------------


def verification_worker(
    spec: list,
    steps: int,
    lr: float,
    global_batch: int,
    model_spec: str = LAB_MODEL,
    vocab_size: int | None = None,
) -> dict[str, Any]:
    """On every rank: shard the model with `spec`, verify the tie, train `steps` SGD steps,
    verify again."""
    model = load_factory(model_spec)().to(device())
    record_ties(model)
    shard(model, units=as_units(spec), strategy="full")
    right_after = verify_weight_tying(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    reference.train_steps(
        model,
        opt,
        steps,
        global_batch=global_batch,
        rank=rank(),
        world=world_size(),
        device=device(),
        vocab_size=vocab_size,
    )
    return {
        "right_after_shard": right_after,
        "after_steps": verify_weight_tying(model),
        "units": [u.label for u in sharding_state(model).units],
        "params": reference.full_parameters(model),
    }


def _single_process(
    steps: int, lr: float, global_batch: int, model_spec: str, vocab_size: int | None
) -> dict[str, torch.Tensor]:
    model = load_factory(model_spec)()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    reference.train_steps(model, opt, steps, global_batch=global_batch, vocab_size=vocab_size)
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


# -- 5. materialisation unties ------------------------------------------------------------------


def to_empty_worker(lr: float) -> dict[str, Any]:
    """On every rank: meta build -> to_empty; does `shard` take it? Then retie, init, shard."""
    out: dict[str, Any] = {}
    with torch.device("meta"):
        untied = tiny_gpt()
    ties = record_ties(untied)
    untied.to_empty(device=device())
    out["tied_after_to_empty"] = untied.head.weight is untied.tok_emb.weight
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
    retie(model, ties)  # record on meta, to_empty, retie, *then* initialise (torchtitan order)
    torch.manual_seed(0)
    model.init_weights()
    out["tied_after_retie"] = model.head.weight is model.tok_emb.weight
    shard(model, units={Block})
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    n = world_size()
    reference.train_steps(model, opt, 1, global_batch=2 * n, rank=rank(), world=n, device=device())
    out["shard_accepted_after_retie"] = True
    out["problems_after_retie_and_a_step"] = verify_weight_tying(model)
    return out


# -- the lab ------------------------------------------------------------------------------------


def run(
    config: TyingConfig = TyingConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """Detect, plan, verify, audit, materialise and measure; see the module docstring."""
    ties = {LAB_MODEL: detect_ties(tiny_gpt())}
    model_spec = config.model or LAB_MODEL
    model = load_factory(model_spec)()
    ties[model_spec] = detect_ties(model)
    specs = tie_plans(model)  # ValueError before any rank starts if it has no usable tie
    first, *_, last = ties[model_spec][0]["names"]  # TinyGPT: tok_emb.weight ... head.weight
    del model
    owned = cluster is None
    cluster = cluster or Cluster(config.world_size, config.backend)
    try:
        n = cluster.world_size
        global_batch = 2 * n
        # The --model contract, on rank 0 where it trains, before anything is sharded.
        vocab = cluster.run(check_on_rank0, model_spec)[0]
        verification = {}
        for name in WRAPPINGS:
            args = (specs[name], config.steps, config.lr, global_batch, model_spec, vocab)
            ranks = cluster.run(verification_worker, *args)
            single = _single_process(config.steps, config.lr, global_batch, model_spec, vocab)
            params = ranks[0].pop("params")
            verification[name] = {
                "units": ranks[0]["units"],
                "steps": config.steps,
                "right_after_shard": [r["right_after_shard"] for r in ranks],
                "after_steps": [r["after_steps"] for r in ranks],
                "max_abs_diff_vs_single_process": max_abs_diff(params, single),
                "head_equals_embedding": bool(torch.equal(params[last], params[first])),
            }
        audit = cluster.run(audit_worker, model_spec, vocab)[0]
        materialise = cluster.run(to_empty_worker, config.lr)
        spike = measure_spike(config, cluster)
        backend = cluster.backend
    finally:
        if owned:
            cluster.close()
    return LabResult(
        "tying",
        {
            "config": {**asdict(config), "world_size": n},
            "world_size": n,
            "backend": backend,
            "model": model_spec,
            "vocab_size": vocab,
            "tie_plans": specs,
            "ties": ties,
            "plans": describe_plans(config),
            "verification": verification,
            "audit": audit,
            "to_empty": {**untied_by_to_empty(tiny_gpt), "per_rank": materialise},
            "spike": spike,
        },
    )


# -- pictures and words -------------------------------------------------------------------------


def figures(result: LabResult) -> dict[str, Any]:
    """Matplotlib figures (memory traces, spike bars) and `Diagram`s (the wrap plans)."""
    from fsdp_lab import plots
    from fsdp_lab.diagrams import wrap_diagram

    with torch.device("meta"):
        model = tiny_gpt(**result["spike"]["model"])
    figs: dict[str, Any] = {}
    for name, plan in result["plans"].items():
        title = f"{name}: units={plan['units']}"
        figs[f"wrap_{name}"] = wrap_diagram(model, units=as_units(plan["units"]), title=title)
    spike = result["spike"]
    for system in SYSTEMS:
        if system not in spike:
            continue
        panels = [(w, tr) for w in WRAPPINGS for tr in spike[system][w]["traces"]]
        fig = plots.plot_memory_trace(
            [tr for _, tr in panels],
            title=f"{SYSTEM_NAMES[system]}: tied pair in the root unit vs a joint unit",
        )
        for ax, (w, tr) in zip(fig.axes, panels, strict=False):  # axes first, in panel order
            ax.set_title(f"{w.replace('_', ' ')} · rank {tr['rank']}", fontsize=10)
        figs[f"spike_{system}"] = fig
    figs["spike_bytes"] = spike_bars(spike)
    return figs


def summary(result: LabResult) -> str:
    from fsdp_lab.sizes import format_bytes

    lines = [f"weight tying on {result['world_size']} ranks ({result['backend']})", ""]
    for spec, ties in result["ties"].items():
        found = "; ".join(f"{' = '.join(t['names'])} ({t['kind']})" for t in ties) or "none"
        lines.append(f"- ties of {spec}: {found}")
    for name, plan in result["plans"].items():
        lines.append(f"- plan {name}: {'valid' if plan['valid'] else 'refused'}")
    model = result.data.get("model", LAB_MODEL)  # results saved before --model reached here
    split = result.data.get("tie_plans", {}).get("split_tie", ["head"])[0]
    for name, v in result["verification"].items():
        problems = sum(len(p) for p in v["right_after_shard"] + v["after_steps"])
        lines.append(
            f"- shard {model} with {name}: {problems} tie problems after shard and after "
            f"{v['steps']} steps; "
            f"max |ours - single process| = {v['max_abs_diff_vs_single_process']:.2g}"
        )
    te, r0 = result["to_empty"], result["to_empty"]["per_rank"][0]
    lines += [
        f"- to_empty on torch {te['torch']}: tied after to_empty {te['tied_after_to_empty']}, "
        f"after retie {te['tied_after_retie']}; shard refused the untied model: "
        f"{r0['shard_refused']}; accepted after retie: {r0['shard_accepted_after_retie']}",
        "",
        f"### Live audit of {model}: {split} in its own unit, its tied partner in the root",
        "",
        audit_table(result["audit"]),
        "",
        f"### Root-unit spike (tied matrix {format_bytes(result['spike']['tied_matrix_bytes'])})",
        "",
    ]
    spike = result["spike"]
    for system in SYSTEMS:
        if system not in spike:
            continue
        for key, phase in PHASES.items():
            root, joint = (spike[system][w][key][0] for w in WRAPPINGS)
            lines.append(f"- {SYSTEM_NAMES[system]}, {phase} (rank 0): {verdict(root, joint)}")
        where = "; ".join(
            f"{w.replace('_', ' ')} between markers "
            + " and ".join(repr(m) for m in spike[system][w]["peak_between"][0])
            for w in WRAPPINGS
        )
        lines.append(f"- {SYSTEM_NAMES[system]}, where the peak is (rank 0): {where}")
    return "\n".join(lines)
