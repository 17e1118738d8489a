"""What this host can hold, checked before any rank starts: rank processes and whole models.

A value that cannot run here fails at once with the numbers and the fix — in a notebook cell
(`Cluster`) or on the command line (the labs' preflight) — instead of forking hundreds of
ranks or letting the kernel's out-of-memory killer choose a victim. Torch-free.
"""

from __future__ import annotations

import os

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


def under_torchrun() -> bool:
    """True when this process was started by torchrun (env:// rendezvous variables set)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
