"""Byte counts as people read them (binary units), for text reports and figure axes alike.

Kept apart from `fsdp_lab.plots` so that a markdown summary does not import matplotlib.
"""

from __future__ import annotations

BYTE_UNITS = [("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024), ("B", 1)]


def byte_unit(max_bytes: float) -> tuple[str, int]:
    """The largest binary unit in which `max_bytes` is at least 1 (B below 1 KiB)."""
    for name, scale in BYTE_UNITS:
        if max_bytes >= scale:
            return name, scale
    return "B", 1


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``format_bytes(1.5 * 2**20) == "1.50 MiB"``.

    Args:
        n: a number of bytes (may be negative or fractional).
    """
    name, scale = byte_unit(abs(n))
    return f"{n:.0f} B" if scale == 1 else f"{n / scale:.2f} {name}"
