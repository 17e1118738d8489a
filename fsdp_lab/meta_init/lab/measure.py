"""Lab 04, measured: Llama-3-70B on meta in a fresh process (``python -m
fsdp_lab.meta_init.lab.measure --build-70b``), then on the ranks the host-memory picture, the
ties, the two ways of making the ranks agree, and (`parent_init`) a model whose init lives on
its root. Resident memory from `RssSampler`, tensor bytes from `MemoryTracker`, bytes moved from
`comm.CommLog`. Tensors stay here: rank parameters are compared bitwise with `one_process`'s
references, and `analysis.py` gets the names that differ.

Every meta build here is `meta_device()`: ``torch.device("meta")`` with init fills skipped on meta
(the same model). A plain meta build's first ``normal_`` imports torch._dynamo into each rank
process, a one-time cost that is neither the model's nor the mechanism's (section 1 measures it).
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

from fsdp_lab import comm, reference
from fsdp_lab.cluster import AttachedCluster, Cluster, borrow, device, rank, rank_threads
from fsdp_lab.meta_init.counter_init import DeterministicInit, build_on_meta, meta_summary
from fsdp_lab.meta_init.lab import one_process, parent_init
from fsdp_lab.meta_init.lab.config import APPROACHES, CONTROL, MODEL_MB, MODES, MetaInitConfig, MiB
from fsdp_lab.meta_init.meta_device import meta_device
from fsdp_lab.models import Llama, LlamaConfig, lab_llama, lab_units, llama_70b_config, llama_bytes
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.ties import record_ties, verify_weight_tying
from fsdp_lab.sharding.wrap import build_plan, unit_sizes
from fsdp_lab.trace import MemoryTracker, RssSampler
from fsdp_lab.trace.rss import release_free_memory, thin_samples

# -- 1. shapes without storage: Llama-3-70B, in a fresh process --------------------------------


def build_70b_report() -> dict[str, Any]:
    """In this process: Llama-3-70B's shape built on meta twice, timed, resident memory sampled.

    `build_on_meta` skips init fills on meta, so neither build imports torch._dynamo (a plain
    ``torch.device("meta")`` build's first ``normal_`` would). The first build still pays what a
    process pays once (first calls, a full garbage collection); the second is the model's own:
    module and Parameter objects, no storage. The lab's figures are the first's.
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
    root = str(Path(__file__).resolve().parents[3])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "fsdp_lab.meta_init.lab.measure", "--build-70b"]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# -- 2. and 3. the host-memory picture and the peak per rank -------------------------------------


def materialise_worker(llama: dict[str, Any], mode: str, seed: int) -> dict[str, Any]:
    """On every rank: build the Llama (`mode`), shard it; resident memory and tensor bytes."""
    config = LlamaConfig(**llama)
    release_free_memory()
    torch.manual_seed(seed)  # the ordinary build: the same values on every rank
    with rank_threads(), RssSampler(interval_s=0.01) as rss, MemoryTracker(device()) as mem:
        start = time.perf_counter()
        if mode == "ordinary":  # every rank builds the whole model in host memory
            model = Llama(config).to(device())
        else:
            with meta_device():
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
    """Refuse, before any rank builds anything, a model the ordinary build cannot fit here
    (`preflight` for the CLI; `measure_materialisation` again, with the cluster's size)."""
    need = (n + 1) * model_mb * MiB  # each rank: the whole model, then its shards beside it
    free = psutil.virtual_memory().available
    if need > 0.8 * free:
        fits = max(MODEL_MB[0], int(0.8 * free / (n + 1) / MiB))
        raise ValueError(
            f"model_mb={model_mb} on {n} ranks: the ordinary build needs about "
            f"{need / 2**30:.1f} GiB of host memory, {free / 2**30:.1f} GiB is available. "
            f"Fix: model_mb={fits} or fewer ranks"
        )


def preflight(config: MetaInitConfig) -> None:
    """What `fsdp-lab meta-init` checks before starting any rank: the host memory it needs."""
    check_host_memory(config.model_mb, config.world_size)


def measure_materialisation(
    model_mb: int, seed: int, cluster: Cluster | AttachedCluster
) -> dict[str, Any]:
    """The three `MODES` on `lab_llama(model_mb)`, every rank measured; the model's sizes."""
    check_host_memory(model_mb, cluster.world_size)
    config = lab_llama(model_mb)
    small = asdict(lab_llama(MODEL_MB[0]))
    for mode in MODES:  # first calls pay one-time costs (lazy imports, dispatch caches)
        cluster.run(materialise_worker, small, mode, seed)
    runs = {mode: cluster.run(materialise_worker, asdict(config), mode, seed) for mode in MODES}
    with meta_device():
        meta = Llama(config)
    units = unit_sizes(build_plan(meta, lab_units(config)), meta)  # name -> elements
    sizes = llama_bytes(config)
    return {
        "model": asdict(config),
        "model_mb": model_mb,
        "full_model_bytes": sizes["parameter_bytes"],
        "buffer_bytes": sizes["buffer_bytes"],
        "units": len(units),
        "largest_unit_bytes": 4 * max(units.values()),
        "runs": runs,
    }


# -- 4. is the materialised model right? Ties, buffers, ranks that agree ---------------------------


