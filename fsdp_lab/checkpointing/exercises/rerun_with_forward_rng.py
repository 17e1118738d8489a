"""Exercise of the checkpointing lab: a recompute that is the *same* computation.

`rerun_with_forward_rng` — the step of `fsdp_lab.checkpointing.recompute.checkpoint` that reruns a
checkpointed segment's forward during backward with the generators as they were at its
forward: set the saved RNG state, run, put the current state back. It runs inside the real
checkpoint, on a chain *with dropout* trained for a few SGD steps, beside the same training with
the reference step and with no checkpointing at all (store-all), which it must match. The
classic bugs: no restore (the recompute draws new dropout masks, so the gradients are not those
of the forward that produced the loss), and not putting the current state back (the gradients
are right, but the training's random stream jumps back: the next forward's dropout repeats
masks already drawn, and training drifts from store-all from the second step on).

`sqrt_segment_starts` (`sqrt_segment_starts.py`) — where the checkpoints go.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist

from fsdp_lab.checkpointing.recompute import (
    RNGState,
    checkpoint,
    rerun_with_forward_rng,
    run_segments,
)
from fsdp_lab.exercise import Bug, Case, Exercise, Mismatch, close, first_values, series_of
from fsdp_lab.models import Chain

STEPS = 3
DIM, BATCH, DROPOUT, LR = 8, 6, 0.5, 0.1


def _no_restore(run: Any, rng_at_forward: RNGState, cuda_devices: list[int]) -> None:
    run()  # draws whatever the generator holds now: other dropout masks than the forward's


def _no_put_back(run: Any, rng_at_forward: RNGState, cuda_devices: list[int]) -> None:
    cpu, cuda = rng_at_forward
    torch.set_rng_state(cpu)
    for device, state in zip(cuda_devices, cuda, strict=True):
        torch.cuda.set_rng_state(state, device)
    run()  # ...and the generator stays where the recompute left it


def _train(rerun: Any, case: Case, segment_size: int | None) -> dict[str, Any]:
    """STEPS SGD steps of a dropout chain on this rank's batch, checkpointed in segments of
    `segment_size` with `rerun` as the recompute's RNG step (None: store-all)."""
    torch.manual_seed(0)  # the same weights for every run
    model = Chain(case.params["layers"], DIM, dropout=DROPOUT).train()
    torch.manual_seed(1000 + dist.get_rank())  # this rank's batch and dropout stream
    x = torch.randn(BATCH, DIM)
    ckpt = functools.partial(checkpoint, rerun=rerun)
    losses, next_draws, first_grad = [], [], None
    for _ in range(STEPS):
        model.zero_grad(set_to_none=True)
        loss = run_segments(model.layers, x, segment_size, ckpt).square().mean()
        loss.backward()
        if first_grad is None:
            first_grad = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        next_draws.append(_peek())
        with torch.no_grad():  # plain SGD (torch.optim's first step costs seconds of set-up)
            for p in model.parameters():
                p -= LR * p.grad
        losses.append(loss.item())
    return {"losses": losses, "first_grad": first_grad.tolist(), "next_draws": next_draws}


def _peek() -> list[float]:
    """The next three numbers the CPU generator will draw, without drawing them."""
    state = torch.get_rng_state()
    values = torch.rand(3).tolist()
    torch.set_rng_state(state)
    return values


