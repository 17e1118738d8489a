"""What both pp-seed exercises run and compare: a tiny `PipeGPT` cut into the case's stages, each
stage's weights in the order the init draws them (`stage_values`, on the ranks), and, where the
grade is made, the comparisons and the verdict's rows when one stage repeats another's numbers.

The comparisons are exact (list equality of the values, which JSON carries bit for bit):
seeding moves no float through arithmetic, so a right stage holds the very bits of the
reference, and a wrong one is off by whole draws. A stage's *first random tensor* (its first
values: `first_draws`) marks where in a random stream the stage started reading; two stages
that start alike read the same stream.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab.exercise import Case, Mismatch, first_values, series_of
from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig
from fsdp_lab.pipeline.stages import StageInfo, stage_info

SHOWN = 4  # values per tensor in a verdict's table
DRAWS = 12  # values of a stage's first random tensor: the start of the stream it read


class HeadFirstGPT(PipeGPT):
    """init_weights draws the head first: ownership goes 1 -> 0 -> 1, not along the pipeline."""

    def init_modules(self) -> list[tuple[str, nn.Module]]:
        mods = super().init_modules()
        return [m for m in mods if m[0] == "head"] + [m for m in mods if m[0] != "head"]


def case_layers(case: Case) -> list[int]:
    """Layers per stage of the case (its length: the stages)."""
    return list(case.params["layers"])


def layout(case: Case) -> tuple[PipeGPTConfig, StageInfo]:
    """A tiny PipeGPT's config with the case's layers, and this rank's place in the pipeline(s)."""
    per_stage = case_layers(case)
    n = sum(per_stage)
    config = PipeGPTConfig(vocab_size=16, dim=8, n_layers=n, n_heads=2, seq_len=4)
    info = stage_info(dist.get_rank(), dist.get_world_size(), len(per_stage), n, per_stage)
    return config, info


def whole(case: Case, config: PipeGPTConfig) -> PipeGPT:
    """The whole model the strategies are given (head first, if the case says so)."""
    # Built on the CPU: its values are never used (every strategy makes its own meta copy), and
    # a first build on meta would import torch._dynamo on every rank for a few seconds.
    return (HeadFirstGPT if case.params.get("head_first") else PipeGPT)(config)


def params(model: PipeGPT) -> list[tuple[str, torch.Tensor]]:
    """The stage's parameters in the order the init draws them."""
    return [
        (f"{name}.{key}", p)
        for name, module in model.init_modules()
        for key, p in module.named_parameters(recurse=False)
    ]


def stage_values(model: PipeGPT) -> list[tuple[str, list[float]]]:
    """(name, every value, flattened) of the stage's parameters, in the order the init draws."""
    return [(name, p.detach().flatten().tolist()) for name, p in params(model) if not p.is_meta]


Values = list[tuple[str, list[float]]]


def compare(got: Values, expected: Values) -> list[tuple]:
    """(name, equal, got's first values, expected's first values) per parameter `expected` has
    (one `got` lacks counts as different)."""
    mine = dict(got)
    return [
        (name, mine.get(name) == values, (mine.get(name) or [])[:SHOWN], values[:SHOWN])
        for name, values in expected
    ]


def first_draws(values: Values) -> tuple[str, list[float]]:
    """The stage's first random tensor (not a LayerNorm's ones) and its first values."""
    name, v = next((n, v) for n, v in values if len(set(v)) > 1)
    return name, v[:DRAWS]


def vals(values: list[float]) -> str:
    """A table cell: the first SHOWN values."""
    return first_values(values, SHOWN)


def label(o: dict) -> str:
    """ "stage 1 (layers 2, 3)": uneven splits show in the verdict."""
    return f"stage {o['stage']} (layers {', '.join(map(str, o['layers']))})"


def repeated(stages: list[dict]) -> tuple[int, int] | None:
    """(i, j): the first later stage j whose stream starts where stage i's did."""
    for j in range(1, len(stages)):
        for i in range(j):
            if stages[j]["start"][1] == stages[i]["start"][1]:
                return i, j
    return None


def repeat_mismatch(
    stages: list[dict], i: int, j: int, hint: str, extra: list | None = None, note: str = ""
) -> Mismatch:
    """Stage j read the stream stage i read: both first values, beside the reference's."""
    a, b = stages[i], stages[j]
    return Mismatch(
        f"{label(b)} draws the very numbers {label(a)} drew: its {b['start'][0]} repeats "
        f"{a['start'][0]} value for value (identical weights in different stages){note}.",
        rows=[
            (f"{label(a)}: {a['start'][0]}", vals(a["start_expected"][1]), vals(a["start"][1])),
            (f"{label(b)}: {b['start'][0]}", vals(b["start_expected"][1]), vals(b["start"][1])),
            *(extra or []),
        ],
        hint=hint,
        series=series_of(
            f"first values each stage draws: stage {j} repeats stage {i}",
            "value index",
            "value",
            {
                f"reference, stage {j}": b["start_expected"][1],
                f"yours, stage {i}": a["start"][1],
                f"yours, stage {j}": b["start"][1],
            },
        ),
    )


def first_differing(stages: list[dict]) -> dict | None:
    """The first stage's outcome (in the order given) with a parameter unlike the reference's."""
    return next((o for o in stages if not all(r[1] for r in o["params"])), None)


def first_row(stages: list[dict]) -> tuple[str, str, str]:
    """Expected vs got of the first parameter that differs (else the last stage's first)."""
    o = first_differing(stages) or stages[-1]
    name, _, got, expected = next((r for r in o["params"] if not r[1]), o["params"][0])
    return f"{label(o)}: {name}", vals(expected), vals(got)
