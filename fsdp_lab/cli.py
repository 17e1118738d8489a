"""``fsdp-lab <lab> [options]`` — run a lab headless, save its figures and JSON.

    fsdp-lab collectives --world-size 4 --out out/     figures (PNG, diagrams SVG) + JSON in out/
    fsdp-lab collectives --json                        exactly one JSON object on stdout
    fsdp-lab tour --out out/                           every lab, with a summary.md/.json
    torchrun --nproc-per-node 4 -m fsdp_lab collectives   the same on a multi-GPU node

With ``--json`` everything else (progress, rank output) goes to stderr, so stdout parses.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from fsdp_lab.cluster import BACKENDS, open_cluster

# CLI name -> module in fsdp_lab.labs. Each module has a frozen `*Config` dataclass accepted
# by `run(config, cluster=None) -> LabResult`, plus `figures(result)` and `summary(result)`.
LABS: dict[str, tuple[str, str]] = {
    "collectives": ("fsdp_lab.labs.collectives", "CollectivesConfig"),
    "shard": ("fsdp_lab.labs.shard", "ShardConfig"),
    "checkpoint": ("fsdp_lab.labs.checkpoint", "CheckpointConfig"),
    "tying": ("fsdp_lab.labs.tying", "TyingConfig"),
    "meta-init": ("fsdp_lab.labs.meta_init", "MetaInitConfig"),
    "pp-seed": ("fsdp_lab.labs.pp_seed", "PPSeedConfig"),
}
DEFAULT_OUT = "fsdp_lab_out"


def _is_main_process() -> bool:
    # Under torchrun every rank runs this CLI; only global rank 0 prints and writes files.
    return int(os.environ.get("RANK", "0")) == 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer (expected >= 1)") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=_positive_int, default=None, help="number of ranks")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="process-group backend")
    p.add_argument(
        "--model",
        default=None,
        metavar="module:factory",
        help="a factory returning an nn.Module over token ids (for labs that train a model)",
    )
    p.add_argument(
        "--out", default=None, help=f"folder for figures and JSON (default {DEFAULT_OUT}/)"
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fsdp-lab", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="lab", required=True, metavar="<lab>")
    for name, (module, _) in LABS.items():
        p = sub.add_parser(name, help=importlib.import_module(module).__doc__.split("\n")[0])
        _common(p)
        adder = getattr(importlib.import_module(module), "add_arguments", None)
        if adder is not None:
            adder(p)
    tour = sub.add_parser("tour", help="run every lab headless; write figures and a summary")
    _common(tour)
    return parser


def _config(name: str, args: argparse.Namespace, tour: bool = False) -> tuple[ModuleType, Any]:
    module_name, config_name = LABS[name]
    module = importlib.import_module(module_name)
    config_cls = getattr(module, config_name)
    # The tour runs each lab at a laptop-friendly size (a lab's TOUR, if it has one).
    overrides: dict[str, Any] = dict(getattr(module, "TOUR", {})) if tour else {}
    overrides["backend"] = args.backend
    if args.world_size is not None:
        overrides["world_size"] = args.world_size
    if args.model is not None:
        if "model" not in config_cls.__dataclass_fields__:
            raise SystemExit(
                f"fsdp-lab {name}: --model is not used by this lab (it moves raw tensors); "
                "drop it, or pass it to a lab that trains a model"
            )
        overrides["model"] = args.model
    from_args = getattr(module, "config_from_args", None)
    if from_args is not None:
        overrides.update(from_args(args))
    try:
        return module, config_cls(**overrides)
    except ValueError as exc:
        raise SystemExit(f"fsdp-lab {name}: {exc}") from None


def _save(module: ModuleType, result: Any, out: Path) -> list[Path]:
    from fsdp_lab.diagrams import Diagram
    from fsdp_lab.plots import save_figure

    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{result.lab}.json"]
    written[0].write_text(result.to_json(indent=1))
    for stem, fig in module.figures(result).items():
        if isinstance(fig, Diagram):  # SVG, or its DOT source where graphviz's `dot` is missing
            written.append(fig.save(out / stem))
        else:
            written.append(save_figure(fig, out / f"{stem}.png"))
    return written


def run_lab(name: str, args: argparse.Namespace, out: Path | None, tour: bool = False) -> Any:
    module, config = _config(name, args, tour)
    cluster = open_cluster(config.world_size, config.backend)
    try:
        result = module.run(config, cluster=cluster)
    finally:
        cluster.close()
    if out is not None and _is_main_process():
        _save(module, result, out)
    return result


def tour(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out or DEFAULT_OUT)
    summary: dict[str, Any] = {}
    markdown = ["# fsdp_lab tour", ""]
    for i, name in enumerate(LABS, 1):
        print(f"[{i}/{len(LABS)}] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        module, _ = _config(name, args, tour=True)
        result = run_lab(name, args, out / name, tour=True)
        seconds = time.perf_counter() - t0
        summary[name] = {"seconds": round(seconds, 2), "result": result.to_dict()}
        markdown += [f"## {name} ({seconds:.1f} s)", "", module.summary(result), ""]
        print(f"[{i}/{len(LABS)}] {name} done in {seconds:.1f} s -> {out / name}/", file=sys.stderr)
    if _is_main_process():
        (out / "summary.md").write_text("\n".join(markdown))
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"summary: {out / 'summary.md'}, {out / 'summary.json'}", file=sys.stderr)
    return summary


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Keep stdout for the one JSON object: rank output and progress go to stderr.
    redirect = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with redirect:
        if args.lab == "tour":
            payload: Any = tour(args)
        else:
            out = (
                Path(args.out)
                if args.out
                else (None if args.json else Path(DEFAULT_OUT) / args.lab)
            )
            result = run_lab(args.lab, args, out)
            payload = result.to_dict()
            if not args.json and _is_main_process():
                print(importlib.import_module(LABS[args.lab][0]).summary(result))
                if out is not None:
                    print(f"figures and {args.lab}.json written to {out}/")
    if args.json and _is_main_process():
        print(json.dumps(payload))
    return 0
