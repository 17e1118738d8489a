"""What the tying exercises train: three tiny models and one run, sharded or in one process.

    gpt        TinyGPT: the head *is* the token embedding (one tie, two owners)
    shared     `SharedWeights`: that tie, one position table read by two modules, and one
               Linear registered in two stages (ties through one module reached under two
               names: its weight and its bias)
    untied     MLPStack: embedding and head apart (no tie)

A wrap plan is judged by running it: `shard` the model with it, train a few SGD steps, and set
the loss and each tie's two copies beside one-process training of the same model.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_lab import comm
from fsdp_lab.models import MLPStack, tiny_gpt
from fsdp_lab.reference import train_steps
from fsdp_lab.sharding import full_state_dict, shard, sharding_state
from fsdp_lab.sharding.wrap import WrapPlan
from fsdp_lab.trace import MemoryTracker

STEPS = 3
LR = 0.5
SEQ_LEN = 8


class _Stage(nn.Module):
    def __init__(self, mix: nn.Linear, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mix = mix  # the same Linear in both stages: one module, two names

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.mix(self.norm(x)))


class SharedWeights(nn.Module):
    """Three ways to share: the head is the embedding; one position table read by two
    modules (`pos_in`, `pos_out`); one Linear registered in two stages (ALBERT-style)."""

    def __init__(self, vocab_size: int = 24, dim: int = 8, seq_len: int = SEQ_LEN) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.emb = nn.Embedding(vocab_size, dim)
        self.pos_in = nn.Embedding(seq_len, dim)
        mix = nn.Linear(dim, dim)
        self.first = _Stage(mix, dim)
        self.second = _Stage(mix, dim)
        self.pos_out = nn.Embedding(seq_len, dim)
        self.pos_out.weight = self.pos_in.weight
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.second(self.first(self.emb(idx) + self.pos_in(pos)))  # (B, T, C)
        return self.head(x + self.pos_out(pos))  # (B, T, V)


def build(name: str) -> nn.Module:
    """The model `name`, seeded: every rank and every call builds the same values."""
    torch.manual_seed(0)
    if name == "gpt":
        return tiny_gpt(vocab_size=24, seq_len=SEQ_LEN, dim=8, n_layers=2, n_heads=2)
    if name == "shared":
        return SharedWeights()
    if name == "untied":
        return MLPStack(vocab_size=24, dim=8, n_layers=2)
    raise ValueError(f"model {name!r}: expected 'gpt', 'shared' or 'untied'")


def tie_groups(model: nn.Module) -> list[list[str]]:
    """Every name of each Parameter reached under two or more names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [n for n in names.values() if len(n) > 1]


def _gaps(values: dict[str, torch.Tensor], groups: list[list[str]]) -> list[float]:
    """Per tie: the largest difference between the copies its names hold (0: one copy)."""
    return [
        max((values[n] - values[g[0]]).abs().max().item() for n in g[1:]) if g else 0.0
        for g in groups
    ]


def one_process(name: str) -> dict[str, Any]:
    """The right run: the model trained in one process, its ties intact."""
    model = build(name)
    groups = tie_groups(model)
    losses = train_steps(model, torch.optim.SGD(model.parameters(), lr=LR), STEPS, seq_len=SEQ_LEN)
    values = dict(model.named_parameters(remove_duplicate=False))
    return {"losses": losses, "gaps": _gaps(values, groups), "ties": groups}


def sharded(name: str, plan: WrapPlan, memory: bool = False) -> dict[str, Any]:
    """The model sharded with `plan` on every rank, trained `STEPS` steps: the global loss per
    step, each tie's gap between its copies, and the units the mechanism built."""
    model = build(name)
    groups = tie_groups(model)
    rank, world = dist.get_rank(), dist.get_world_size()
    mem = MemoryTracker() if memory else None
    with mem or contextlib.nullcontext():
        shard(model, plan)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        if mem is not None:  # the shards, then what the steps add: gathered units above all
            mem.track(model)
            mem.track(opt)
            mem.reset_peak()
        local = train_steps(model, opt, STEPS, seq_len=SEQ_LEN, rank=rank, world=world)
    trace = mem.trace() if mem is not None else None
    losses = torch.tensor(local, dtype=torch.float64)
    comm.all_reduce(losses)  # each rank's loss is the mean over its part of the batch
    values = full_state_dict(model, rank0_only=False)
    units = [(u.name, u.flat.numel) for u in sharding_state(model).units]
    return {
        "losses": (losses / world).tolist(),
        "gaps": _gaps(values, groups),
        "ties": groups,
        "units": units,
        "peak_bytes": trace["peak_bytes"] if trace else None,
        "memory": trace["total"] if trace else None,
    }
