"""What this host can hold, checked before any rank starts: rank processes and whole models.

A value that cannot run here fails at once with the numbers and the fix — in a notebook cell
(`Cluster`) or on the command line (the labs' preflight) — instead of forking hundreds of
ranks or letting the kernel's out-of-memory killer choose a victim. Torch-free.
"""

from __future__ import annotations

import functools
import os
import socket

import psutil

# What one rank process holds of its own: about 50 MB measured (USS of a gloo rank on torch
# 2.13's CPU build, forked from the fork server, after importing the exercises); counted
# twice over for the work a lab gives it.
RANK_BYTES = 128 << 20
USABLE = 0.8  # of the memory available now: the driver and the system need the rest
GiB = 1 << 30


def available_bytes() -> int:
    return psutil.virtual_memory().available


def check_ranks_fit(world_size: int, name: str = "world_size") -> None:
    """A ValueError if `world_size` rank processes would not fit in this host's memory."""
    need, free = world_size * RANK_BYTES, available_bytes()
    if need > USABLE * free:
        fits = max(1, int(USABLE * free // RANK_BYTES))
        raise ValueError(
            f"{name}={world_size}: {world_size} rank processes need about {need / GiB:.1f} GiB "
            f"of host memory (about {RANK_BYTES >> 20} MiB each before any model), "
            f"{free / GiB:.1f} GiB is available. Fix: {name}={fits}"
        )


def check_fits(need: int, what: str, fix: str) -> None:
    """A ValueError if `need` bytes (for `what`) would not fit in this host's memory."""
    free = available_bytes()
    if need > USABLE * free:
        raise ValueError(
            f"{what} needs about {need / GiB:.1f} GiB of host memory, {free / GiB:.1f} GiB is "
            f"available. Fix: {fix}"
        )


# [Note: an environment is a launcher's only while the launcher lives] torchrun hands each
# worker its rank in environment variables, but a shell keeps them: a `RANK=1` left exported,
# or a job's whole set copied into a terminal, made every command a "rank 1" that printed
# nothing, or waited forever for peers that were never started. So the variables count only
# when torchrun's own run id is set, a Python running torchrun is this process's parent (or one
# level above: `torchrun --no-python` through a wrapper) and, where that agent serves the
# rendezvous store, the store answers; otherwise a command drops them, saying so in one line
# (`forget_stale_launcher_env`).
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARS = (*RENDEZVOUS_VARS, "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "TORCHELASTIC_RUN_ID")  # fmt: skip
AGENTS = ("torchrun", "torch.distributed.run", "torch.distributed.launch")


def under_torchrun() -> bool:
    """True in a worker of a live torchrun job: its rendezvous variables and run id set, a
    torchrun agent (a Python running torchrun) above this process, and — where the agent
    serves the rendezvous store — that store answering. A shell that kept a job's variables,
    or a program merely named torchrun, is none."""
    wanted = (*RENDEZVOUS_VARS, "TORCHELASTIC_RUN_ID")
    if not all(k in os.environ for k in wanted) or not _agent_above():
        return False
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return True
    return _store_answers(os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"])


@functools.cache
def _agent_above() -> bool:
    try:
        parent = psutil.Process().parent()
        for _ in range(2):
            if parent is None:
                return False
            command = parent.cmdline()[:3]  # `torchrun ...`, `python -m torch.distributed.run`
            python = os.path.basename(parent.exe()).startswith("python")
            if python and any(os.path.basename(part) in AGENTS for part in command):
                return True
            parent = parent.parent()
    except psutil.Error:
        return False
    return False


@functools.cache
def _store_answers(address: str, port: str) -> bool:
    """The agent's rendezvous store accepts a connection (a stale address does not)."""
    try:
        with socket.create_connection((address, int(port)), timeout=5):
            return True
    except (OSError, ValueError):
        return False


def forget_stale_launcher_env() -> dict[str, str]:
    """The launcher variables this process inherited without being a worker of a live torchrun
    job, removed from its environment (nothing it starts sees them); {} under torchrun."""
    if under_torchrun():
        return {}
    return {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}


def torchrun_rank() -> int:
    """This worker's global rank under torchrun (0 elsewhere); a ValueError naming the variable
    if torchrun's RANK and WORLD_SIZE are not a rank of its world."""
    if not under_torchrun():
        return 0
    rank, world = os.environ["RANK"], os.environ["WORLD_SIZE"]
    if not (rank.isdigit() and world.isdigit() and int(rank) < int(world)):
        raise ValueError(
            f"RANK={rank!r}, WORLD_SIZE={world!r}: expected 0 <= RANK < WORLD_SIZE, integers, "
            "as torchrun sets them. Fix: start the command with torchrun, and do not set RANK "
            "or WORLD_SIZE yourself"
        )
    return int(rank)
