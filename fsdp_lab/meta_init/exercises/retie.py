"""Exercise of the meta-init lab: put the ties back after `to_empty`.

`retie` — a model built on meta is made real with ``Module.to_empty``, which gives every owner
of a tied Parameter a new Parameter of its own: the head is no longer the embedding. The learner
writes the step that restores the ties recorded on meta; it runs inside `sharding.ties.to_empty_tied`
(its ``retie_fn=``), then the model is initialised (`DeterministicInit`), trained a few Adam
steps in one process and handed to `shard`. Bugs it catches: forgetting to re-tie (two
tensors: more parameters and bytes, measured, different values, and `shard` refuses the
model); sharing the storage instead of the Parameter (``.data =``: two Parameters over one
tensor, stepped twice by the optimizer, and `shard` refuses a storage tie); re-tying only the
first tie.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import comm
from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, close, series_of
from fsdp_lab.meta_init.counter_init import DeterministicInit, build_on_meta, meta_summary
from fsdp_lab.reference import train_steps
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.ties import Tie, recorded_ties, retie, to_empty_tied
from fsdp_lab.trace import MemoryTracker
from fsdp_lab.tying.exercises import tied_models as tm

STEPS = 2
LR = 0.05


def _forgot(model: nn.Module, ties: list[Tie]) -> None:
    pass  # to_empty's new Parameters stay where it put them


def _shared_storage(model: nn.Module, ties: list[Tie]) -> None:
    for tie in ties:
        first = model.get_parameter(tie.names[0])
        for name in tie.names[1:]:
            model.get_parameter(name).data = first.data  # one tensor, still two Parameters


def _first_tie_only(model: nn.Module, ties: list[Tie]) -> None:
    retie(model, ties[:1])


def _materialise(name: str, retie_fn: Any) -> nn.Module:
    model, _ = build_on_meta(lambda: tm.build(name))
    to_empty_tied(model, "cpu", retie_fn=retie_fn)
    return DeterministicInit(seed=3, embedding_std=0.02).init_module_(model)


def _gaps(model: nn.Module, ties: list[Tie]) -> list[float]:
    with torch.no_grad():
        return [
            max((model.get_parameter(n) - model.get_parameter(t.names[0])).abs().max().item()
                for n in t.names[1:])
            for t in ties
        ]  # fmt: skip


def _run(name: str, retie_fn: Any, units: list) -> dict[str, Any]:
    model = _materialise(name, retie_fn)
    ties = recorded_ties(model)
    summary = meta_summary(model)
    with MemoryTracker() as mem:
        mem.track(model)
        held = mem.current_bytes  # the storages the model's parameters really occupy
    out: dict[str, Any] = {
        "tied": [all(model.get_parameter(n) is model.get_parameter(t.names[0]) for n in t.names)
                 for t in ties],
        "ties": [list(t.names) for t in ties],
        "parameters": summary["parameters"],
        "tensors": summary["parameter_tensors"],
        "bytes": held,
        "gaps": [_gaps(model, ties)],
    }  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    out["losses"] = train_steps(
        model,
        opt,
        STEPS,
        seq_len=tm.SEQ_LEN,
        on_step=lambda _: out["gaps"].append(_gaps(model, ties)),
    )
    sharded = _materialise(name, retie_fn)  # the same model again, for shard()
    try:  # every rank has the same model, so every rank refuses (or not) before any message
        shard(sharded, units)
    except ValueError as exc:
        out["shard"] = str(exc).split(" Fix:")[0].rstrip(".")
        return out
    rank, world = dist.get_rank(), dist.get_world_size()
    opt = torch.optim.Adam(sharded.parameters(), lr=LR)
    local = train_steps(sharded, opt, STEPS, seq_len=tm.SEQ_LEN, rank=rank, world=world)
    losses = torch.tensor(local, dtype=torch.float64)
    comm.all_reduce(losses)
    out["shard"] = None
    out["sharded_losses"] = (losses / world).tolist()
    return out


def trial(fn: Any, case: Case) -> dict:
    return _run(case.params["model"], fn, case.params["units"])


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    got, exp = got_all[0], expected[0]  # every rank materialises the same model
    if all(got["tied"]) and got["shard"] is None and close(got["losses"], exp["losses"]):
        return None
    broken = [t for t, ok in zip(got["ties"], got["tied"], strict=True) if not ok]
    i = got["ties"].index(broken[0]) if broken else 0
    gaps = [g[i] for g in got["gaps"]]
    rows = [
        ("ties that hold", str(len(exp["tied"])), str(sum(got["tied"]))),
        ("parameters (a shared one once)", str(exp["parameters"]), str(got["parameters"])),
        ("parameter tensors", str(exp["tensors"]), str(got["tensors"])),
        ("bytes of their storages (measured)", str(exp["bytes"]), str(got["bytes"])),
        (f"gap {' vs '.join(got['ties'][i][:2])} after init, per step", "0, " * STEPS + "0",
         ", ".join(f"{g:.3g}" for g in gaps)),
        (f"loss after {STEPS} Adam steps", f"{exp['losses'][-1]:.6g}", f"{got['losses'][-1]:.6g}"),
        ("shard()", "accepted", "refused" if got["shard"] else "accepted"),
    ]  # fmt: skip
    if got["bytes"] == exp["bytes"] and got["tensors"] > exp["tensors"]:
        summary = (
            f"after your retie {' and '.join(broken[0])} share one storage but are "
            f"{got['tensors'] - exp['tensors'] + 1} Parameter objects: the optimizer steps that "
            "tensor once per object, training left the reference"
            + (f", and shard() refused: {got['shard']}" if got["shard"] else "")
            + "."
        )
        hint = (
            "Sharing .data is a storage tie, not a tie: setattr the owner's attribute to the "
            "very same Parameter object, so the optimizer and shard() see one parameter."
        )
    else:
        summary = (
            f"after to_empty and your retie, {' and '.join(broken[0])} are separate tensors: "
            f"the model holds {got['parameters']} parameters in {got['bytes']} bytes instead of "
            f"{exp['parameters']} in {exp['bytes']}, the copies differ by {gaps[-1]:.3g} after "
            f"{STEPS} steps"
            + (f", and shard() refused it: {got['shard']}" if got["shard"] else "")
            + "."
        )
        if any(got["tied"]):
            hint = "Some ties hold, not all: re-tie every tie in `ties`, each of its names."
        else:
            hint = (
                "to_empty gave every owner a new Parameter of its own: point each name of a tie "
                "at its first name's Parameter (setattr on the owning module)."
            )
    return Mismatch(
        summary,
        rows=rows,
        hint=hint,
        series=series_of(
            "loss per Adam step, one process",
            "step",
            "loss",
            {"reference (tied)": exp["losses"], "yours": got["losses"]},
        ),
    )


RETIE = Exercise(
    name="retie",
    lab="meta-init",
    title="Re-tie a model after to_empty",
    statement=(
        "A large model is built on the meta device, then made real with "
        "`model.to_empty(device=...)` and initialised. `to_empty` gives every owner of a tied "
        "Parameter a new Parameter of its own: afterwards `model.head.weight` is no longer "
        "`model.tok_emb.weight`. The ties were recorded on meta (`fsdp_lab.sharding.ties.record_ties`). "
        "Write `retie(model, ties)`: for each tie, make every one of its names "
        "(`tie.names`, e.g. `('tok_emb.weight', 'head.weight')`) refer to the very same "
        "Parameter object as its first name. Return nothing: change `model` in place."
    ),
    stub=(
        "def retie(model, ties):\n"
        '    """For each tie in `ties`, register the Parameter of tie.names[0] under every other\n'
        '    name of the tie, in place."""\n'
    ),
    hints=(
        "`model.get_parameter(name)` gives the Parameter a dotted name leads to.",
        "A name's owner is `model.get_submodule(name.rpartition('.')[0])` and its attribute "
        "`name.rpartition('.')[2]`.",
        "setattr(owner, attribute, first) registers the same Parameter object under that name; "
        "copying values or sharing `.data` leaves two Parameters.",
    ),
    solution=retie,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, tied GPT (embedding = head)", 2, {"model": "gpt", "units": None}),
        Case(
            "3 ranks, two ties (embedding = head, one position table read twice)",
            3,
            {"model": "shared", "units": [("emb", "head")]},
        ),
    ),
    bugs=(
        Bug(
            "forgot",
            "forgetting to re-tie after to_empty",
            _forgot,
            "the head and the embedding are separate tensors: more parameters and bytes, "
            "different values that drift apart, and shard() refuses the model",
        ),
        Bug(
            "storage",
            "sharing .data instead of the Parameter",
            _shared_storage,
            "two Parameter objects over one tensor: the optimizer steps it twice and training "
            "drifts; shard() refuses the storage tie",
        ),
        Bug(
            "first-tie-only",
            "re-tying only the first tie",
            _first_tie_only,
            "a model with two ties keeps the second one broken",
        ),
    ),
    points=2,
    minutes=10,
)
