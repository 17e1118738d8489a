"""Llama-3-70B on the meta device three ways, side by side; DeterministicInit's speed.

    python benchmarks/bench_meta_init.py [--repeats 5] [--real-gib 1.5]
        [--init-elements 4194304] [--json]

The three ways to build ``Llama(llama_70b_config())`` without memory:

    plain       ``with torch.device("meta")``: PyTorch's own, what the package did before
    ours        ``meta_init.build_on_meta``: the same, with init fills skipped on meta
                (`fsdp_lab.meta_init.meta_device`)
    accelerate  ``accelerate.init_empty_weights()``: each parameter moved to meta as it is
                registered (include_buffers=False, its default: buffers stay on the CPU)

accelerate is an optional benchmark dependency (``pip install -e '.[bench]'``); without it the
benchmark prints a line saying so and measures the other two.

Each repeat builds twice in a fresh Python process per way (torch, fsdp_lab and accelerate
imported before the clock starts), the ways interleaved (plain, ours, accelerate, plain, ...)
so that machine noise hits all alike, and so the resident-memory growth is this build's alone,
not memory a previous repeat left to the allocator. Per build: seconds (perf_counter), RSS
growth (`RssSampler`, peak minus start, sampled every 5 ms), the modules it imported, and the
seconds the garbage collector ran inside it (`gc.callbacks`). Printed: medians, the ratio of
each way's first build to ours, the issue's targets (< 0.5 s, < 200 MB) judged on ours.

For contrast, one more fresh process builds a model of `--real-gib` fp32 parameters the
ordinary way (`llama_config_of_bytes`): its growth is the parameters' bytes.

Then, in this process, `DeterministicInit` fills `--init-elements` elements per kind
(uniform: Linear weights; normal: embeddings), median of 3, next to PyTorch's sequential
``uniform_`` / ``normal_`` on the same count — elements per second on this CPU, at 1 torch
thread and at the default thread count (on a shared, loaded machine the multi-threaded figure
swings by orders of magnitude: each elementwise op then waits for every thread).

`--json` prints exactly one JSON object on stdout instead of the text. No assertion: a
benchmark reports, tests assert behaviour.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

MB = 10**6
TARGET_SECONDS, TARGET_BYTES = 0.5, 200 * MB
WAYS = {
    "plain": 'with torch.device("meta")',
    "ours": "build_on_meta (init fills skipped on meta)",
    "accelerate": "accelerate.init_empty_weights()",
}
INSTALL_ACCELERATE = "pip install -e '.[bench]' (or: pip install accelerate)"
FIRST_BUILD_NOTE = """\
A plain meta build pays, the first time in a process, a cost that does not grow with the model:
nn.Embedding's normal_ has no C++ meta kernel, and its Python one (torch._refs.normal, wrapped
in torch._disable_dynamo) imports torch._dynamo: ~830 modules (sympy, torch._inductor). Ours
turns init fills on meta tensors into no-ops, so nothing is imported. accelerate's
init_empty_weights moves each parameter to meta as it is registered; reset_parameters() then
runs on meta and pays the same import. What is left of "first minus second" is mostly one full
garbage collection over the objects `import torch` left behind (the GC column)."""


@contextmanager
def gc_seconds() -> Iterator[list[float]]:
    """Seconds the garbage collector runs inside the block: [total], filled on exit."""
    total, started = [0.0], [0.0]

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            total[0] += time.perf_counter() - started[0]

    gc.callbacks.append(callback)
    try:
        yield total
    finally:
        gc.callbacks.remove(callback)


def meta_builder(way: str) -> Callable[[Callable[[], torch.nn.Module]], torch.nn.Module]:
    """`way`'s build: factory -> model on meta. Imports what it needs now, before any clock."""
    from fsdp_lab.meta_init.counter_init import build_on_meta

    if way == "plain":
        return lambda factory: build_on_meta(factory, skip_init=False)[0]
    if way == "ours":
        return lambda factory: build_on_meta(factory)[0]
    from accelerate import init_empty_weights  # ImportError: reported as a skip

    def build(factory: Callable[[], torch.nn.Module]) -> torch.nn.Module:
        with init_empty_weights(include_buffers=False):
            return factory()

    return build


