"""Exercise of the meta-init lab: initialise a model no rank could hold, one rank's piece at a time.

`param_shard` — with a counter-based init (`DeterministicInit`: element i of a parameter is a
pure function of seed, name and i), each rank generates only its own piece of each parameter:
the parameter flattened, zero-padded to a multiple of N and cut in equal pieces. It runs inside
`meta_init.init_param_shards` (its ``slice_fn=``) on a model built on meta; the judge sets the
ranks' pieces end to end against the one-process init, bit for bit, and measures (with
`MemoryTracker`) that no rank built the whole parameter. Bugs it catches: every rank generating
from the start of the stream (all ranks hold the same values); an end taken as inclusive (the
last element of each piece is missing); splitting numel evenly instead of in equal padded pieces
(the pieces start at the wrong elements); building the whole parameter and slicing it.

`retie` (`retie.py`) — put the ties back after `to_empty`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, expect_tensor, series_of
from fsdp_lab.meta_init.counter_init import (
    DeterministicInit,
    build_on_meta,
    init_param_shards,
    param_shard,
)
from fsdp_lab.trace import MemoryTracker

SEED = 7


def _from_stream_start(init: Any, name: str, shape: tuple, rank: int, world_size: int) -> Any:
    numel = math.prod(shape)
    per = -(-numel // world_size)
    n = max(0, min(per, numel - rank * per))
    out = torch.zeros(per)
    out[:n] = init.values(name, shape, 0, n)  # every rank draws elements 0..n
    return out


def _inclusive_end(init: Any, name: str, shape: tuple, rank: int, world_size: int) -> Any:
    numel = math.prod(shape)
    per = -(-numel // world_size)
    start = min(rank * per, numel)
    end = max(start, min(start + per, numel) - 1)  # "the last element is end": one too few
    out = torch.zeros(per)
    out[: end - start] = init.values(name, shape, start, end)
    return out


def _even_split(init: Any, name: str, shape: tuple, rank: int, world_size: int) -> Any:
    numel = math.prod(shape)
    per = -(-numel // world_size)
    start, end = rank * numel // world_size, (rank + 1) * numel // world_size  # no padding
    out = torch.zeros(per)
    out[: end - start] = init.values(name, shape, start, end)
    return out


def _whole_then_slice(init: Any, name: str, shape: tuple, rank: int, world_size: int) -> Any:
    numel = math.prod(shape)
    per = -(-numel // world_size)
    padded = torch.zeros(per * world_size)
    padded[:numel] = init.values(name, shape, 0, numel)  # the whole parameter, on every rank
    return padded[rank * per : (rank + 1) * per].clone()


class _Weights(nn.Module):
    """Weights only (no constant-filled bias or norm): every element is a random draw."""

    def __init__(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        for name, (rows, cols) in shapes.items():
            layer = nn.Embedding(rows, cols) if name == "emb" else nn.Linear(cols, rows, False)
            self.add_module(name, layer)


def _measured(fn: Any, pieces: list, peaks: list) -> Any:
    """`fn` as the mechanism calls it, its peak memory measured and its output checked."""

    def slice_fn(init: Any, name: str, shape: tuple, rank: int, world_size: int) -> Any:
        like = param_shard(init, name, shape, rank, world_size)
        with MemoryTracker() as mem:
            got = fn(init, name, shape, rank, world_size)
        peaks.append(mem.peak_bytes)
        got = expect_tensor(got, like, f"rank {rank}'s piece of {name!r}")
        pieces.append(got.tolist())
        return got

    return slice_fn


def trial(fn: Any, case: Case) -> dict:
    shapes = case.params["shapes"]
    model, _ = build_on_meta(lambda: _Weights(shapes))  # names and shapes; no values anywhere
    init = DeterministicInit(SEED)
    rank, world = dist.get_rank(), dist.get_world_size()
    pieces: list = []
    peaks: list = []
    init_param_shards(model, init, rank, world, slice_fn=_measured(fn, pieces, peaks))
    out: dict[str, Any] = {
        "names": [n for n, _ in model.named_parameters()],
        "pieces": pieces,
        "peaks": peaks,
    }
    if rank == 0:  # the one-process init, whole: what the pieces must add up to
        out["whole"] = [
            init.values(n, tuple(p.shape), 0, p.numel()).tolist()
            for n, p in model.named_parameters()
        ]
    return out


def _strip(values: list[float]) -> list[float]:
    """Without trailing zeros (padding; a random draw is never exactly 0.0 here)."""
    end = len(values)
    while end and values[end - 1] == 0.0:
        end -= 1
    return values[:end]


def _find(run: list[float], whole: list[float]) -> int | None:
    """Where `run` (a rank's real elements) starts inside `whole`, if it is a slice of it."""
    n = len(run)
    if n == 0:
        return None
    for k in range(len(whole) - n + 1):
        if whole[k : k + n] == run:
            return k
    return None


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    world = case.world_size
    names, wholes = expected[0]["names"], expected[0]["whole"]
    for i, (name, whole) in enumerate(zip(names, wholes, strict=True)):
        numel, per = len(whole), -(-len(whole) // world)
        exp = [e["pieces"][i] for e in expected]
        got = [g["pieces"][i] for g in got_all]
        padded = whole + [0.0] * (per * world - numel)
        assert sum(exp, []) == padded, "the reference does not add up to the one-process init"
        if got == exp:
            continue
        r = next(r for r in range(world) if got[r] != exp[r])
        edges = [k * per for k in range(1, world) if k * per < numel]
        flat = sum(got, [])
        rows = [
            (f"rank {r}'s piece, first 3 values", _vals(exp[r][:3]), _vals(got[r][:3])),
            *[
                (f"elements {e - 1}, {e} (rank {e // per - 1} | rank {e // per})",
                 _vals(padded[e - 1 : e + 1]), _vals(flat[e - 1 : e + 1]))
                for e in edges[:2]
            ],
        ]  # fmt: skip
        real = [max(0, min(per, numel - k * per)) for k in range(world)]  # elements, not padding
        holders = [k for k in range(world) if real[k]]
        starts = {k: _find(_strip(got[k][: real[k]]), whole) for k in holders}
        moved = [k for k in holders if starts[k] is not None and starts[k] != k * per]
        if len(holders) > 1 and all(got[k][: real[k]] == whole[: real[k]] for k in holders):
            hint = (
                "Every rank generated its piece from the start of the stream: rank r's piece "
                "begins at element r * ceil(numel / world_size) — pass that as start."
            )
        elif all(
            got[k][: real[k] - 1] == exp[k][: real[k] - 1] and got[k][real[k] - 1] == 0.0
            for k in holders
        ):
            hint = (
                "Off by one at the slice's end: values(name, shape, start, end) stops before "
                "`end` (exclusive), so end = min(start + per, numel), not one less."
            )
        elif moved:
            k = moved[0]
            hint = (
                f"Rank {k}'s piece starts at element {starts[k]}, but equal padded pieces start "
                f"it at {k * per} = {k} * ceil({numel} / {world}): pad the flat parameter to a "
                "multiple of world_size, so that only the last pieces hold the (zero) padding."
            )
        else:
            hint = "Compare your piece with the statement: the table shows where it differs."
        return Mismatch(
            f"the ranks' pieces of {name!r} ({numel} elements, {world} pieces of {per}) do not "
            f"add up to the one-process init: rank {r}'s piece differs.",
            rows=rows,
            hint=hint,
        )
    for i, (name, whole) in enumerate(zip(names, wholes, strict=True)):
        numel, per = len(whole), -(-len(whole) // world)
        peaks = {
            "reference": [e["peaks"][i] for e in expected],
            "yours": [g["peaks"][i] for g in got_all],
        }
        growth = [g / max(e, 1) for g, e in zip(peaks["yours"], peaks["reference"], strict=True)]
        r = max(range(world), key=growth.__getitem__)
        # A function's peak grows with what it builds: a piece's worth for the reference, the
        # whole parameter's (numel / per times more) for one that builds it. Flag past halfway.
        if numel > per and growth[r] >= 1 + (numel / per - 1) / 2:
            return Mismatch(
                f"the values are right, but making rank {r}'s piece of {name!r} took a peak of "
                f"{peaks['yours'][r]} bytes against the reference's {peaks['reference'][r]}: it "
                f"grew with the whole parameter ({numel} elements), not with the piece ({per}) "
                "— your function built the whole parameter.",
                rows=[
                    (
                        "peak bytes while making the piece, per rank",
                        ", ".join(map(str, peaks["reference"])),
                        ", ".join(map(str, peaks["yours"])),
                    ),
                ],  # fmt: skip
                hint=(
                    "Generate only this rank's elements: values(name, shape, start, end) "
                    "computes any slice alone — never values(name, shape, 0, numel)."
                ),
                series=series_of(
                    f"peak memory making each rank's piece of {name!r}",
                    "rank",
                    "peak memory",
                    peaks,
                    in_bytes=True,
                ),
            )
    return None


def _vals(values: list[float]) -> str:
    return ", ".join(f"{v:.5g}" for v in values) or "—"


PARAM_SHARD = Exercise(
    name="param_shard",
    lab="meta-init",
    title="Generate only this rank's piece of a parameter",
    statement=(
        "A model too large for one machine is built on the meta device (shapes, no values), "
        "and each rank fills only its shard. With a counter-based init "
        "(`fsdp_lab.meta_init.counter_init.DeterministicInit`) element i of a parameter depends only on "
        "(seed, name, i): `init.values(name, shape, start, end)` returns elements "
        "[start, end) of the flattened parameter, without computing any other. Write "
        "`param_shard(init, name, shape, rank, world_size)`: rank `rank`'s piece of the "
        "parameter flattened, **zero-padded** to a multiple of `world_size` and cut into "
        "`world_size` equal pieces — a float32 tensor of ceil(numel / world_size) elements. "
        "Set end to end over the ranks, the pieces must equal the one-process init bit for "
        "bit; never build the whole parameter."
    ),
    stub=(
        "def param_shard(init, name, shape, rank, world_size):\n"
        '    """Rank `rank`\'s piece of parameter `name` (flattened, zero-padded to a multiple\n'
        "    of world_size, cut in equal pieces): a 1-D float32 tensor of\n"
        '    ceil(numel / world_size) elements."""\n'
    ),
    setup="import math",
    hints=(
        "Every piece has per = ceil(numel / world_size) elements (`-(-numel // world_size)`); "
        "rank r's piece covers elements [r * per, (r + 1) * per) of the padded parameter.",
        "Elements at or past numel are padding: zeros, not values. Clip both ends to numel — "
        "a rank may even hold nothing but padding.",
        "out = torch.zeros(per); start = min(rank * per, numel); end = min(start + per, numel); "
        "out[:end - start] = init.values(name, shape, start, end).",
    ),
    solution=param_shard,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "2 ranks, 24- and 30-element weights: no padding",
            2,
            {"shapes": {"emb": (6, 4), "proj": (5, 6)}},
        ),
        Case(
            "3 ranks, 35- and 44-element weights: the last piece padded",
            3,
            {"shapes": {"emb": (7, 5), "proj": (4, 11)}},
        ),
        Case(
            "4 ranks, a 9-element weight: one rank holds only padding",
            4,
            {"shapes": {"emb": (7, 5), "out": (3, 3)}},
        ),
    ),
    bugs=(
        Bug(
            "stream-start",
            "every rank generating from the start of the stream",
            _from_stream_start,
            "every rank holds the same values, those of the first piece",
        ),
        Bug(
            "inclusive-end",
            "an off-by-one at the slice's end",
            _inclusive_end,
            "the last element of every piece is zero: the pieces disagree at their edges",
        ),
        Bug(
            "even-split",
            "ignoring the padding: numel split evenly",
            _even_split,
            "when numel does not divide, the pieces start at the wrong elements",
        ),
        Bug(
            "whole-tensor",
            "building the whole parameter, then slicing it",
            _whole_then_slice,
            "the values are right, but every rank's peak memory holds the whole parameter",
        ),
    ),
    points=3,
    minutes=15,
)
