"""Exercise of the pp-seed lab: the random stream of a model split into pipeline stages.

The one-process model draws its initial weights from one random stream, module after module. A
pipeline stage owns a slice of the modules and draws on its own rank, so *which* numbers it
draws is a choice the pipeline must make right (`fsdp_lab.pipeline.rng`). Both exercises run the
learner's step inside that mechanism on live ranks, with a tiny `PipeGPT` (even and uneven
splits), and compare every stage's weights with the reference's:

`stage_seeds` — strategy (c), `per_stage_seed`: rank 0 draws one seed per stage and broadcasts
them. Bugs caught: the same seed on every stage (stage 1 repeats stage 0's numbers: identical
weights, correlated noise — the issue's bug), ``seed + stage`` (the run with the next base seed
repeats this run's stage 1 on its stage 0), seeds from the global RNG (not reproducible).

`hand_over` — strategy (d), `rng_replay`: at each change of owner in the init order, the stage
that drew last sends its generator state to the next one, which continues from it, so the stages
together draw exactly the one-process model's numbers. Bugs caught: no hand-over (each stage
restarts the stream), handing on the state from before the stage drew (each stage repeats the
one before it), receiving the state but never setting it. A stage index used as a rank hangs
on the two-pipelines case (the checker's "hung" verdict shows where).

The lab's random numbers are the init's; a stage's dropout masks follow the same rules.
`stage_seeds` lives here, `hand_over` in `hand_over.py`, what both run and compare in
`stages.py`.
"""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, WrongOutput, expect_tensor, series_of
from fsdp_lab.pipeline import rng
from fsdp_lab.pipeline.exercises.stages import (
    case_layers,
    compare,
    first_draws,
    first_row,
    layout,
    repeat_mismatch,
    repeated,
    stage_values,
    vals,
    whole,
)


def stage_seeds(seed: int, stages: int) -> torch.Tensor:
    """Reference: one seed per stage, drawn from a generator seeded with `seed`."""
    return rng.draw_stage_seeds(seed, stages)


def _same_seed(seed: int, stages: int) -> torch.Tensor:
    return torch.full((stages,), seed, dtype=torch.int64)


def _seed_plus_stage(seed: int, stages: int) -> torch.Tensor:
    return seed + torch.arange(stages)


def _global_rng(seed: int, stages: int) -> torch.Tensor:
    return torch.randint(0, 2**62, (stages,))  # the global RNG: `seed` never used


def seeds_trial(fn: Any, case: Case) -> dict:
    """Strategy (c) with `fn` drawing the seeds: twice with the same seed (the global RNG
    disturbed differently each time), once with the next seed."""
    config, info = layout(case)
    seed, stages = case.params["seed"], info.stages
    like = torch.empty(stages, dtype=torch.int64)
    got = expect_tensor(fn(seed, stages), like, "the stage seeds")  # on every rank, before
    if bool((got < 0).any()):  # the broadcast: a wrong answer stops every rank alike
        raise WrongOutput(f"the stage seeds must be >= 0, got {got.tolist()}")
    model = whole(case, config)

    def init(base: int, before: int) -> list:
        torch.manual_seed(before + 101 * info.rank)  # what the program drew before: no matter
        stage = rng.per_stage_seed(model, info, base, case_layers(case), stage_seeds=fn)
        return stage_values(stage)

    return {
        "stage": info.stage,
        "layers": list(info.layers),
        "values": init(seed, 1),
        "again": init(seed, 2),
        "next_seed": init(seed + 1, 1),
    }


def _seen(got: dict, expected: dict) -> dict:
    """One stage as the judge reads it: the learner's runs beside the reference's."""
    return {
        "stage": expected["stage"],
        "layers": expected["layers"],
        "params": compare(got["values"], expected["values"]),
        "again_equal": all(r[1] for r in compare(got["again"], got["values"])),
        "start": first_draws(got["values"]),
        "start_expected": first_draws(expected["values"]),
        "start_again": first_draws(got["again"]),
        "start_next_seed": first_draws(got["next_seed"]),
        "start_next_expected": first_draws(expected["next_seed"]),
    }