def child_meta(way: str) -> dict[str, Any]:
    """Two builds in this (fresh) process: the first pays any one-time cost."""
    from fsdp_lab.meta_init.counter_init import meta_summary
    from fsdp_lab.models import Llama, llama_70b_config
    from fsdp_lab.trace import RssSampler

    start = time.perf_counter()
    try:
        build = meta_builder(way)
    except ImportError as exc:
        return {"skipped": f"import accelerate failed ({exc}): {INSTALL_ACCELERATE}"}
    import_seconds = time.perf_counter() - start
    config, out, models = llama_70b_config(), {}, []
    for which in ("first", "second"):
        modules = len(sys.modules)
        with RssSampler() as rss, gc_seconds() as collecting:
            start = time.perf_counter()
            model = build(lambda: Llama(config))
            seconds = time.perf_counter() - start
        out[which] = {
            "seconds": seconds,
            "rss_growth_bytes": rss.growth_bytes,
            "gc_seconds": collecting[0],
            "modules_imported": len(sys.modules) - modules,
        }
        models.append(model)  # kept alive: the second build cannot reuse the first's memory
    summary = meta_summary(models[0])
    return {
        **out,
        "import_seconds": import_seconds,
        "parameters": summary["parameters"],
        "parameter_devices": sorted({str(p.device) for p in models[0].parameters()}),
        "fp32_bytes": 4 * summary["parameters"],
    }


def child_real(gib: float) -> dict[str, Any]:
    """An ordinary build of `gib` GiB of fp32 parameters in this (fresh) process."""
    from fsdp_lab.models import Llama, llama_config_of_bytes, llama_param_count
    from fsdp_lab.trace import RssSampler

    config = llama_config_of_bytes(int(gib * 2**30))
    with RssSampler() as rss:
        start = time.perf_counter()
        Llama(config)
        seconds = time.perf_counter() - start
    parameters = llama_param_count(config)
    return {
        "seconds": seconds,
        "rss_growth_bytes": rss.growth_bytes,
        "parameters": parameters,
        "fp32_bytes": 4 * parameters,
        "n_layers": config.n_layers,
    }


