"""A factory model for the planner's tests: one without a declared vocabulary."""

import torch


def no_vocab() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