def trial(fn: Any, case: Case) -> dict[str, Any]:
    return {
        "store_all": _train(None, case, None),  # what every checkpointed run must reproduce
        "checkpointed": _train(fn, case, case.params["segment"]),
    }


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, (mine, reference) in enumerate(zip(got_all, expected, strict=True)):
        plain, exp, got = reference["store_all"], reference["checkpointed"], mine["checkpointed"]
        if not close(exp["first_grad"], plain["first_grad"]):  # the mechanism itself is broken
            raise AssertionError(f"rank {r}: the reference checkpoint differs from store-all")
        rows = [
            ("loss at step 1 (the forward)", f"{plain['losses'][0]:.6g}", f"{got['losses'][0]:.6g}"),
            ("step-1 gradient, first 3 values", first_values(plain["first_grad"]), first_values(got["first_grad"])),
            ("next 3 random numbers after step 1", first_values(plain["next_draws"][0]), first_values(got["next_draws"][0])),
            (f"loss after {STEPS} steps", f"{plain['losses'][-1]:.6g}", f"{got['losses'][-1]:.6g}"),
        ]  # fmt: skip
        series = series_of(
            f"loss per step, rank {r}",
            "step",
            "loss",
            {"store-all (no checkpoint)": plain["losses"], "yours": got["losses"]},
        )
        if not close(got["first_grad"], plain["first_grad"]):
            return Mismatch(
                f"rank {r}: step 1's gradients differ from training without checkpointing (which "
                "the reference checkpoint matches): the recompute did not use the forward's "
                "dropout masks.",
                rows=rows,
                hint="The recompute drew new dropout masks: set the generator to "
                "`rng_at_forward` (torch.set_rng_state) before calling run().",
                series=series,
            )
        if not close(got["next_draws"][0], plain["next_draws"][0]):
            return Mismatch(
                f"rank {r}: the gradients are right, but after the backward the generator is not "
                "where training without checkpointing leaves it, so the next forward draws other "
                "dropout masks and the loss drifts from step 2 on.",
                rows=rows,
                hint="Put the generator back after run(): save torch.get_rng_state() before "
                "setting the forward's state and restore it afterwards, or the next forward's "
                "dropout repeats masks already drawn.",
                series=series,
            )
        if not close(got["losses"], plain["losses"]):
            return Mismatch(
                f"rank {r}: the loss drifts from training without checkpointing within "
                f"{STEPS} steps.",
                rows=rows,
                hint="Set the forward's state, call run() once, then restore the state you "
                "found: nothing else should touch the generators.",
                series=series,
            )
    return None


RERUN_WITH_FORWARD_RNG = Exercise(
    name="rerun_with_forward_rng",
    lab="checkpoint",
    title="Recompute a checkpointed segment with the forward's dropout masks",
    statement=(
        "A checkpointed segment keeps only its inputs; in backward, `checkpoint` reruns the "
        "segment's forward to get back the activations backward needs. With dropout that rerun "
        "must draw the **same masks** as the forward did, or the gradients belong to another "
        "network. `checkpoint` saved the generators' state just before the forward. Write "
        "`rerun_with_forward_rng(run, rng_at_forward, cuda_devices)`: call `run()` (it reruns "
        "the segment; no arguments, returns nothing) with the generators set to "
        "`rng_at_forward`, a tuple `(cpu_state, [state of each CUDA device])`, and afterwards "
        "put the generators back as they were before, so that training's random stream goes "
        "on as if there had been no recompute. `cuda_devices` lists the CUDA device indexes "
        "of the segment's inputs, in the order of the CUDA states (empty on CPU). Your "
        "function runs inside `fsdp_lab.checkpointing.recompute.checkpoint`, on a dropout chain trained "
        "for a few steps, which must match training without checkpointing."
    ),
    stub=(
        "def rerun_with_forward_rng(run, rng_at_forward, cuda_devices):\n"
        '    """Call run() with the RNG state of the forward, then restore the current one."""\n'
    ),
    hints=(
        "`torch.get_rng_state()` returns the CPU generator's state, `torch.set_rng_state(s)` "
        "sets it; `torch.cuda.get_rng_state(d)` / `torch.cuda.set_rng_state(s, d)` do the same "
        "for CUDA device d.",
        "Three moves: remember the state now, set the forward's, call run(); then set the "
        "remembered state again (in a `finally`, so an error cannot leave it changed).",
        "now = torch.get_rng_state(); torch.set_rng_state(rng_at_forward[0]) (and each CUDA "
        "device's from rng_at_forward[1]); try: run() finally: torch.set_rng_state(now) "
        "(and the CUDA states saved likewise).",
    ),
    solution=rerun_with_forward_rng,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, 4 dropout layers in 2 segments of 2", 2, {"layers": 4, "segment": 2}),
        Case("3 ranks, 5 dropout layers in segments of 2, 2, 1", 3, {"layers": 5, "segment": 2}),
    ),
    bugs=(
        Bug(
            "no-restore",
            "recompute without restoring the RNG",
            _no_restore,
            "the recompute draws new dropout masks: the gradients differ from training "
            "without checkpointing although the loss is the same",
        ),
        Bug(
            "no-put-back",
            "forward's RNG set, current one never put back",
            _no_put_back,
            "the first gradients are right, but the random stream jumps back: the next "
            "forward repeats dropout masks and the loss drifts from step 2 on",
        ),
    ),
    points=2,
    minutes=10,
)
