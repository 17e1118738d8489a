"""Factory models for the planner's tests: one without a declared vocabulary, and factories
that misbehave as a user's might (hang, end the process)."""

import os
import time

import torch


def no_vocab() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))


def hangs() -> torch.nn.Module:
    time.sleep(3600)  # waits on something that never comes
    return no_vocab()


def exits() -> torch.nn.Module:
    os._exit(0)  # ends the process that builds it, with no answer