def seeds_judge(got: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    seen = [_seen(g, e) for g, e in zip(got, expected, strict=True)]
    stages = sorted(seen, key=lambda o: o["stage"])
    if all(o["again_equal"] and all(r[1] for r in o["params"]) for o in stages):
        return None
    pair = repeated(stages)
    if pair is not None:
        i, j = pair
        return repeat_mismatch(
            stages,
            i,
            j,
            "every stage got the same seed, so every stage draws the same numbers: give each "
            "stage its own seed, drawn from a generator seeded with `seed`.",
        )
    seed = case.params["seed"]
    unstable = next((o for o in stages if not o["again_equal"]), None)
    if unstable is not None:
        name, first, second = unstable["start"][0], unstable["start"][1], unstable["start_again"][1]
        return Mismatch(
            f"two runs with seed {seed} give stage {unstable['stage']} different weights: the "
            "stage seeds are not a function of `seed` alone (the run is not reproducible).",
            rows=[
                (
                    f"run 1, stage {unstable['stage']}: {name}",
                    vals(unstable["start_expected"][1]),
                    vals(first),
                ),
                (
                    f"run 2, stage {unstable['stage']}: {name}",
                    vals(unstable["start_expected"][1]),
                    vals(second),
                ),
            ],
            hint="your seeds come from the global RNG (whatever the program drew before): "
            "draw them from torch.Generator().manual_seed(seed).",
            series=series_of(
                f"stage {unstable['stage']}'s first values, two runs with seed {seed}",
                "value index",
                "value",
                {
                    "reference (both runs)": unstable["start_expected"][1],
                    "yours, run 1": first,
                    "yours, run 2": second,
                },
            ),
        )
    for s in range(len(stages) - 1):
        here, there = stages[s + 1], stages[s]  # seed's stage s+1, seed+1's stage s
        if there["start_next_seed"][1] == here["start"][1]:
            return Mismatch(
                f"the run with seed {seed + 1} draws on stage {s} exactly what the run with "
                f"seed {seed} draws on stage {s + 1}: two runs share weights.",
                rows=[
                    (
                        f"seed {seed}, stage {s + 1}: {here['start'][0]}",
                        vals(here["start_expected"][1]),
                        vals(here["start"][1]),
                    ),
                    (
                        f"seed {seed + 1}, stage {s}: {there['start_next_seed'][0]}",
                        vals(there["start_next_expected"][1]),
                        vals(there["start_next_seed"][1]),
                    ),
                ],
                hint="seed + stage (torchtitan's `seed + pp_rank`) keeps the stages of one run "
                "distinct, but neighbouring base seeds overlap — a seed sweep shares weights: "
                "draw the stage seeds from a generator seeded with `seed` instead.",
                series=series_of(
                    f"first values: seed {seed + 1}'s stage {s} repeats seed {seed}'s stage {s + 1}",
                    "value index",
                    "value",
                    {
                        f"reference, seed {seed + 1}, stage {s}": there["start_next_expected"][1],
                        f"yours, seed {seed}, stage {s + 1}": here["start"][1],
                        f"yours, seed {seed + 1}, stage {s}": there["start_next_seed"][1],
                    },
                ),
            )
    if all(o["start_next_seed"][1] == o["start"][1] for o in stages):
        return Mismatch(
            "seeds 1 apart give the same weights on every stage: the stage seeds ignore `seed`.",
            rows=[first_row(stages)],
            hint="seed the generator you draw from with `seed`.",
        )
    return Mismatch(
        "the stages are distinct and reproducible, but not drawn as the statement says: the "
        "weights differ from the reference's.",
        rows=[first_row(stages)],
        hint="use torch.randint(0, 2**62, (stages,), generator=g) with "
        "g = torch.Generator().manual_seed(seed): exactly those seeds.",
    )


STAGE_SEEDS = Exercise(
    name="stage_seeds",
    lab="pp-seed",
    title="Give each pipeline stage a seed of its own",
    statement=(
        "A pipeline splits the model over ranks, and each stage fills its own layers from its "
        "own random generator. Seeded alike, stage 1 would draw exactly the numbers stage 0 "
        "drew: identical weights (in training, identical dropout masks) in different stages — "
        "correlated noise where independent noise was meant. Strategy (c), `per_stage_seed`, "
        "gives every stage a seed of its own: rank 0 calls your `stage_seeds(seed, stages)`, "
        "broadcasts the result, and stage `s` runs `torch.manual_seed(seeds[s])` before "
        "initialising its layers. Write `stage_seeds`: return an int64 tensor of shape "
        "`(stages,)`, values in `[0, 2**62)`, drawn with `torch.randint` from a "
        "`torch.Generator` seeded with `seed` — so the stages differ, the same `seed` gives the "
        "same weights whatever the program drew before, and two base seeds share no stage's "
        "stream."
    ),
    stub=(
        "def stage_seeds(seed, stages):\n"
        '    """One seed per stage (int64 tensor of shape (stages,)), a function of `seed`."""\n'
    ),
    hints=(
        "The seeds must differ from stage to stage and depend on `seed` alone: not on the "
        "global RNG (whatever this rank drew before).",
        "`seed + stage` looks distinct, but then the run with seed 1 gets on stage 0 what the "
        "run with seed 0 got on stage 1. Draw the seeds instead.",
        "`g = torch.Generator().manual_seed(seed)`, then `torch.randint(0, 2**62, (stages,), "
        "generator=g)`.",
    ),
    solution=stage_seeds,
    trial=seeds_trial,
    judge=seeds_judge,
    cases=(
        Case("2 stages of 2 layers, seed 7", 2, {"layers": [2, 2], "seed": 7}),
        Case("3 stages of 1 layer, seed 0", 3, {"layers": [1, 1, 1], "seed": 0}),
        Case("uneven: 3 stages of 2, 1 and 3 layers, seed 5", 3, {"layers": [2, 1, 3], "seed": 5}),
    ),
    bugs=(
        Bug(
            "same-seed",
            "the same seed on every stage",
            _same_seed,
            "stage 1's layers repeat the numbers stage 0 drew: identical weights in different "
            "stages (correlated noise)",
        ),
        Bug(
            "seed-plus-stage",
            "seed + stage",
            _seed_plus_stage,
            "the stages differ (torchtitan's `seed + pp_rank` does the same), but the run with "
            "the next base seed draws on stage 0 what this run drew on stage 1: two experiments "
            "share weights",
        ),
        Bug(
            "global-rng",
            "seeds drawn from the global RNG",
            _global_rng,
            "the same base seed gives different weights from run to run: not reproducible",
        ),
    ),
    points=2,
    minutes=8,
    replayed=True,  # its answers are plain data (a tensor of seeds): the grader replays them
)