def tie_worker(seed: int) -> dict[str, Any]:
    """On every rank: a tied Llama through `shard` both ways; then one untied by `to_empty`."""
    config = LlamaConfig(tie_embeddings=True)
    out: dict[str, Any] = {}
    inits = {"param_init_fn": {}, "shard_init": {"shard_init": DeterministicInit(seed)}}
    for path, init in inits.items():
        with meta_device():
            model = Llama(config)
        tied_on_meta = model.output.weight is model.tok_embeddings.weight
        shard(model, units=lab_units(config), device=device(), **init)
        full = reference.full_parameters(model)
        out[path] = {
            "tied_on_meta": tied_on_meta,
            "problems_after_shard": verify_weight_tying(model),
            "output_equals_embedding": torch.equal(
                full["output.weight"], full["tok_embeddings.weight"]
            ),
        }
    with meta_device():
        model = Llama(config)
    ties = record_ties(model)
    model.to_empty(device=device())  # no retie: each owner gets its own new Parameter
    out["to_empty"] = {
        "tied_after_to_empty": model.output.weight is model.tok_embeddings.weight,
        "problems": verify_weight_tying(model, ties),
    }
    try:
        shard(model, units=lab_units(config))
        out["to_empty"] |= {"shard_refused": False, "shard_error": None}
    except ValueError as exc:
        out["to_empty"] |= {"shard_refused": True, "shard_error": str(exc)}
    return out


def agree_worker(llama: dict[str, Any], approach: str, seed: int) -> dict[str, Any]:
    """Shard a meta-built Llama with `approach`; time it, count its bytes, gather the result.

    Every rank seeds torch's generator differently first: only the mechanism can make them
    agree. Rank 0 also returns the full parameters and buffers (to compare with one process).
    """
    config = LlamaConfig(**llama)
    with meta_device():
        model = Llama(config)
    torch.manual_seed(seed + 1000 * rank())  # a different stream on every rank
    kwargs: dict[str, Any] = {
        "sync_module_states": {"sync_module_states": True},
        "deterministic": {"shard_init": DeterministicInit(seed)},
    }.get(approach, {})  # the control: ordinary init per unit, nothing to make the ranks agree
    comm.all_reduce(torch.zeros(1, device=device()))  # line the ranks up: one start for all
    with rank_threads(), comm.CommLog() as log:
        start = time.perf_counter()
        shard(model, units=lab_units(config), **kwargs)
        seconds = time.perf_counter() - start
    params = reference.full_parameters(model)  # all-gathers: every rank's shard goes in
    buffers = {k: b.detach().cpu().clone() for k, b in model.named_buffers()}
    first = rank() == 0
    return {
        "stats": {
            "time_s": seconds,
            "bytes_moved": sum(log.bytes_by_op().values()),
            "bytes_by_op": log.bytes_by_op(),
            "comm_time_s": sum(r.end - r.start for r in log.records),  # inside the collectives
        },
        "params": params if first else None,
        "buffers": buffers if first else None,
    }


def measure_size(
    model_mb: int, seed: int, cluster: Cluster | AttachedCluster, control: bool = False
) -> dict[str, Any]:
    """Both `APPROACHES` (and the `CONTROL`) on `lab_llama(model_mb)`, rank 0's result compared
    bitwise with one process: one row of the agreement table, before analysis."""
    config = lab_llama(model_mb)
    on = cluster.placement.device  # references where the ranks computed
    buffers = one_process.ordinary_buffers(config, on)
    runs = {}
    for approach in (*APPROACHES, CONTROL) if control else APPROACHES:
        ranks = cluster.run(agree_worker, asdict(config), approach, seed)
        expected = one_process.reference_parameters(config, approach, seed, on)
        runs[approach] = {
            "parameter_names": len(expected),
            "per_rank": [r["stats"] for r in ranks],
            "mismatched_parameters": one_process.mismatches(ranks[0]["params"], expected),
            "mismatched_buffers": one_process.mismatches(ranks[0]["buffers"], buffers),
        }
    return {"model_mb": model_mb, "model": asdict(config), **llama_bytes(config), "runs": runs}


def measure(
    config: MetaInitConfig, cluster: Cluster | AttachedCluster | None = None
) -> dict[str, Any]:
    """70B on meta (fresh process), then on the ranks: the host-memory picture, ties, agreement
    (the control at the smallest size), parent init; `cluster` is reused if given (its size
    wins)."""
    seventy = measure_70b() if config.measure_70b else None
    with borrow(cluster, config.world_size, config.backend) as ranks:
        n, seed = ranks.world_size, config.seed
        return {
            "world_size": n,
            "backend": ranks.backend,
            "seventy_b": seventy,
            "materialise": measure_materialisation(config.model_mb, seed, ranks),
            "ties": ranks.run(tie_worker, seed),
            "agreement": [
                measure_size(mb, seed, ranks, control=i == 0)
                for i, mb in enumerate(config.sizes_mb)
            ],
            # One process: the shard pattern of N ranks (even splits of its 512 x 256 weight).
            "kaiming_on_a_shard": one_process.kaiming_on_a_shard_differs(
                world_size=n if n in (2, 4) else 4
            ),
            "parent_init": parent_init.measure_parent_init(seed, ranks),
        }


if __name__ == "__main__":  # python -m fsdp_lab.meta_init.lab.measure --build-70b
    import argparse

    parser = argparse.ArgumentParser(description=build_70b_report.__doc__)
    parser.add_argument("--build-70b", action="store_true", required=True)
    parser.parse_args()
    print(json.dumps(build_70b_report()))
