"""Llama-3-70B on the meta device: build time and host memory; DeterministicInit's speed.

    python benchmarks/bench_meta_init.py [--repeats 5] [--real-gib 1.5]
        [--init-elements 4194304] [--json]

Each repeat builds ``Llama(llama_70b_config())`` under ``torch.device("meta")`` in a fresh
Python process (torch and fsdp_lab imported before the clock starts), so the resident-memory
growth is this build's alone, not memory a previous repeat left to the allocator. Printed: the
median build seconds (`build_on_meta`, perf_counter) and the median RSS growth (`RssSampler`,
peak minus start, sampled every 5 ms), next to the issue's targets (< 2 s, < 200 MB).

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
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

MB = 10**6
TARGET_SECONDS, TARGET_BYTES = 2.0, 200 * MB
FIRST_BUILD_NOTE = """\
The first build in a process pays a one-time cost that does not grow with the model: the first
meta operator with no C++ meta kernel (nn.Embedding's normal_ here) makes PyTorch import its
Python meta kernels (torch._dynamo, torch._inductor, sympy: ~830 modules). The second build is
the model's own cost: module and Parameter objects, no storage."""


def child_meta() -> dict[str, Any]:
    """Two builds in this (fresh) process: the first pays PyTorch's one-time imports."""
    from fsdp_lab.meta_init import RssSampler, build_on_meta, meta_summary
    from fsdp_lab.models import Llama, llama_70b_config

    config, out, models = llama_70b_config(), {}, []
    for build in ("first", "second"):
        with RssSampler() as rss:
            model, seconds = build_on_meta(lambda: Llama(config))
        out[build] = {"seconds": seconds, "rss_growth_bytes": rss.growth_bytes}
        models.append(model)  # kept alive: the second build cannot reuse the first's memory
    parameters = meta_summary(models[0])["parameters"]
    return {**out, "parameters": parameters, "fp32_bytes": 4 * parameters}


def child_real(gib: float) -> dict[str, Any]:
    """An ordinary build of `gib` GiB of fp32 parameters in this (fresh) process."""
    from fsdp_lab.meta_init import RssSampler
    from fsdp_lab.models import Llama, llama_config_of_bytes, llama_param_count

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


def run_child(kind: str, gib: float) -> dict[str, Any]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", kind, "--real-gib", str(gib)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        raise RuntimeError(f"child {kind} failed:\n{proc.stdout}{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def throughput(elements: int, threads: int) -> dict[str, float]:
    """Elements per second at `threads` torch threads: DeterministicInit per kind, and
    PyTorch's own sequential generator on the same tensor."""
    from fsdp_lab.meta_init import DeterministicInit

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="meta builds, one process each")
    parser.add_argument(
        "--real-gib", type=float, default=1.5, help="ordinary build for contrast (0: skip)"
    )
    parser.add_argument("--init-elements", type=int, default=1 << 22)
    parser.add_argument("--json", action="store_true", help="print one JSON object only")
    parser.add_argument("--child", choices=["meta", "real"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child_meta() if args.child == "meta" else child_real(args.real_gib)))
        return
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")

    load_start = os.getloadavg()
    runs = [run_child("meta", 0) for _ in range(args.repeats)]
    real = run_child("real", args.real_gib) if args.real_gib > 0 else None
    threads = sorted({1, torch.get_num_threads()})
    speed = {str(t): throughput(args.init_elements, t) for t in threads}
    meta: dict[str, Any] = {
        "parameters": runs[0]["parameters"],
        "fp32_bytes": runs[0]["fp32_bytes"],
    }
    for build in ("first", "second"):
        seconds = [r[build]["seconds"] for r in runs]
        growth = [r[build]["rss_growth_bytes"] for r in runs]
        meta[build] = {
            "median_seconds": statistics.median(seconds),
            "median_rss_growth_bytes": statistics.median(growth),
            "seconds_per_repeat": seconds,
            "rss_growth_bytes_per_repeat": growth,
        }
    first = meta["first"]
    result = {
        "machine": {
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "load_average_start": list(load_start),
            "load_average_end": list(os.getloadavg()),
        },
        "llama_70b_on_meta": meta,
        "meets_targets": {  # judged on the first build: what a fresh training job pays
            "seconds_below_2": first["median_seconds"] < TARGET_SECONDS,
            "rss_growth_below_200MB": first["median_rss_growth_bytes"] < TARGET_BYTES,
        },
        "ordinary_build": real,
        "init_elements": args.init_elements,
        "init_elements_per_second": speed,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print_text(result, args.repeats, load_start)


def _load(values: Any) -> str:
    return ", ".join(f"{x:.1f}" for x in values)


def print_text(result: dict[str, Any], repeats: int, load_start: Any) -> None:
    m, meta, real = result["machine"], result["llama_70b_on_meta"], result["ordinary_build"]
    print(f"machine: {m['cores']} cores, torch {m['torch']} ({m['torch_threads']} threads)")
    print(f"load average (1, 5, 15 min) at the start: {_load(load_start)}")
    print(
        f"\nLlama-3-70B shape on meta: {meta['parameters']:,} parameters, "
        f"{meta['fp32_bytes'] / 1e9:.1f} GB in fp32, none of it allocated"
    )
    print(f"{repeats} fresh processes, two builds in each:\n")
    print("| build | time (s), median | per process | RSS growth (MB), median | per process |")
    print("|---|---|---|---|---|")
    for build in ("first", "second"):
        b = meta[build]
        print(
            f"| {build} | {b['median_seconds']:.3f} "
            f"| {', '.join(f'{x:.3f}' for x in b['seconds_per_repeat'])} "
            f"| {b['median_rss_growth_bytes'] / MB:.1f} "
            f"| {', '.join(f'{x / MB:.1f}' for x in b['rss_growth_bytes_per_repeat'])} |"
        )
    ok = result["meets_targets"]
    print(
        f"\ntargets (first build): < 2 s: {'yes' if ok['seconds_below_2'] else 'no'}, "
        f"< 200 MB: {'yes' if ok['rss_growth_below_200MB'] else 'no'}"
    )
    print(FIRST_BUILD_NOTE)
    if real:
        print(
            f"ordinary build for contrast: {real['parameters']:,} parameters "
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
