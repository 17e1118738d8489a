"""Parity table: our sharding next to single-process training and PyTorch's own, on models
nobody here wrote.

    python benchmarks/parity.py [--world-sizes 2 3] [--models NAME ...] [--strategies ...]
        [--steps 3] [--optimizer recipe|sgd|adamw] [--out PATH.json]

For each model x world size x strategy ("none", "optimizer", "grad_op", "full"): the largest
|difference| of any parameter element, on any rank, after `--steps` training steps, between
ours (`fsdp_lab.shard(model, units, strategy)`) and

- single-process training on the whole global batch;
- PyTorch's nearest configuration of each system (`parity_runs.COUNTERPARTS`): fully_shard
  (FSDP2), FSDP1 (`use_orig_params=True`), DDP (with ZeroRedundancyOptimizer for "optimizer").

Every path builds the same model (seeded), trains on its slice of the same global batch with
the same optimizer recipe (`parity_runs.py`, models in `parity_models.py`, beside this script). One gloo
`Cluster` per world size; one progress line per run on stderr; the markdown table on stdout;
`--out` writes every figure as JSON. A `†` marks a PyTorch counterpart that itself departs from
single-process training where ours does not: that figure is PyTorch's, listed under the table.

It lives with the benchmarks (a script that runs the systems side by side and reports; its
smoke test is in tests/test_benchmarks.py), although what it measures is agreement, not time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any

import torch
from parity_models import PARITY_MODELS
from parity_runs import COUNTERPARTS, FP32_TOLERANCE, train

from fsdp_lab import Cluster, RankError

STRATEGIES = ("none", "optimizer", "grad_op", "full")
COLUMNS = ("fully_shard", "FSDP1", "DDP")
RECIPES = {
    "sgd": "SGD lr 0.05, momentum 0.9, weight decay 0.01 on every parameter",
    "adamw": "AdamW lr 1e-2, weight decay 0.1, none on biases and norm weights (2 groups)",
}
Params = dict[str, torch.Tensor]


def _diff(
    a_runs: list[Params] | Exception,
    b_runs: list[Params] | Exception,
    a_name: str,
    b_name: str,
) -> dict[str, Any]:
    """max |a - b| over ranks and parameters, and where; a note instead where a run failed or
    returned other parameter names."""
    for run in (a_runs, b_runs):
        if isinstance(run, Exception):
            return {"max_abs_diff": None, "note": str(run).strip().splitlines()[-1][:200]}
    a_names, b_names = set(a_runs[0]), set(b_runs[0])
    if a_names != b_names:  # e.g. a wrapper that dropped parameters from named_parameters()
        lacks = [(a_name, b_names - a_names), (b_name, a_names - b_names)]
        return {
            "max_abs_diff": None,
            "note": "after training, "
            + "; ".join(f"{who}'s named_parameters() lacks {sorted(n)}" for who, n in lacks if n),
        }
    value, where = max(
        ((a[k] - b[k]).abs().max().item(), k)
        for a, b in zip(a_runs, b_runs, strict=True)
        for k in a
    )
    return {"max_abs_diff": value, "worst_parameter": where, "note": None}


def _import_on_rank() -> None:
    """What the first run would otherwise pay for (and its progress line would show)."""
    import parity_runs  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.optim  # noqa: F401


def measure_world(
    n: int,
    models: list[str],
    strategies: list[str],
    steps: int,
    optimizer: str | None,
    singles: dict[str, Params],
) -> list[dict[str, Any]]:
    """Every row of one world size, on one cluster."""
    rows = []
    start = time.perf_counter()
    with Cluster(n, backend="gloo", timeout=600, verbose=False) as cluster:
        cluster.run(_import_on_rank)
        print(f"[parity] N={n} ranks up: {time.perf_counter() - start:.2f} s", file=sys.stderr)
        for model in models:
            counterparts = {c for s in strategies for c in COUNTERPARTS[s].values() if c}
            runs: dict[str, list[Params] | Exception] = {}
            for system in [f"ours:{s}" for s in strategies] + sorted(counterparts):
                start = time.perf_counter()
                try:
                    runs[system] = cluster.run(train, model, system, steps, optimizer)
                    failed = ""
                except RankError as exc:  # PyTorch refusing a case is a result too
                    runs[system], failed = exc, f"  FAILED: {str(exc).splitlines()[-1][:120]}"
                took = time.perf_counter() - start
                print(f"[parity] N={n} {model} {system}: {took:.2f} s{failed}", file=sys.stderr)
            single = [singles[model]] * n
            for strategy in strategies:
                ours = runs[f"ours:{strategy}"]
                row = {
                    "model": model,
                    "optimizer": optimizer or PARITY_MODELS[model].optimizer,
                    "world_size": n,
                    "strategy": strategy,
                    "vs_single": _diff(ours, single, "ours", "single process"),
                    "vs": {},
                }
                for column, system in COUNTERPARTS[strategy].items():
                    if system is None:
                        row["vs"][column] = None
                        continue
                    cell = {"system": system, **_diff(ours, runs[system], "ours", system)}
                    alone = _diff(runs[system], single, system, "single process")
                    cell["system_vs_single"] = alone["max_abs_diff"]
                    cell["system_worst_parameter"] = alone.get("worst_parameter")
                    row["vs"][column] = cell
                rows.append(row)
    return rows


def _within(value: float | None) -> bool:
    return value is not None and value <= FP32_TOLERANCE


def _number(value: float) -> str:
    return "0" if value == 0 else f"{value:.1e}"


def render(rows: list[dict[str, Any]], steps: int) -> str:
    """The markdown table, its legend and footnotes, and the verdict — all from `rows`."""
    lines = [
        f"Max |ours - reference| over every parameter element and rank after {steps} steps "
        "(fp32, gloo). 0 = bitwise equal.",
        "",
        "| model | optimizer | N | strategy | vs single | vs fully_shard | vs FSDP1 | vs DDP |",
        "|---|---|---|---|---|---|---|---|",
    ]
    notes: list[str] = []
    for row in rows:
        ours_ok = _within(row["vs_single"]["max_abs_diff"])
        cells = [_cell(row["vs_single"], None, notes, row)]
        for column in COLUMNS:
            cells.append(_cell(row["vs"][column], ours_ok, notes, row))
        lines.append(
            f"| {row['model']} | {row['optimizer']} | {row['world_size']} | {row['strategy']} | "
            + " | ".join(cells)
            + " |"
        )
    lines += ["", *notes] if notes else []
    lines += [
        "",
        "With 2 ranks a gradient element is the sum of two contributions, and a + b = b + a in "
        "fp32: systems that reduce in different orders still agree bitwise. With 3, (a + b) + c "
        "and a + (b + c) can differ in the last bit, and which one an element gets depends on "
        "each system's collective and buffer layout: last-bit figures between correct systems.",
        "",
        "Counterparts (PyTorch's nearest configuration of each strategy):",
    ]
    for strategy, by_column in COUNTERPARTS.items():
        shown = ", ".join(f"{c}: {s or '— (none)'}" for c, s in by_column.items())
        lines.append(f"- {strategy}: {shown}")
    lines += ["", "Models and optimizers:"]
    for name in dict.fromkeys(r["model"] for r in rows):
        lines.append(f"- {name}: {PARITY_MODELS[name].what}")
    for recipe in dict.fromkeys(r["optimizer"] for r in rows):
        lines.append(f"- {recipe}: {RECIPES[recipe]}")
    lines.append(
        "- Models with attention biases train with SGD: a key bias's gradient is zero in exact "
        "arithmetic and rounding noise in fp32, which Adam turns into lr-sized steps "
        "(benchmarks/parity_models.py, [Note: Adam and a zero gradient]; --optimizer adamw shows it)."
    )
    lines += ["", verdict(rows)]
    return "\n".join(lines)


def _cell(cell: dict | None, ours_ok: bool | None, notes: list[str], row: dict) -> str:
    if cell is None:
        return "—"
    where = f"{row['model']}, N={row['world_size']}, {row['strategy']}"
    if cell["max_abs_diff"] is None:
        notes.append(f"‡{len(notes) + 1} {where}, {cell.get('system', 'ours')}: {cell['note']}")
        return f"n/a ‡{len(notes)}"
    text = _number(cell["max_abs_diff"])
    theirs = cell.get("system_vs_single")
    if ours_ok and not _within(cell["max_abs_diff"]) and not _within(theirs):
        shown = (
            "could not be compared"
            if theirs is None
            else f"is {_number(theirs)} away (largest at {cell['system_worst_parameter']})"
        )
        notes.append(
            f"†{len(notes) + 1} {where}: {cell['system']} itself {shown} from single-process "
            f"training; ours is {_number(row['vs_single']['max_abs_diff'])} away"
        )
        text += f" †{len(notes)}"
    return text


def verdict(rows: list[dict[str, Any]]) -> str:
    """How many figures are within tolerance: ours vs single process; ours vs PyTorch, counted
    apart where PyTorch's run itself matches single-process training."""
    single = [r["vs_single"]["max_abs_diff"] for r in rows]
    cells = [c for r in rows for c in r["vs"].values() if c is not None]
    compared = [c["max_abs_diff"] for c in cells if c["max_abs_diff"] is not None]
    fair = [c["max_abs_diff"] for c in cells if _within(c["system_vs_single"])]
    return (
        f"Tolerance {FP32_TOLERANCE:g} (fp32; see benchmarks/parity_runs.py). "
        f"Ours vs single process: {_count(single, 'rows')}. "
        f"Ours vs PyTorch: {_count(compared, 'cells compared')}, "
        f"{sum(1 for d in compared if d == 0)} of them bitwise equal; "
        f"where PyTorch itself matches single process: {_count(fair, 'cells')}."
    )


