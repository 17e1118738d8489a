"""Exercise of the collectives lab: rebuild a flat tensor from every rank's padded shard.

`gather_shards` — the all-gather at the heart of FSDP's unshard: every rank holds an equal
shard of a flat buffer that was padded to a multiple of the group size; all-gather them in
rank order and strip the padding. It runs on a real `fsdp_lab.sharding.flat_param.FlatParameter` (the
sharding mechanism's layout: a model's parameters flattened, padded, cut into shards): the
gathered tensor is unflattened back into the model's parameters, and a forward with them must
match the unsharded model's. The classic bugs: forgetting to strip the padding (the result is
longer than the tensor: a wrong shape), putting one's own shard first instead of in rank order
(every rank but 0 rebuilds shuffled weights), and stripping the padding from the front (every
element shifted).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import comm
from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, close, expect_tensor, first_values
from fsdp_lab.sharding.flat_param import FlatParameter


def gather_shards(shard: torch.Tensor, numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    """Reference: all-gather the equal shards in rank order, then drop the padding at the end."""
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard, group=group)  # (N * S,): shard r at [r*S, (r+1)*S)
    return full[:numel]


def _no_strip(shard: torch.Tensor, numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard, group=group)
    return full  # the padding is still at the end


def _own_shard_first(shard: torch.Tensor, numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard, group=group)
    parts = list(full.chunk(dist.get_world_size(group)))
    mine = parts.pop(dist.get_rank(group))
    return torch.cat([mine, *parts])[:numel]  # this rank's shard first, then the others


def _strip_front(shard: torch.Tensor, numel: int, group: dist.ProcessGroup) -> torch.Tensor:
    full = torch.empty(shard.numel() * dist.get_world_size(group), dtype=shard.dtype)
    comm.all_gather_into_tensor(full, shard, group=group)
    return full[full.numel() - numel :]  # the last numel: drops real values, keeps the padding


def _model(width: int, out: int) -> nn.Module:
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(nn.Linear(5, width), nn.Tanh(), nn.Linear(width, out))


def _chunk_order(got: torch.Tensor, padded: torch.Tensor, shard_numel: int) -> list[int]:
    """For each shard-sized piece of `got`, the rank whose shard it is (-1: none)."""
    pieces = torch.nn.functional.pad(got, (0, padded.numel() - got.numel())).split(shard_numel)
    shards = padded.split(shard_numel)
    n = len(shards)
    last = got.numel() - (n - 1) * shard_numel  # the real elements of the last piece
    order = []
    for i, piece in enumerate(pieces):
        size = last if i == n - 1 else shard_numel
        order.append(
            next((r for r, s in enumerate(shards) if torch.equal(piece[:size], s[:size])), -1)
        )
    return order


def trial(fn: Any, case: Case) -> dict | None:
    members = case.params.get("group") or list(range(dist.get_world_size()))
    group = dist.new_group(members)  # every rank takes part in creating it
    if dist.get_rank() not in members:
        return None
    model = _model(case.params["width"], case.params["out"])
    names, params = zip(*model.named_parameters(), strict=True)
    flat = FlatParameter(list(names), list(params), members.index(dist.get_rank()), len(members))
    truth = torch.cat([p.detach().reshape(-1) for p in params])  # (numel,): unsharded
    padded = torch.nn.functional.pad(truth, (0, flat.padding))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(7))
    gathered = expect_tensor(
        fn(flat.shard.detach().clone(), flat.numel, group),
        truth,
        f"the gathered flat tensor ({flat.numel} real elements, the padding stripped)",
        hint=f"The gather holds {flat.padded_numel} elements: the last {flat.padding} are "
        f"padding that made the shards equal — return only the first numel={flat.numel}.",
    )
    with torch.no_grad():
        y = torch.func.functional_call(model, flat.unflatten(gathered), (x,))
    return {
        "values": gathered.tolist(),
        "forward": y.reshape(-1).tolist(),
        "order": _chunk_order(gathered, padded, flat.shard_numel),
        "shifted": torch.equal(gathered, padded[flat.padding :]),
        "unsharded_forward": model(x).reshape(-1).tolist(),
        "padding": flat.padding,
    }


def judge(got: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, exp in enumerate(expected):
        if exp is None:
            continue
        mine = got[r]
        if close(mine["values"], exp["values"]) and close(
            mine["forward"], exp["unsharded_forward"]
        ):
            continue
        ranks = list(range(len(exp["order"])))
        if mine["shifted"] and exp["padding"]:
            hint = (
                f"You dropped the first {exp['padding']} elements: the padding sits at the "
                "END of the gathered tensor (in the last rank's shard); keep the first `numel`."
            )
        elif sorted(mine["order"]) == ranks and mine["order"] != ranks:
            hint = (
                "The shards are out of rank order: shard r must land at [r*S, (r+1)*S) whatever "
                "rank you are — all_gather_into_tensor already puts them there; do not move "
                "your own shard first."
            )
        else:
            hint = "Gather every rank's shard in rank order, then keep the first `numel` elements."
        return Mismatch(
            f"rank {r} rebuilt other weights than the unsharded model's: its forward with them "
            "differs from the unsharded model's.",
            rows=[
                (
                    "whose shard each piece of the result is",
                    _order(exp["order"]),
                    _order(mine["order"]),
                ),
                ("first 3 values", first_values(exp["values"]), first_values(mine["values"])),
                (
                    "forward output, first 3",
                    first_values(exp["unsharded_forward"]),
                    first_values(mine["forward"]),
                ),
            ],  # fmt: skip
            hint=hint,
        )
    return None


def _order(order: list[int]) -> str:
    """`_chunk_order`'s list in words: "rank 0, rank 1", "none" where no rank's shard is."""
    return ", ".join(f"rank {r}" if r >= 0 else "none" for r in order)


GATHER_SHARDS = Exercise(
    name="gather_shards",
    lab="collectives",
    title="Rebuild a flat tensor from every rank's padded shard",
    statement=(
        "FSDP keeps each rank's *shard* of a unit's parameters: all parameters flattened into "
        "one 1-D tensor of `numel` elements, padded with zeros at the end to a multiple of the "
        "group size N, and cut into N equal shards — rank r holds elements [r·S, (r+1)·S). "
        "Before the unit runs, every rank needs the whole tensor back. Write "
        "`gather_shards(shard, numel, group)`: return the full flat tensor, `numel` elements, "
        "the same on every rank of `group`. `shard` is this rank's 1-D shard (S elements), "
        "`numel` the real length before padding, `group` the ranks that hold the shards (maybe "
        "a subgroup of the world). Use `fsdp_lab.comm.all_gather_into_tensor(output, input, "
        "group=group)` (counted, like `torch.distributed.all_gather_into_tensor`). The check "
        "rebuilds a model's parameters from your result and compares a forward with the "
        "unsharded model."
    ),
    stub=(
        "def gather_shards(shard, numel, group):\n"
        '    """The whole flat tensor (numel elements) from every rank\'s equal-sized shard."""\n'
    ),
    hints=(
        "The gathered tensor is N shards long: allocate `torch.empty(N * shard.numel(), "
        "dtype=shard.dtype)` with N = dist.get_world_size(group).",
        "`comm.all_gather_into_tensor(out, shard, group=group)` puts rank r's shard at "
        "[r*S, (r+1)*S): rank order, already. What is left at the end is padding.",
        "Return `out[:numel]`: the padding is at the end, after the real elements.",
    ),
    solution=gather_shards,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, 34 elements in 2 shards of 17 (no padding)", 2, {"width": 4, "out": 2}),
        Case("3 ranks, 34 elements in 3 shards of 12 (2 padding)", 3, {"width": 4, "out": 2}),
        Case(
            "ranks 0 and 2 of 3 as the group, 29 elements in 2 shards of 15 (1 padding)",
            3,
            {"width": 4, "out": 1, "group": [0, 2]},
        ),
    ),
    bugs=(
        Bug(
            "no-strip",
            "padding left on",
            _no_strip,
            "the result is longer than the tensor by the padding: the parameters cannot be "
            "rebuilt from it",
        ),
        Bug(
            "own-shard-first",
            "own shard first, not rank order",
            _own_shard_first,
            "rank 0 rebuilds the right weights, every other rank shuffled ones: the replicas "
            "compute different forwards",
        ),
        Bug(
            "strip-front",
            "padding stripped from the front",
            _strip_front,
            "every element is shifted by the padding: right only when nothing was padded",
        ),
    ),
    points=2,
    minutes=10,
)
