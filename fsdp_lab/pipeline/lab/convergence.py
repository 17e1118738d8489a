"""Lab 05, does the same-seed init train worse? The claim, and a measurement that can show it.

Course notes say that seeding every pipeline stage alike "harms convergence". The lab's main
training cannot show that: its tokens are uniformly random, so every init can only approach
ln V, and it trains a few steps. Here the unsplit init and the same-seed init (`same_seed`,
stage by stage — it sends nothing, so one process computes exactly what each rank would) are
trained on a task with something to learn, at several seeds, and the difference between the two
inits is set beside the spread between seeds: a difference smaller than that spread is a
difference this experiment cannot tell from luck.

The task: each sequence walks a fixed random permutation of the vocabulary — the next token is
``perm[token]`` with probability `KEEP`, otherwise uniform. The best possible loss is the
entropy of that next-token distribution (`entropy_floor`), drawn beside the curves. Training is
single-process (GPipe computes the same loss within float rounding: the lab's loss check), with
Adam, so that the small model learns the task in a few hundred steps.

The verdict (`compare`) is the lab's; the sentence is `report.convergence_sentence`'s.
"""

from __future__ import annotations

import math
from statistics import mean
from typing import Any

import torch
import torch.nn.functional as F

from fsdp_lab.pipeline import PipeGPT, stage_info
from fsdp_lab.pipeline.lab.config import MIN_SEEDS, PPSeedConfig
from fsdp_lab.pipeline.rng import init_stage

KEEP = 0.8  # probability that the next token follows the permutation
PERMUTATION_SEED = 7  # the task's permutation: the same for every init and seed
DATA_SEED = 5000  # step k's batch: generator seeded DATA_SEED + k, the same for every run
LR = 3e-3  # Adam
TAIL = 0.1  # "final loss": the mean over the last 10% of the steps (batches differ per step)
INITS = ("unsplit", "same_seed")


def entropy_floor(vocab: int, keep: float = KEEP) -> float:
    """The task's lowest possible cross-entropy (nats): the next token is ``perm[x]`` with
    probability keep + (1 - keep)/V, any other with (1 - keep)/V."""
    other = (1 - keep) / vocab
    hit = keep + other
    return -(hit * math.log(hit) + (vocab - 1) * other * math.log(other))


def task_batch(
    vocab: int, batch: int, seq_len: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s token ids (B, T) and next-token targets (B, T), the same for every run."""
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(PERMUTATION_SEED))
    g = torch.Generator().manual_seed(DATA_SEED + step)
    tokens = torch.empty(batch, seq_len + 1, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    for t in range(seq_len):
        follow = torch.rand(batch, generator=g) < KEEP
        anywhere = torch.randint(0, vocab, (batch,), generator=g)
        tokens[:, t + 1] = torch.where(follow, perm[tokens[:, t]], anywhere)
    return tokens[:, :-1], tokens[:, 1:]


def initial_model(config: PPSeedConfig, init: str, seed: int) -> PipeGPT:
    """The whole model as `init` leaves it: "unsplit" (``manual_seed(seed); init_weights()``)
    or "same_seed" (every stage of one S-stage pipeline initialised by the mechanism, joined)."""
    model = PipeGPT(config.gpt())
    if init == "unsplit":
        torch.manual_seed(seed)
        model.init_weights()
        return model
    if init != "same_seed":
        raise ValueError(f"init={init!r}: allowed one of {list(INITS)}")
    joined: dict[str, torch.Tensor] = {}
    for s in range(config.stages):
        info = stage_info(s, config.stages, config.stages, config.layers)
        joined |= init_stage("same_seed", config.gpt(), info, seed).state_dict()
    model.load_state_dict(joined)
    return model


def train(config: PPSeedConfig, init: str, seed: int) -> list[float]:
    """Loss per step of `convergence_steps` Adam steps on the task, from `init` at `seed`."""
    model = initial_model(config, init, seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    losses = []
    for step in range(config.convergence_steps):
        x, y = task_batch(config.vocab, config.global_batch, config.seq_len, step)
        logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def jobs(config: PPSeedConfig) -> list[tuple[int, str]]:
    """Every (seed, init) to train: seeds ``seed, seed + 1, ...``, both inits at each."""
    return [(config.seed + k, init) for k in range(config.convergence_seeds) for init in INITS]


def final_loss(curve: list[float], end: int | None = None) -> float:
    """The mean loss over the `TAIL` of the steps before `end` (default: all; at least one)."""
    end = len(curve) if end is None else end
    n = max(1, round(len(curve) * TAIL))
    return mean(curve[max(0, end - n) : end])


def compare(config: PPSeedConfig, curves: dict[str, dict[int, list[float]]]) -> dict[str, Any]:
    """The two inits' final losses seed by seed, and whether same_seed ended worse than luck.

    Args:
        config: the lab's config (the task's vocabulary, the steps).
        curves: init -> seed -> loss per step.

    The test, stated: the seeds pair the two inits (each seed: the same batches for both), so
    the per-seed differences d = same_seed - unsplit are what varies; "shown" means their 95 %
    confidence interval (Student's t, k - 1 degrees of freedom) lies wholly above 0 (harm) or
    below 0 (help), with at least `MIN_SEEDS` seeds; otherwise the run is inconclusive.
    A rule against the range of one init's losses (max - min) is not used: the range grows
    with the number of seeds, so the verdict would flip as seeds are added.
    """
    seeds = sorted(curves["unsplit"])
    final = {init: [final_loss(curves[init][s]) for s in seeds] for init in INITS}
    steps = len(curves["unsplit"][seeds[0]])
    # The gap along the run, at each quarter: does it open early and close, or last?
    quarters = sorted({max(1, round(steps * q / 4)) for q in (1, 2, 3, 4)})
    gap_along = [
        [
            end,
            mean(
                final_loss(curves["same_seed"][s], end) - final_loss(curves["unsplit"][s], end)
                for s in seeds
            ),
        ]
        for end in quarters
    ]
    diffs = [b - a for a, b in zip(final["unsplit"], final["same_seed"], strict=True)]
    spread = max(final["unsplit"]) - min(final["unsplit"])
    interval = paired_interval(diffs)
    return {
        "seeds": seeds,
        "steps": config.convergence_steps,
        "tail_steps": max(1, round(config.convergence_steps * TAIL)),
        "entropy_floor": entropy_floor(config.vocab),
        "uniform_loss": math.log(config.vocab),
        "curves": {init: [curves[init][s] for s in seeds] for init in INITS},
        "final": final,
        "diffs": diffs,
        "mean_diff": mean(diffs),
        "gap_along": gap_along,
        "worse_every_seed": all(d > 0 for d in diffs),
        "seed_spread": spread,
        "interval": interval,  # the mean difference's 95 % interval, None for one seed
        "harm_shown": len(seeds) >= MIN_SEEDS and interval is not None and interval[0] > 0,
        "help_shown": len(seeds) >= MIN_SEEDS and interval is not None and interval[1] < 0,
    }


# Student's t at 97.5 % (a two-sided 95 % interval) by degrees of freedom; 1.96 beyond 30.
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def paired_interval(diffs: list[float]) -> list[float] | None:
    """The 95 % confidence interval of the mean of `diffs` (Student's t), or None for fewer
    than 2 values."""
    k = len(diffs)
    if k < 2:
        return None
    m = mean(diffs)
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / (k - 1))
    half = (T975[k - 2] if k - 1 <= len(T975) else 1.96) * sd / math.sqrt(k)
    return [m - half, m + half]