def _count(values: list[float | None], what: str) -> str:
    """'47 of 48 rows within (worst 7.7e-07)': how many of `values` are within tolerance."""
    known = [v for v in values if v is not None]
    worst = f" (worst {_number(max(known))})" if known else ""
    return f"{sum(1 for v in values if _within(v))} of {len(values)} {what} within{worst}"


def _positive(text: str) -> int:
    """argparse's type for a count: an int >= 1 (0 steps would compare untrained models)."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=_positive, nargs="+", default=[2, 3],
                        help="ranks of each run; each must divide every model's global batch "
                        "(default 2 3)")  # fmt: skip
    parser.add_argument("--models", nargs="+", default=list(PARITY_MODELS), metavar="NAME",
                        help=f"which models (default all: {' '.join(PARITY_MODELS)})")  # fmt: skip
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=STRATEGIES,
                        help="which of our strategies (default all)")  # fmt: skip
    parser.add_argument("--steps", type=_positive, default=3,
                        help="training steps before the comparison (default 3)")  # fmt: skip
    parser.add_argument("--optimizer", choices=("recipe", "sgd", "adamw"), default="recipe",
                        help="each model's own recipe, or one for all (default recipe)")  # fmt: skip
    parser.add_argument("--out", help="write the figures as JSON to this path")
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(PARITY_MODELS))
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {list(PARITY_MODELS)}")
    for m in args.models:  # refused here, before any rank starts
        spec = PARITY_MODELS[m]
        batch = spec.batch(0)[1].shape[spec.batch_dim]
        bad = [n for n in args.world_sizes if batch % n]
        if bad:
            fits = [n for n in range(1, batch + 1) if batch % n == 0]
            parser.error(f"--world-sizes {bad[0]}: {m}'s global batch {batch} does not split "
                         f"over {bad[0]} ranks; allowed {fits}")  # fmt: skip
    folder = os.path.dirname(os.path.abspath(args.out)) if args.out else None
    if folder and not os.access(folder, os.W_OK):  # found now, not after the runs
        parser.error(f"--out {args.out}: cannot write into {folder}")
    optimizer = None if args.optimizer == "recipe" else args.optimizer

    start = time.perf_counter()
    singles = {m: train(m, "single", args.steps, optimizer) for m in args.models}
    rows = []
    for n in args.world_sizes:
        rows += measure_world(n, args.models, args.strategies, args.steps, optimizer, singles)
    print(render(rows, args.steps))
    print(f"[parity] {len(rows)} rows in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    if args.out:
        result = {
            "steps": args.steps,
            "tolerance": FP32_TOLERANCE,
            "torch": torch.__version__,
            "python": platform.python_version(),
            "counterparts": COUNTERPARTS,
            "optimizers": RECIPES,
            "models": {m: PARITY_MODELS[m].what for m in args.models},
            "rows": rows,
            "verdict": verdict(rows),
        }
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = [r for r in rows if not _within(r["vs_single"]["max_abs_diff"])]
    if failed:  # a row that did not run, or left one process, is not a pass
        print(f"[parity] {len(failed)} of {len(rows)} rows not within tolerance", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
