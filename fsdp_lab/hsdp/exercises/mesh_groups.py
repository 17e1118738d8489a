"""Exercise of the hsdp lab: lay R·S ranks out as a 2-D (replicate x shard) mesh (`mesh_groups`).

Hybrid sharding is only as fast as its layout: the big all-gathers and reduce-scatters of every
unit must stay inside a node (the fast link), and only the all-reduce of each 1/S chunk may
cross between nodes. With S ranks per node in rank order (node of rank g = g // S), a *shard
group* is a row — the S consecutive ranks of one node — and a *replicate group* is a column —
the ranks at the same position s of every node, s, s+S, s+2S, … The learner writes
`mesh_groups(world_size, shard_size) -> (shard_groups, replicate_groups)`; the trial checks
that both lists partition the ranks into a grid (on every rank, before any group is made, so a
bad layout is a clear "wrong output" instead of a hang), builds PyTorch's 2-D DeviceMesh from
it, and trains the real hybrid sharding (`shard(strategy="hybrid", mesh=...)`) on it for
`STEPS` steps beside the reference layout, logging which ranks each rank exchanged bytes with.
Cases: 2x2, 1x4 (one node, no replicas) and 4x1 (one rank per node: pure replication). The
classic bugs: the transposed (column-major) layout — values right, but the shard groups span
the nodes, measured as the all-gather/reduce-scatter bytes crossing the node boundary —,
replicate groups that forget the stride S (they overlap and miss a rank), replicate groups
equal to the shard groups, and R and S swapped.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab import comm, reference
from fsdp_lab.cluster.where import device as placed_device
from fsdp_lab.exercise import (
    HINT_MARK,
    Bug,
    Case,
    Exercise,
    Mismatch,
    WrongOutput,
    close,
    first_values,
    series_of,
)
from fsdp_lab.models import Block, MLPBlock
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.exercises.reduce_scatter_grad import LR, build_model
from fsdp_lab.sharding.mesh import device_mesh

STEPS = 2
SHARD_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")  # inside a shard group

Groups = list[list[int]]


def mesh_groups(world_size: int, shard_size: int) -> tuple[Groups, Groups]:
    """Reference: rank g = r·S + s sits on node r at position s; rows shard, columns replicate."""
    replicas = world_size // shard_size
    shard_groups = [[r * shard_size + s for s in range(shard_size)] for r in range(replicas)]
    replicate_groups = [[r * shard_size + s for r in range(replicas)] for s in range(shard_size)]
    return shard_groups, replicate_groups


def _column_major(world_size, shard_size):  # noqa: ANN001, ANN202
    replicas = world_size // shard_size  # rank g = s·R + r: the layout transposed
    shard_groups = [[s * replicas + r for s in range(shard_size)] for r in range(replicas)]
    replicate_groups = [[s * replicas + r for r in range(replicas)] for s in range(shard_size)]
    return shard_groups, replicate_groups


def _no_stride(world_size, shard_size):  # noqa: ANN001, ANN202
    replicas = world_size // shard_size
    shard_groups = [[r * shard_size + s for s in range(shard_size)] for r in range(replicas)]
    replicate_groups = [[s + r for r in range(replicas)] for s in range(shard_size)]
    return shard_groups, replicate_groups


def _replicate_is_shard(world_size, shard_size):  # noqa: ANN001, ANN202
    replicas = world_size // shard_size
    shard_groups = [[r * shard_size + s for s in range(shard_size)] for r in range(replicas)]
    return shard_groups, [list(g) for g in shard_groups]


def _swapped_sizes(world_size, shard_size):  # noqa: ANN001, ANN202
    replicas = world_size // shard_size  # groups of R ranks where S were asked, and back
    shard_groups = [[r * replicas + s for s in range(replicas)] for r in range(shard_size)]
    replicate_groups = [[r * replicas + s for r in range(shard_size)] for s in range(replicas)]
    return shard_groups, replicate_groups


# -- on every rank ---------------------------------------------------------------------------


def _as_groups(value: Any, what: str) -> Groups:
    try:
        return [[int(x) for x in g] for g in value]
    except (TypeError, ValueError):
        raise WrongOutput(
            f"{what}: expected a list of rank lists such as [[0, 1], [2, 3]], got {value!r:.60}"
        ) from None


def _partition_error(groups: Groups, world: int, what: str) -> str:
    """Why `groups` is not a partition of range(world), or ""."""
    seen: dict[int, int] = {}
    for g in groups:
        for x in g:
            seen[x] = seen.get(x, 0) + 1
    outside = sorted(x for x in seen if not 0 <= x < world)
    twice = sorted(x for x, k in seen.items() if k > 1)
    missing = sorted(set(range(world)) - set(seen))
    if not (outside or twice or missing):
        return ""
    parts = [f"ranks {outside} do not exist (0..{world - 1})"] if outside else []
    parts += [f"rank(s) {twice} are in two groups"] if twice else []
    parts += [f"rank(s) {missing} are in none"] if missing else []
    return f"{what} {groups}: " + ", ".join(parts)


def layout_of(out: Any, world: int, size: int) -> list[list[int]]:
    """The R x S rank grid (rows = shard groups, columns = replicate groups) of a
    `mesh_groups` result; a WrongOutput naming what is wrong, and the bug it looks like."""
    replicas = world // size
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise WrongOutput(
            f"expected (shard_groups, replicate_groups), got {out!r:.60}{HINT_MARK}return two "
            "lists of rank lists."
        )
    rows, cols = _as_groups(out[0], "shard_groups"), _as_groups(out[1], "replicate_groups")
    if world > 1 and sorted(map(sorted, rows)) == sorted(map(sorted, cols)):
        raise WrongOutput(
            f"replicate_groups {cols} are the shard groups: the all-reduce would add up the "
            f"chunks of different parameters{HINT_MARK}a replicate group holds the SAME chunk "
            "once per node: one rank from each shard group (s, s+S, s+2S, …), a column of the "
            "grid, not a row."
        )
    for groups, n, k, what in (
        (rows, replicas, size, "shard_groups"),
        (cols, size, replicas, "replicate_groups"),
    ):
        sizes = [len(g) for g in groups]
        if sizes != [k] * n:
            swapped = sizes == [n] * k
            hint = (
                f"R and S swapped: there are R = world_size // shard_size = {replicas} shard "
                f"group(s) of S = shard_size = {size} rank(s), and {size} replicate group(s) "
                f"of {replicas}."
                if swapped
                else f"a {replicas}x{size} mesh has {replicas} shard groups of {size} ranks "
                f"(rows) and {size} replicate groups of {replicas} (columns)."
            )
            raise WrongOutput(
                f"{what}: expected {n} group(s) of {k} rank(s) on a {replicas}x{size} mesh, "
                f"got {len(groups)} of sizes {sizes}{HINT_MARK}{hint}"
            )
    for groups, what, hint in (
        (rows, "shard_groups", "shard group r is node r: the S consecutive ranks r·S … r·S+S-1."),
        (
            cols,
            "replicate_groups",
            "replicate group s takes position s of every node: s, s+S, s+2S, … — step by "
            "shard_size, not by 1.",
        ),
    ):
        error = _partition_error(groups, world, what)
        if error:
            raise WrongOutput(f"{error}: every rank must be in exactly one{HINT_MARK}{hint}")
    grid = []
    for row in rows:
        cells = [sorted(set(row) & set(col)) for col in cols]
        bad = next((c for c in cells if len(c) != 1), None)
        if bad is not None:
            raise WrongOutput(
                f"shard group {row} shares {len(bad)} ranks with a replicate group: each "
                f"replicate group must take exactly one rank of each shard group{HINT_MARK}"
                "columns of the grid: replicate group s = [s, s+S, s+2S, …]."
            )
        grid.append([c[0] for c in cells])
    return grid


def agreed_layout(fn: Any, world: int, size: int) -> list[list[int]]:
    """`fn`'s layout, the same on every rank, or the same WrongOutput on every rank: checked
    before any group is made, so a bad layout never reaches DeviceMesh (where ranks that
    disagree would wait on each other for ever)."""
    try:
        mine: Any = layout_of(fn(world, size), world, size)
    except WrongOutput as exc:
        mine = str(exc)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)
    for r, o in enumerate(everyone):
        if isinstance(o, str):
            raise WrongOutput(f"rank {r}: {o}" if world > 1 and r else o)
    if any(o != everyone[0] for o in everyone):
        r = next(r for r, o in enumerate(everyone) if o != everyone[0])
        raise WrongOutput(
            f"rank 0's grid is {everyone[0]} but rank {r}'s is {everyone[r]}{HINT_MARK}"
            "the layout must depend on world_size and shard_size only, not on the rank."
        )
    return everyone[0]


def _train_on(grid: list[list[int]], case: Case) -> dict:
    """`STEPS` SGD steps of hybrid sharding on the DeviceMesh of `grid`: losses, the full
    parameters after training, and the bytes this rank moved per (group, kind of op)."""
    from torch.distributed.device_mesh import DeviceMesh

    replicas, size = case.params["mesh"]
    mesh = (
        device_mesh(replicas, size)  # the reference grid is PyTorch's own (R, S) mesh
        if grid == [[r * size + s for s in range(size)] for r in range(replicas)]
        else DeviceMesh(
            placed_device().type, torch.tensor(grid), mesh_dim_names=("replicate", "shard")
        )
    )
    model = build_model(case)
    shard(model, units={Block, MLPBlock}, strategy="hybrid", mesh=mesh)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    with comm.CommLog() as log:
        losses = reference.train_steps(
            model, optimizer, STEPS, seq_len=4, rank=dist.get_rank(), world=dist.get_world_size()
        )
    moved: dict[str, dict[str, float]] = {}
    for rec in log.records:
        kind = "shard" if rec.op in SHARD_OPS else "all_reduce"
        by_kind = moved.setdefault(rec.group, {})
        by_kind[kind] = by_kind.get(kind, 0.0) + rec.bytes
    params = reference.full_parameters(model)
    return {
        "losses": losses,
        "params": torch.cat([p.flatten() for p in params.values()]).tolist(),
        "moved": moved,
        "shard_group": comm.group_label(mesh.get_group(1)),
    }


def trial(fn: Any, case: Case) -> dict:
    replicas, size = case.params["mesh"]
    world = dist.get_world_size()
    if replicas * size != world:
        raise ValueError(f"case {case.label!r}: mesh {replicas}x{size} on {world} ranks")
    grid = agreed_layout(fn, world, size)  # a WrongOutput on every rank, before any group
    return _train_on(grid, case)


# -- in the notebook -------------------------------------------------------------------------


def _ranks(label: str) -> list[int]:
    return [int(x) for x in label.removeprefix("ranks ").split(",")]


def _crossing(run: dict, size: int) -> dict[str, float]:
    """Bytes this rank moved in groups spanning more than one node, per kind of op."""
    out = {"shard": 0.0, "all_reduce": 0.0}
    for label, by_kind in run["moved"].items():
        if len({g // size for g in _ranks(label)}) > 1:
            for kind, b in by_kind.items():
                out[kind] += b
    return out


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    replicas, size = case.params["mesh"]
    for r, (got, exp) in enumerate(zip(got_all, expected, strict=True)):
        if not (close(got["losses"], exp["losses"]) and close(got["params"], exp["params"])):
            return Mismatch(
                f"on your mesh, rank {r}'s training differs from the reference mesh's within "
                f"{STEPS} steps.",
                rows=[
                    (
                        "parameters after training, first values",
                        first_values(exp["params"]),
                        first_values(got["params"]),
                    ),
                    (
                        f"loss after {STEPS} steps",
                        f"{exp['losses'][-1]:.6g}",
                        f"{got['losses'][-1]:.6g}",
                    ),
                ],
                hint="a valid grid trains the same whatever its layout: check that every "
                "shard group meets every replicate group in exactly one rank.",
                series=series_of(
                    f"loss per step, rank {r}",
                    "step",
                    "loss",
                    {"reference": exp["losses"], "yours": got["losses"]},
                ),
            )
    for r, (mine, theirs) in enumerate(zip(got_all, expected, strict=True)):
        got, exp = _crossing(mine, size), _crossing(theirs, size)
        if got["shard"] > exp["shard"]:
            nodes = sorted({g // size for g in _ranks(mine["shard_group"])})
            return Mismatch(
                f"values right, but rank {r}'s shard group ({mine['shard_group']}) spans "
                f"nodes {nodes}: its all-gathers and reduce-scatters crossed the node boundary, "
                f"{got['shard']:.0f} bytes in {STEPS} steps where the reference sent "
                f"{exp['shard']:.0f}.",
                rows=[
                    (
                        f"rank {r}'s shard group",
                        theirs["shard_group"],
                        mine["shard_group"],
                    ),
                    (
                        f"bytes rank {r} sent between nodes in all-gather + reduce-scatter",
                        f"{exp['shard']:.0f}",
                        f"{got['shard']:.0f}",
                    ),
                    (
                        f"bytes rank {r} sent between nodes in all-reduce",
                        f"{exp['all_reduce']:.0f}",
                        f"{got['all_reduce']:.0f}",
                    ),
                ],
                hint="transposed layout: rank g = r·S + s is on node r, so a shard group must "
                "be the S consecutive ranks of one node (a row), and the replicate groups "
                "the columns s, s+S, s+2S, ….",
            )
    return None


MESH_GROUPS = Exercise(
    name="mesh_groups",
    lab="hsdp",
    title="Lay R·S ranks out as a (replicate x shard) mesh",
    statement=(
        "A cluster of R nodes with S ranks each numbers its ranks node by node: rank g is on "
        "node g // S. HSDP shards each unit inside a node, where the link is fast, and only "
        "all-reduces the 1/S chunks between nodes. Write `mesh_groups(world_size, "
        "shard_size)` returning `(shard_groups, replicate_groups)`: two lists of rank lists. "
        "`shard_groups` has R = world_size // shard_size groups of S = shard_size ranks (the "
        "rows of the grid: one node each); `replicate_groups` has S groups of R ranks (the "
        "columns: the ranks that hold the same chunk, one per node). Every rank is in exactly "
        "one group of each list. The checker builds a 2-D DeviceMesh from your grid, trains "
        "the real hybrid sharding on it and measures which ranks exchanged bytes."
    ),
    stub=(
        "def mesh_groups(world_size, shard_size):\n"
        '    """(shard_groups, replicate_groups): lists of rank lists. shard_groups: the\n'
        "    world_size // shard_size nodes' ranks (rank g is on node g // shard_size);\n"
        '    replicate_groups: the ranks at the same position in every node."""\n'
    ),
    hints=(
        "Draw the grid: R rows (nodes) of S columns, rank g at row g // S, column g % S. "
        "Shard groups are the rows, replicate groups the columns.",
        "Row r holds ranks r·S + s for s in 0..S-1; column s holds ranks r·S + s for r in "
        "0..R-1 — the same formula, the other index varying.",
        "`R = world_size // shard_size`; shard_groups = [[r*S + s for s in range(S)] for r in "
        "range(R)]; replicate_groups is the same with the two loops swapped.",
    ),
    solution=mesh_groups,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "4 ranks as a 2x2 mesh: 2 nodes of 2 ranks",
            4,
            {"mesh": (2, 2), "model": "mlp", "dim": 8},
        ),
        Case(
            "4 ranks as a 1x4 mesh: one node, no replicas",
            4,
            {"mesh": (1, 4), "model": "mlp", "dim": 8},
        ),
        Case(
            "4 ranks as a 4x1 mesh: one rank per node, pure replication",
            4,
            {"mesh": (4, 1), "model": "mlp", "dim": 8},
        ),
    ),
    bugs=(
        Bug(
            "transposed",
            "transposed (column-major) layout",
            _column_major,
            "training is right, but each shard group spans the nodes: the big all-gathers and "
            "reduce-scatters cross the slow link",
        ),
        Bug(
            "no-stride",
            "replicate groups without the stride S",
            _no_stride,
            "the replicate groups overlap and miss a rank: refused before any group is made",
        ),
        Bug(
            "replicate-is-shard",
            "replicate groups equal to the shard groups",
            _replicate_is_shard,
            "the all-reduce would add up chunks of different parameters: refused before any "
            "group is made",
        ),
        Bug(
            "swapped-sizes",
            "R and S swapped",
            _swapped_sizes,
            "on a non-square mesh the groups have the wrong sizes: refused before any group is "
            "made",
        ),
    ),
    points=2,
    minutes=10,
    replayed=True,  # its answers are plain data: the grader replays them (grading)
)