def run_child(kind: str, gib: float = 0.0, way: str = "ours") -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--real-gib", str(gib)]
    proc = subprocess.run([*cmd, "--way", way], capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"child {kind} {way} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput(elements: int, threads: int) -> dict[str, float]:
    """Elements per second at `threads` torch threads: DeterministicInit per kind, and
    PyTorch's own sequential generator on the same tensor."""
    from fsdp_lab.meta_init.counter_init import DeterministicInit

    init, out = DeterministicInit(seed=0), torch.empty(elements)
    cases = {
        "deterministic_uniform": lambda: init.fill_slice_(
            out, "layers.0.w.weight", (elements, 1), 0
        ),
        "deterministic_normal": lambda: init.fill_slice_(
            out, "tok_embeddings.weight", (elements, 1), 0
        ),
        "torch_uniform_": lambda: out.uniform_(-0.01, 0.01),
        "torch_normal_": lambda: out.normal_(),
    }
    previous, result = torch.get_num_threads(), {}
    torch.set_num_threads(threads)
    try:
        for label, fn in cases.items():
            fn()  # warm-up
            times = []
            for _ in range(3):
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
            result[label] = elements / statistics.median(times)
    finally:
        torch.set_num_threads(previous)
    return result


def measure_ways(repeats: int) -> dict[str, Any]:
    """`repeats` fresh processes per way, interleaved; medians per way and build."""
    ways = list(WAYS)
    skipped = None
    if importlib.util.find_spec("accelerate") is None:
        skipped = f"accelerate is not installed: {INSTALL_ACCELERATE}"
        ways.remove("accelerate")
    runs: dict[str, list[dict[str, Any]]] = {way: [] for way in ways}
    for _ in range(repeats):
        for way in list(ways):
            run = run_child("meta", way=way)
            if "skipped" in run:  # installed, but its import fails (missing dependencies)
                skipped = run["skipped"]
                ways.remove(way)
                del runs[way]
                continue
            runs[way].append(run)
    first = next(iter(runs.values()))[0]
    meta: dict[str, Any] = {
        "parameters": first["parameters"],
        "fp32_bytes": first["fp32_bytes"],
        "accelerate_skipped": skipped,
        "ways": {},
    }
    for way, per_process in runs.items():
        entry: dict[str, Any] = {
            "how": WAYS[way],
            "parameter_devices": per_process[0]["parameter_devices"],
            "median_import_seconds": statistics.median(r["import_seconds"] for r in per_process),
        }
        for build in ("first", "second"):
            values = {k: [r[build][k] for r in per_process] for k in per_process[0][build]}
            entry[build] = {
                "median_seconds": statistics.median(values["seconds"]),
                "median_rss_growth_bytes": statistics.median(values["rss_growth_bytes"]),
                "median_gc_seconds": statistics.median(values["gc_seconds"]),
                "median_modules_imported": statistics.median(values["modules_imported"]),
                "seconds_per_repeat": values["seconds"],
                "rss_growth_bytes_per_repeat": values["rss_growth_bytes"],
            }
        meta["ways"][way] = entry
    ours = meta["ways"]["ours"]
    meta["ratio_to_ours"] = {  # > 1: slower than ours
        way: {
            build: entry[build]["median_seconds"] / ours[build]["median_seconds"]
            for build in ("first", "second")
        }
        for way, entry in meta["ways"].items()
    }
    return meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per way")
    parser.add_argument(
        "--real-gib", type=float, default=1.5, help="ordinary build for contrast (0: skip)"
    )
    parser.add_argument("--init-elements", type=int, default=1 << 22)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--child", choices=["meta", "real"], help=argparse.SUPPRESS)
    parser.add_argument("--way", choices=list(WAYS), default="ours", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(
            json.dumps(child_meta(args.way) if args.child == "meta" else child_real(args.real_gib))
        )
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    load_start = os.getloadavg()
    meta = measure_ways(args.repeats)
    real = run_child("real", args.real_gib) if args.real_gib > 0 else None
    threads = sorted({1, torch.get_num_threads()})
    speed = {str(t): throughput(args.init_elements, t) for t in threads}
    first = meta["ways"]["ours"]["first"]
    result = {
        "machine": {
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "accelerate": _version_of("accelerate"),
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
        },
        "repeats": args.repeats,
        "llama_70b_on_meta": meta,
        "targets": {"seconds": TARGET_SECONDS, "rss_growth_bytes": TARGET_BYTES},
        "meets_targets": {  # ours, first build: what a fresh training job pays
            "seconds": first["median_seconds"] < TARGET_SECONDS,
            "rss_growth": first["median_rss_growth_bytes"] < TARGET_BYTES,
        },
        "ordinary_build": real,
        "init_elements": args.init_elements,
        "init_elements_per_second": speed,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result)


def _version_of(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _load(values: Any) -> str:
    return ", ".join(f"{x:.1f}" for x in values)


def print_text(result: dict[str, Any]) -> None:
    m, meta, real = result["machine"], result["llama_70b_on_meta"], result["ordinary_build"]
    print(
        f"machine: {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads), "
        f"accelerate {m['accelerate'] or 'not installed'}"
    )
    print(f"load average (1, 5, 15 min) at the start: {_load(m['load_average_start'])}")
    print(
        f"\nLlama-3-70B shape on meta: {meta['parameters']:,} parameters, "
        f"{meta['fp32_bytes'] / 1e9:.1f} GB in fp32, none of it allocated"
    )
    if meta["accelerate_skipped"]:
        print(f"accelerate: skipped — {meta['accelerate_skipped']}")
    print(
        f"{result['repeats']} fresh processes per way, interleaved, two builds in each; medians:\n"
    )
    print(
        "| way | first build (s) | first / ours | second build (s) | RSS growth, first (MB) "
        "| modules imported by the first | GC inside the first (s) | first build, per process (s) |"
    )
    print("|---" * 8 + "|")
    for way, entry in meta["ways"].items():
        f, s = entry["first"], entry["second"]
        print(
            f"| {way}: {entry['how']} | {f['median_seconds']:.3f} "
            f"| {meta['ratio_to_ours'][way]['first']:.2f} | {s['median_seconds']:.3f} "
            f"| {f['median_rss_growth_bytes'] / MB:.1f} | {f['median_modules_imported']:.0f} "
            f"| {f['median_gc_seconds']:.3f} "
            f"| {', '.join(f'{x:.3f}' for x in f['seconds_per_repeat'])} |"
        )
    ok, target = result["meets_targets"], result["targets"]
    print(
        f"\ntargets (ours, first build): < {target['seconds']} s: "
        f"{'yes' if ok['seconds'] else 'no'}, < {target['rss_growth_bytes'] / MB:.0f} MB: "
        f"{'yes' if ok['rss_growth'] else 'no'}"
    )
    print(FIRST_BUILD_NOTE)
    if real:
        print(
            f"\nordinary build for contrast: {real['parameters']:,} parameters "
            f"({real['n_layers']} layers, {real['fp32_bytes'] / MB:.0f} MB fp32) in "
            f"{real['seconds']:.2f} s, RSS growth {real['rss_growth_bytes'] / MB:.0f} MB"
        )
    speed = result["init_elements_per_second"]
    print(f"\ninit, {result['init_elements']:,} float32 elements, median of 3 (M elements/s):\n")
    print("| torch threads | " + " | ".join(next(iter(speed.values()))) + " |")
    print("|---" * (1 + len(next(iter(speed.values())))) + "|")
    for threads, by_case in speed.items():
        print(f"| {threads} | " + " | ".join(f"{v / 1e6:.1f}" for v in by_case.values()) + " |")
    print(f"load average (1, 5, 15 min) at the end: {_load(m['load_average_end'])}")


if __name__ == "__main__":
    main()
