"""Does making the ranks agree cost more with more ranks? The course-note claim "exact seeding
makes init O(1) in the number of nodes", measured for this lab's two ways to agree.

`run(model_mb, world_sizes)` starts a cluster of each size in turn and runs the agreement
measurement (`measure.measure_size`: `sync_module_states` vs `DeterministicInit`, every rank
checked bitwise against one process) on the same model; `rows` keeps, per size and approach,
the slowest rank's time and the bytes each rank moved; `claim_text` says what they show. Bytes
are exact at any load; times only mean something where every rank has a core of its own, and
`claim_text` judges them only there.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab import measured
from fsdp_lab.cores import available_cores
from fsdp_lab.markdown import table
from fsdp_lab.meta_init.lab.analysis import agreement_row
from fsdp_lab.meta_init.lab.config import APPROACHES
from fsdp_lab.sizes import format_bytes

CLAIM = "Exact seeding makes init O(1) in the number of nodes."
APPROACHES_FIRST = next(iter(APPROACHES))


def run(
    model_mb: int, world_sizes: tuple[int, ...] = (1, 2, 3, 4), seed: int = 0, backend: str = "auto"
) -> list[dict[str, Any]]:
    """The agreement measurement on a fresh cluster of each size; one row per size."""
    from fsdp_lab.cluster import Cluster
    from fsdp_lab.meta_init.lab.measure import measure_size

    out = []
    for n in world_sizes:
        with Cluster(n, backend, verbose=False) as cluster:
            out.append(agreement_row(measure_size(model_mb, seed, cluster)))
    return rows(out)


def rows(agreement: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per world size: each approach's slowest-rank time, bytes per rank, bitwise verdict."""
    return [
        {
            "world_size": len(row[APPROACHES_FIRST]["time_s_per_rank"]),
            **{
                a: {
                    "time_s": row[a]["time_s"],
                    "bytes_per_rank": row[a]["bytes_moved"],
                    "bitwise": row[a]["bitwise_equal_to_reference"],
                }
                for a in APPROACHES
            },
        }
        for row in agreement
    ]


def table_of(sweep: list[dict[str, Any]]) -> str:
    """Markdown: per world size and approach, time (slowest rank), bytes per rank, bitwise."""
    header = ["ranks"] + [f"{a}: {what}" for a in APPROACHES for what in ("time", "bytes/rank")]
    body = [
        [r["world_size"]]
        + [
            cell
            for a in APPROACHES
            for cell in (f"{r[a]['time_s'] * 1e3:.0f} ms", format_bytes(r[a]["bytes_per_rank"]))
        ]
        for r in sweep
    ]
    return table(header, body)


def claim_text(sweep: list[dict[str, Any]], cores: int | None = None) -> str:
    """Markdown: the claim, and per approach what the sweep measured — bytes per rank against
    the rank count (exact), time where every rank had a core (judged by `fsdp_lab.measured.order`)."""
    cores = available_cores() if cores is None else cores
    first, fair = sweep[0], [r for r in sweep if r["world_size"] <= cores]
    lines = [f"**The claim:** “{CLAIM}” **Measured on 1 to {sweep[-1]['world_size']} ranks:**", ""]
    for a in APPROACHES:
        moved = {r["world_size"]: r[a]["bytes_per_rank"] for r in sweep}
        if all(b == 0 for b in moved.values()):
            bytes_part = "no rank sent a byte at any rank count — nothing to grow"
        else:
            per = ", ".join(f"{format_bytes(b)} at {n}" for n, b in moved.items())
            bytes_part = (
                f"each rank moved {per}: the whole model reaches every rank, so the total grows "
                "with the rank count"
            )
        last = fair[-1]
        t0, t1 = first[a]["time_s"], last[a]["time_s"]
        if last is first:
            time_part = "its time cannot be judged here (one core)"
        elif measured.order([t1], [t0]) > 0:  # one run each: the margin decides
            time_part = (
                f"its time grew from {t0 * 1e3:.0f} ms on 1 rank to {t1 * 1e3:.0f} ms on "
                f"{last['world_size']} ({t1 / t0:.1f}×, ranks with a core each)"
            )
        else:
            time_part = (
                f"its time did not grow beyond {measured.MARGIN:.0%} from 1 rank ({t0 * 1e3:.0f} ms) "
                f"to {last['world_size']} ({t1 * 1e3:.0f} ms, a core each)"
            )
        ok = all(r[a]["bitwise"] for r in sweep)
        lines.append(
            f"- `{a}`: {bytes_part}; {time_part}; bitwise equal to one process at every rank "
            f"count: {ok}."
        )
    lines += [
        "",
        f"Beyond {cores} rank(s) the ranks share this machine's {cores} core(s), so times there "
        "measure the sharing, not the method; the table shows them, the verdict does not use "
        "them. What makes an exact init O(1) is that a rank computes only its own slice and "
        "sends nothing — the bytes column — not that it is fast.",
    ]
    return "\n".join(lines)
