"""Lab 04 — meta-device init: build any size without memory, materialise only each rank's shard.

1. Shapes without storage: Llama-3-70B's shape built under ``torch.device("meta")``, timed and
   with the resident memory of a fresh process sampled (`meta_init.build_on_meta`,
   `RssSampler`); parameters and bytes by dtype, and the per-rank cost of each strategy.
2. The host-memory picture, measured on the ranks: resident memory over time while a Llama of
   `model_mb` is built the ordinary way and then sharded (every rank holds the whole model: a
   spike), and while the same model is built on meta and `shard` materialises it unit by unit
   (flat: model/N plus one unit) or fills each shard directly (`shard_init`).
3. During those `shard` calls the `MemoryTracker` measures each rank's peak tensor bytes.
4. Is the materialised model right? (`fsdp_lab.labs.meta_init_agree`): a tied Llama keeps its
   tie through `shard`, which refuses one that `to_empty` untied; buffers equal an ordinary
   build's; the ranks agree — `sync_module_states` against `DeterministicInit`, bitwise against
   one process, time and bytes as the model grows, and why `kaiming_uniform_` on a shard cannot
   do it (`meta_init.kaiming_on_a_shard_differs`).

This is torchtitan's order (meta build -> parallelise -> `to_empty` -> `init_weights`) and
FSDP1's ``param_init_fn`` / ``sync_module_states``, each step measured.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil
import torch

from fsdp_lab import theory
from fsdp_lab.cluster import AttachedCluster, Cluster, device, rank_threads
from fsdp_lab.labs import LabResult
from fsdp_lab.labs.meta_init_agree import (
    MiB,
    agreement_figure,
    agreement_notes,
    agreement_table,
    measure_agreement,
    tie_worker,
)
from fsdp_lab.labs.meta_init_config import MODEL_MB, MetaInitConfig
from fsdp_lab.meta_init import (
    DeterministicInit,
    build_on_meta,
    kaiming_on_a_shard_differs,
    meta_summary,
)
from fsdp_lab.models import Llama, LlamaConfig, lab_llama, lab_units, llama_70b_config, llama_bytes
from fsdp_lab.sharding import shard
from fsdp_lab.trace import MemoryTracker, RssSampler
from fsdp_lab.trace.rss import release_free_memory, thin_samples
from fsdp_lab.wrap import build_plan, unit_sizes

MODES = {  # how the host-memory picture builds and shards the model
    "ordinary": "ordinary build, then shard",
    "meta_param_init_fn": "meta build, shard: module by module (param_init_fn)",
    "meta_shard_init": "meta build, shard(shard_init=DeterministicInit)",
}
RSS_INTERVAL_S = 0.01
WORLD_SIZES_70B = (1, 8, 64, 512)


# -- 1. shapes without storage: Llama-3-70B ------------------------------------------------------


def build_70b_report() -> dict[str, Any]:
    """In this process: Llama-3-70B's shape built on meta twice, timed, resident memory sampled.

    `build_on_meta` skips init fills on meta, so neither build imports torch._dynamo (a plain
    ``torch.device("meta")`` build's first ``normal_`` would). The first build still pays what
    a process pays once (first calls, a full garbage collection over what ``import torch``
    left); the second is the model's own: module and Parameter objects, no storage. Both are
    reported; the lab's figures are the first's.
    """
    builds, models = {}, []
    for build in ("first", "second"):
        with RssSampler() as rss:
            model, seconds = build_on_meta(lambda: Llama(llama_70b_config()))
        builds[build] = {
            "build_time_s": seconds,
            "rss_start_bytes": rss.start_bytes,
            "rss_growth_bytes": rss.growth_bytes,
        }
        models.append(model)  # kept: the second build cannot reuse the first one's memory
    return {
        **builds["first"],
        "second_build": builds["second"],
        "summary": meta_summary(models[0]),
        "config": asdict(llama_70b_config()),
    }


def measure_70b() -> dict[str, Any]:
    """`build_70b_report` in a fresh Python process, so that the resident memory it reports is
    the build's own, not what this process has allocated (and its allocator kept) before."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fsdp_lab.labs.meta_init", "--build-70b"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    params = report["summary"]["parameters"]
    report["per_rank_model_state_bytes"] = {
        str(n): theory.zero_table(params, n) for n in WORLD_SIZES_70B
    }
    return report


# -- 2. and 3. the host-memory picture and the peak per rank --------------------------------------


def materialise_worker(llama: dict[str, Any], mode: str, seed: int) -> dict[str, Any]:
    """On every rank: build the Llama (`mode`), shard it; resident memory and tensor bytes."""
    config = LlamaConfig(**llama)
    release_free_memory()
    torch.manual_seed(seed)  # the ordinary build: the same values on every rank
    with rank_threads(), RssSampler(RSS_INTERVAL_S) as rss, MemoryTracker(device()) as mem:
        start = time.perf_counter()
        if mode == "ordinary":  # every rank builds the whole model in host memory
            model = Llama(config).to(device())
        else:
            with torch.device("meta"):
                model = Llama(config)
        rss.mark("built")
        mem.mark("built")
        init = {"shard_init": DeterministicInit(seed)} if mode == "meta_shard_init" else {}
        shard(model, units=lab_units(config), device=device(), **init)
        seconds = time.perf_counter() - start
        rss.mark("sharded")
        mem.mark("sharded")
        after = mem.current_bytes
        release_free_memory()  # freed pages back to the OS: what stays, the rank really holds
        trimmed = rss.mark("trimmed")
    del model  # its shards go with it (a sharded model holds no hook on itself)
    return {
        "rss": {
            **thin_samples(rss.samples, rss.start_bytes),
            "marks": [{"t": t, "label": s, "bytes": b - rss.start_bytes} for t, s, b in rss.marks],
        },
        "rss_start_bytes": rss.start_bytes,
        "rss_growth_bytes": rss.growth_bytes,
        "rss_after_trim_bytes": trimmed - rss.start_bytes,
        "peak_bytes": mem.peak_bytes,
        "after_bytes": after,
        "time_s": seconds,
    }


def check_host_memory(model_mb: int, n: int) -> None:
    """Refuse, before any rank builds anything, a model the ordinary build cannot fit here."""
    need = (n + 1) * model_mb * MiB  # each rank: the whole model, then its shards beside it
    free = psutil.virtual_memory().available
    if need > 0.8 * free:
        fits = max(MODEL_MB[0], int(0.8 * free / (n + 1) / MiB))
        raise ValueError(
            f"model_mb={model_mb} on {n} ranks: the ordinary build needs about "
            f"{need / 2**30:.1f} GiB of host memory, {free / 2**30:.1f} GiB is available. "
            f"Fix: --model-mb {fits} or fewer ranks"
        )


def preflight(config: MetaInitConfig) -> None:
    """What `fsdp-lab meta-init` checks before starting any rank: the host memory it needs."""
    check_host_memory(config.model_mb, config.world_size)


def measure_materialisation(
    model_mb: int, seed: int, cluster: Cluster | AttachedCluster
) -> dict[str, Any]:
    """The three modes on `lab_llama(model_mb)`, each rank measured; theory beside them."""
    n = cluster.world_size
    check_host_memory(model_mb, n)
    config = lab_llama(model_mb)
    small = asdict(lab_llama(MODEL_MB[0]))
    for mode in MODES:  # first calls pay one-time costs (lazy imports, dispatch caches)
        cluster.run(materialise_worker, small, mode, seed)
    runs = {mode: cluster.run(materialise_worker, asdict(config), mode, seed) for mode in MODES}
    with torch.device("meta"):
        meta = Llama(config)
    units = unit_sizes(build_plan(meta, lab_units(config)), meta)
    sizes = llama_bytes(config)
    full, largest = sizes["parameter_bytes"], 4 * max(units.values())
    return {
        "model": asdict(config),
        "model_mb": model_mb,
        "full_model_bytes": full,
        "buffer_bytes": sizes["buffer_bytes"],
        "units": len(units),
        "largest_unit_bytes": largest,
        "theory_peak_bytes": {  # tensor bytes per rank (buffers and padding aside)
            "ordinary": full + full / n,  # the model, and its shards copied out of it
            "meta_param_init_fn": full / n + largest,  # the shards, and one unit whole
            "meta_shard_init": full / n,  # the shards only
        },
        "modes": {
            mode: {
                "how": MODES[mode],
                **{k: [r[k] for r in ranks] for k in ("peak_bytes", "after_bytes", "time_s")},
                "rss_growth_bytes": [r["rss_growth_bytes"] for r in ranks],
                "rss_after_trim_bytes": [r["rss_after_trim_bytes"] for r in ranks],
                "rss_start_bytes": [r["rss_start_bytes"] for r in ranks],
                "rss": [r["rss"] for r in ranks],
            }
            for mode, ranks in runs.items()
        },
    }


# -- the lab ------------------------------------------------------------------------------------


def run(
    config: MetaInitConfig = MetaInitConfig(), cluster: Cluster | AttachedCluster | None = None
) -> LabResult:
    """70B on meta (fresh process), the host-memory picture, ties, agreement; see the docstring."""
    seventy = measure_70b() if config.measure_70b else None
    owned = cluster is None
    cluster = cluster or Cluster(config.world_size, config.backend)
    try:
        n = cluster.world_size
        memory = measure_materialisation(config.model_mb, config.seed, cluster)
        ties = cluster.run(tie_worker, config.seed)
        agreement = measure_agreement(config.sizes_mb, config.seed, cluster)
        backend = cluster.backend
    finally:
        if owned:
            cluster.close()
    return LabResult(
        "meta-init",
        {
            "config": {**asdict(config), "world_size": n},
            "world_size": n,
            "backend": backend,
            "build_time_s_70b": seventy["build_time_s"] if seventy else None,
            "rss_growth_bytes_70b": seventy["rss_growth_bytes"] if seventy else None,
            "parameters_70b": seventy["summary"]["parameters"] if seventy else None,
            "seventy_b": seventy,
            "peak_bytes_per_rank": memory["modes"]["meta_param_init_fn"]["peak_bytes"],
            "full_model_bytes": memory["full_model_bytes"],
            "materialise": memory,
            "ties": ties,
            "approaches": agreement["approaches"],
            "agreement": agreement,
            "kaiming_on_a_shard": kaiming_on_a_shard_differs(world_size=n if n in (2, 4) else 4),
        },
    )


# -- pictures and words -------------------------------------------------------------------------


def rss_figure(memory: dict[str, Any]) -> Any:
    """Resident memory over time per rank, the three modes, their tensor-byte theory beside."""
    from fsdp_lab.plots import plot_rss_over_time

    theory = memory["theory_peak_bytes"]
    return plot_rss_over_time(
        {MODES[mode]: run["rss"] for mode, run in memory["modes"].items()},
        title=f"resident memory while building and sharding a {memory['model_mb']} MiB Llama",
        theory={
            "whole model + its shards": theory["ordinary"],
            "shards + largest unit": theory["meta_param_init_fn"],
            "shards (model / N)": theory["meta_shard_init"],
        },
    )


def memory_table(memory: dict[str, Any]) -> str:
    """Markdown: per mode, rank 0's resident-memory growth, peak tensor bytes, theory, time."""
    from fsdp_lab.sizes import format_bytes as fb

    lines = [
        f"{memory['model_mb']} MiB Llama ({fb(memory['full_model_bytes'])} of parameters, "
        f"{memory['units']} units, largest {fb(memory['largest_unit_bytes'])}), rank 0:",
        "",
        "| mode | resident memory: peak growth | after trim | tensor bytes: peak (theory) "
        "| after shard | time |",
        "|---|---|---|---|---|---|",
    ]
    for mode, r in memory["modes"].items():
        lines.append(
            f"| {r['how']} | {fb(r['rss_growth_bytes'][0])} | {fb(r['rss_after_trim_bytes'][0])} "
            f"| {fb(r['peak_bytes'][0])} "
            f"({fb(memory['theory_peak_bytes'][mode])}) | {fb(r['after_bytes'][0])} "
            f"| {r['time_s'][0]:.2f} s |"
        )
    return "\n".join(lines)


def figures(result: LabResult) -> dict[str, Any]:
    """The host-memory picture and the agreement plot (time and bytes against model size)."""
    return {
        "rss_over_time": rss_figure(result["materialise"]),
        "agreement": agreement_figure(result["agreement"]["rows"]),
    }


def summary(result: LabResult) -> str:
    from fsdp_lab.sizes import format_bytes as fb

    lines = [f"meta-device init on {result['world_size']} ranks ({result['backend']})", ""]
    if result["seventy_b"]:
        s = result["seventy_b"]
        lines.append(
            f"- Llama-3-70B on meta (fresh process): {s['summary']['parameters'] / 1e9:.2f}e9 "
            f"parameters ({fb(s['summary']['parameter_bytes'])} fp32) built in "
            f"{s['build_time_s']:.2f} s, resident memory +{fb(s['rss_growth_bytes'])}"
        )
    t = result["ties"][0]
    lines += [
        "",
        "### Host memory",
        "",
        memory_table(result["materialise"]),
        "",
        f"- tied Llama: problems after shard {t['param_init_fn']['problems_after_shard']} "
        f"(param_init_fn), {t['shard_init']['problems_after_shard']} (shard_init); "
        f"after to_empty without retie, shard refused: {t['to_empty']['shard_refused']}",
        "",
        "### Making the ranks agree",
        "",
        agreement_table(result["agreement"]["rows"]),
        "",
        agreement_notes(result["agreement"]["control"], result["kaiming_on_a_shard"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":  # python -m fsdp_lab.labs.meta_init --build-70b: a fresh process
    import argparse

    parser = argparse.ArgumentParser(description=build_70b_report.__doc__)
    parser.add_argument("--build-70b", action="store_true", required=True)
    parser.parse_args()
    print(json.dumps(build_70b_report()))
