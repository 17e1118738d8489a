"""The pp-seed lab's second exercise, `hand_over`: the generator state travels from stage to stage.

Strategy (d) of `fsdp_lab.pipeline.rng`, `rng_replay`, runs the init in its order on every rank
and, at each change of owner, calls the hand-over step: the stage that drew last sends its
generator state to the stage that draws next, which continues from it — so the stages together
draw exactly the one-process model's numbers. The learner writes that step; the trial runs it in
`rng_replay` beside the one-process init, on even, uneven, head-first and pp x dp layouts.
Bugs caught: no hand-over (each stage restarts the stream), handing on the state from before the
stage drew (each stage repeats the one before it), receiving the state but never setting it. A
stage index used as a rank hangs on the two-pipelines case (the checker's "hung" verdict shows
the stuck recv).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from fsdp_lab import comm
from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch
from fsdp_lab.pipeline import rng
from fsdp_lab.pipeline.exercises.stages import (
    case_layers,
    compare,
    first_differing,
    first_draws,
    first_row,
    label,
    layout,
    repeat_mismatch,
    repeated,
    stage_values,
    whole,
)
from fsdp_lab.pipeline.rng import generator_state, set_generator_state


def hand_over(
    holder: int | None,
    owner: int,
    stage: int,
    seed: int,
    rank_of: Callable[[int], int],
    device: torch.device | str,
) -> None:
    """Reference: `rng_replay`'s own step (`fsdp_lab.pipeline.rng.hand_over_generator`): at the
    start the owner seeds; later the holder sends its generator state, the owner sets it."""
    rng.hand_over_generator(holder, owner, stage, seed, rank_of, device)


def _restart_stream(holder, owner, stage, seed, rank_of, device):
    if stage == owner:
        torch.manual_seed(seed)  # every stage starts the stream again


# A learner's global, as the bug below would keep it: the state this rank took over with.
_TAKEN_OVER_WITH: dict[int, torch.Tensor] = {}


def _state_from_before_drawing(holder, owner, stage, seed, rank_of, device):
    if holder is None:
        if stage == owner:
            torch.manual_seed(seed)
            _TAKEN_OVER_WITH[stage] = generator_state(device).clone()
    elif stage == holder:  # sends the state it started with, not the one after its draws
        comm.send(_TAKEN_OVER_WITH[stage], dst=rank_of(owner))
    elif stage == owner:
        state = generator_state(device)
        comm.recv(state, src=rank_of(holder))
        set_generator_state(device, state)
        _TAKEN_OVER_WITH[stage] = state.clone()


def _received_not_set(holder, owner, stage, seed, rank_of, device):
    if holder is None:
        if stage == owner:
            torch.manual_seed(seed)
    elif stage == holder:
        comm.send(generator_state(device), dst=rank_of(owner))
    elif stage == owner:
        comm.recv(generator_state(device), src=rank_of(holder))  # ... and dropped


def hand_over_trial(fn: Any, case: Case) -> dict:
    """Strategy (d) with `fn` as the hand-over, beside the one-process init (the reference's
    run must equal it: that is the mechanism's promise, checked by the judge)."""
    config, info = layout(case)
    seed = case.params["seed"]
    model = whole(case, config)
    torch.manual_seed(1000 + info.rank)  # whatever a rank drew before must not matter
    with comm.CommLog() as log:
        stage = rng.rng_replay(model, info, seed, case_layers(case), hand_over=fn)
    values = stage_values(stage)
    one_process = whole(case, config)
    torch.manual_seed(seed)
    one_process.init_weights()
    mine = {name for name, _ in values}
    return {
        "stage": info.stage,
        "dp": info.dp_rank,
        "layers": list(info.layers),
        "values": values,
        "one_process": [(n, v) for n, v in stage_values(one_process) if n in mine],
        "messages": len(log.records),  # sends and recvs of generator states
    }


def hand_over_judge(got: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for e in expected:
        if not all(r[1] for r in compare(e["values"], e["one_process"])):
            raise RuntimeError(
                "rng_replay with the reference hand-over differs from the one-process init: a "
                "bug of fsdp_lab.pipeline.rng, not of the exercise"
            )
    seen = [
        {
            "stage": e["stage"],
            "dp": e["dp"],
            "layers": e["layers"],
            "params": compare(g["values"], e["one_process"]),
            "start": first_draws(g["values"]),
            "start_expected": first_draws(e["values"]),
            "messages": g["messages"],
            "messages_expected": e["messages"],
        }
        for g, e in zip(got, expected, strict=True)
    ]
    every = sorted(seen, key=lambda o: (o["dp"], o["stage"]))
    stages = [o for o in every if o["dp"] == 0]  # the pipelines must agree: one shows them
    if all(r[1] for o in every for r in o["params"]):
        return None
    sent = sum(o["messages"] for o in seen)
    sent_expected = sum(o["messages_expected"] for o in seen)
    messages = ("sends + recvs of a generator state", str(sent_expected), str(sent))
    pair = repeated(stages)
    if pair is not None:
        i, j = pair
        hint = (
            "each stage restarts the stream (nothing is handed over): only the first owner "
            "seeds; later the holder sends generator_state(device) and the owner sets it."
            if sent == 0
            else "a state is handed on, but the one from before the stage drew: send "
            "generator_state(device) at the moment ownership passes, not a state saved earlier."
        )
        note = (
            ", and no generator state was sent"
            if sent == 0
            else f", although the state was handed on ({sent} sends + recvs; the reference: "
            f"{sent_expected})"
        )
        return repeat_mismatch(stages, i, j, hint, extra=[messages], note=note)
    hint = (
        "no generator state travels: the holder must comm.send it to rank_of(owner), and the "
        "owner comm.recv it from rank_of(holder)."
        if sent == 0
        else "the state arrives but the owner draws from its own generator: after comm.recv, "
        "call set_generator_state(device, state)."
    )
    wrong = first_differing(every)
    where = f" of pipeline {wrong['dp']}" if len(every) > len(stages) else ""
    return Mismatch(
        f"{label(wrong)}{where} does not continue the one-process stream: its weights differ "
        "from the one-process model's.",
        rows=[first_row(every), messages],
        hint=hint,
    )


HAND_OVER = Exercise(
    hang_hint="A send or recv whose peer never answers waits forever: address ranks with "
    "rank_of(stage) — a stage index is not a rank once pipelines sit side by side.",
    name="hand_over",
    lab="pp-seed",
    title="Hand the generator state from stage to stage",
    statement=(
        "The one-process model draws its weights from one random stream, module after module: "
        "stage 1's first layer gets the numbers that come right after stage 0's last. "
        "Strategy (d), `rng_replay`, reproduces that stream on a pipeline: every rank runs the "
        "init in order (the modules it does not own are on the meta device and draw nothing), "
        "and each time the init moves on to a module of another stage every rank calls your "
        "`hand_over(holder, owner, stage, seed, rank_of, device)`. `holder` is the stage whose "
        "generator the init has drawn from so far (`None` when the init starts), `owner` the "
        "stage that draws next, `stage` this rank's stage, `rank_of(s)` the global rank of "
        "stage `s` of this rank's pipeline. Write it: at the start the owner seeds with "
        "`torch.manual_seed(seed)`; later the holder — its modules have drawn — sends its "
        "generator state (`generator_state(device)`) to the owner, which continues from it "
        "(`set_generator_state(device, state)`), using `comm.send` / `comm.recv`. Then every "
        "stage holds the one-process model's weights bit for bit."
    ),
    stub=(
        "def hand_over(holder, owner, stage, seed, rank_of, device):\n"
        '    """The init moves from stage `holder` (None: it starts) to stage `owner`: seed, or\n'
        '    send / receive the generator state. Returns nothing."""\n'
    ),
    setup="from fsdp_lab.pipeline.rng import generator_state, set_generator_state",
    hints=(
        "Three roles: at the start (holder is None) only the owner acts — it seeds; later the "
        "holder sends and the owner receives. Every other stage does nothing.",
        "`comm.recv(t, src=...)` fills a tensor you allocate: `generator_state(device)` has the "
        "right size. Send to `rank_of(owner)`, receive from `rank_of(holder)`: with two "
        "pipelines side by side a stage's index is not its rank.",
        "`elif stage == holder: comm.send(generator_state(device), dst=rank_of(owner))`; "
        "`elif stage == owner: s = generator_state(device); comm.recv(s, src=rank_of(holder)); "
        "set_generator_state(device, s)`.",
    ),
    solution=hand_over,
    trial=hand_over_trial,
    judge=hand_over_judge,
    cases=(
        Case("2 stages of 2 layers", 2, {"layers": [2, 2], "seed": 7}),
        Case("uneven: 3 stages of 2, 1 and 3 layers", 3, {"layers": [2, 1, 3], "seed": 5}),
        Case(
            "head initialised first: ownership goes 1 -> 0 -> 1",
            2,
            {"layers": [1, 2], "seed": 3, "head_first": True},
        ),
        Case(
            "two pipelines side by side (4 ranks), stages of 3 and 1 layers",
            4,
            {"layers": [3, 1], "seed": 11},
        ),
    ),
    bugs=(
        Bug(
            "restart",
            "no hand-over (each stage restarts the stream)",
            _restart_stream,
            "stage 1's first weights repeat stage 0's first weights value for value; no state "
            "is sent",
        ),
        Bug(
            "before-drawing",
            "the state from before the stage drew",
            _state_from_before_drawing,
            "a state is handed on, yet each stage repeats the numbers of the stage before it",
        ),
        Bug(
            "not-set",
            "the state received but never set",
            _received_not_set,
            "the state arrives, but the next stage draws from its own generator: its weights "
            "match nothing the one-process model drew",
        ),
    ),
    points=3,
    minutes=15,
)
