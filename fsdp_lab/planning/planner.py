"""`plan()`: will this run fit, what will it send, how long will a step take — at any scale.

A plan is made from the model itself, built on the meta device: its wrap units (the repeated
blocks and the root) and their sizes padded as `shard()` pads them, so the bytes per
collective are `theory`'s formulas on the very layout the mechanism would use. Per-rank memory
by category comes from `theory.rank_memory` and `theory.llama_activation_bytes`, the step time
from the network model (`netsim.comm_seconds`) and a compute roofline — a model, and every
assumption it makes is in the plan's ``assumptions``.

``verify="fake"`` then *runs* the plan: one rank of the real world under PyTorch's fake
process group and FakeTensorMode (`fake_ranks`), our `shard()` at full size, measured by the
lab's memory tracker and comm ledger. The plan's ``verified`` holds that measurement and the
relative difference of each quantity.

    fsdp_lab.plan("llama3-70b", gpus=64, strategy="zero3", seq=8192, verify="fake")
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_lab import netsim, theory
from fsdp_lab.planning import models
from fsdp_lab.planning.assumptions import assumptions
from fsdp_lab.planning.gpus import GPU, GPUS
from fsdp_lab.planning.models import parameter_count
from fsdp_lab.theory import MIXED_ADAM

# Names people use for the strategies, and the lab's own (`shard(strategy=...)`).
STRATEGIES = {
    "ddp": "none",
    "zero1": "optimizer",
    "zero2": "grad_op",
    "zero3": "full",
    "hsdp": "hybrid",
    "hsdp-zero2": "hybrid_zero2",
}
LAB_NAMES = {lab: name for name, lab in STRATEGIES.items()}
PRECISIONS = {"bf16-mixed": 2, "fp32": 4}  # bytes per element the units compute and gather in
CHECKPOINTS = ("none", "selective-op", "selective", "blocks")  # least recomputation first
# A plan's settings as `plan()` takes them (mesh apart: a tuple in, a list in the JSON).
SETTINGS = ("model", "gpus", "gpus_per_node", "gpu", "strategy", "precision", "checkpoint", "seq",
            "micro_batch", "grad_accumulation", "mfu")  # fmt: skip
RESERVE = 0.10  # of a GPU's memory: the CUDA context, the allocator's fragmentation, NCCL
FAKE_RUN_TIME_LIMIT_S = 900  # 405B on 512 fake ranks: about five minutes on 2 cores
MAX_GPUS = 1 << 20  # beyond any cluster built: a typo, said as one
MAX_ACCUMULATION = 1 << 16  # micro-batches per step: beyond, a typo
# a shape whose only use is to name the activation formula's terms (all 0 for a factory)
SHAPE_ONLY = dict(dim=1, ffn_dim=1, n_heads=1, kv_dim=1, n_layers=1, vocab_size=1)


def plan(
    model: str = "llama3-8b",
    gpus: int = 8,
    gpus_per_node: int = 8,
    gpu: str | GPU = "h100",
    strategy: str = "zero3",
    mesh: tuple[int, int] | None = None,
    precision: str = "bf16-mixed",
    checkpoint: str = "none",
    seq: int = 2048,
    micro_batch: int = 1,
    verify: str | None = None,
    grad_accumulation: int = 1,
    mfu: float | None = None,
) -> dict[str, Any]:
    """Per-rank memory by category against the GPU, bytes per rank per step by collective and
    by link, a modelled step time, whether it fits and the cheapest change that makes it fit.

    Args:
        model: a preset ("llama3-8b", "llama3-70b", "llama3-405b", each with a "-twin") or
            ``module:factory``.
        gpus, gpus_per_node: the cluster (``gpus`` a multiple of ``gpus_per_node`` when larger).
        gpu: one of `GPUS`, or a `GPU` of your own (`measured_gpu` measures this machine).
        strategy: "ddp", "zero1", "zero2", "zero3", "hsdp", "hsdp-zero2" (or the lab's names).
        mesh: (replicas, shard group) for HSDP; default (gpus / gpus_per_node, gpus_per_node).
        precision: "bf16-mixed" (bf16 compute and gathers, fp32 shards, reduction, Adam) or
            "fp32".
        checkpoint: "none", "selective-op" (per operator, as torchtitan's default: attention's
            and every other matmul's outputs kept, the rest recomputed), "selective" (every
            second block recomputed, torchtitan's layer option 2) or "blocks" (every block).
        seq, micro_batch: tokens per sequence, sequences per GPU per forward.
        verify: None, or "fake" to run the plan on a fake rank (`fake_ranks`) and compare.
        grad_accumulation: forwards and backwards per optimizer step (gradients summed).
        mfu: the share of the GPU's peak FLOPS a step reaches, in (0, 1]; default the
            GPU's own `efficiency` (0.5) — measure yours and set it.
    """
    setup = _checked(
        model, gpus, gpus_per_node, gpu, strategy, mesh, precision, checkpoint, seq, micro_batch,
        verify, grad_accumulation, mfu,
    )  # fmt: skip
    layout = model_layout(model, seq, setup["shard_ranks"])
    result = predict(setup, layout)
    if not result["fits"]:
        result["changes_that_fit"] = changes_that_fit(setup)
        result["to_fit"] = (
            result["changes_that_fit"][0]["change"] if result["changes_that_fit"] else None
        )
        one = predict({**setup, "micro_batch": 1}, layout)["per_rank_bytes"]["activations"]
        result["activations_one_sequence"] = one
        if not result["changes_that_fit"]:  # the least any change reaches: said, with its parts
            most = min(setup["gpus"] * 128, MAX_GPUS)
            least = {**setup, "micro_batch": 1, "checkpoint": "blocks", "lab_strategy": "full",
                     "strategy": "zero3", "mesh": None, "gpus": most, "shard_ranks": most}  # fmt: skip
            result["least_per_rank_bytes"] = predict(least, model_layout(model, seq, most))[
                "per_rank_bytes"
            ] | {"gpus": most}
    if verify == "fake":
        from fsdp_lab.planning.fake_ranks import run_in_subprocess
        from fsdp_lab.planning.verify import compare, fake_run

        if layout["vocab_size"] is None:  # the fake rank trains it on token ids below it
            raise ValueError(
                f"--verify fake trains {model!r} on token ids, and it says no vocabulary (no "
                "vocab_size, no config.vocab_size). Fix: set self.vocab_size in its __init__ "
                "(the number of token ids its embedding takes)"
            )
        try:
            measured = run_in_subprocess(fake_run(result), timeout_s=FAKE_RUN_TIME_LIMIT_S)
        except RuntimeError as exc:  # the model's own code failed, hung or exited: said so
            first, *rest = str(exc).splitlines()
            raise ValueError(
                f"--verify fake: {first} {rest[-1] if rest else ''}. Fix: run the model's "
                "forward and backward once on a small input to see where it fails"
            ) from None
        result["verified"] = compare(result, measured)
    return result


def _checked(
    model: str,
    gpus: int,
    gpus_per_node: int,
    gpu: str,
    strategy: str,
    mesh: tuple[int, int] | None,
    precision: str,
    checkpoint: str,
    seq: int,
    micro_batch: int,
    verify: str | None,
    grad_accumulation: int,
    mfu: float | None,
) -> dict[str, Any]:
    """The arguments checked and resolved; a ValueError naming the value and the fix."""
    if isinstance(model, int | float) and not isinstance(model, bool):
        model = repr(model)  # plan(7.5e9): a parameter count, as the command line takes it
    if not isinstance(model, str) or not model.strip():
        raise ValueError(
            f"model={model!r}: expected a preset name (e.g. 'llama3-70b'), 'module:factory' or "
            "a parameter count (e.g. 7.5e9)"
        )
    for name, value in (
        ("gpus", gpus),
        ("gpus_per_node", gpus_per_node),
        ("seq", seq),
        ("micro_batch", micro_batch),
        ("grad_accumulation", grad_accumulation),
        *(("mesh", size) for size in (mesh or ())),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an int >= 1")
        if name == "grad_accumulation" and value > MAX_ACCUMULATION:
            raise ValueError(f"grad_accumulation={value}: expected at most {MAX_ACCUMULATION:,}")
        if name.startswith("gpus") and value > MAX_GPUS:
            raise ValueError(
                f"{name}={value}: expected at most {MAX_GPUS:,} (more than any cluster)"
            )
    if gpus > gpus_per_node and gpus % gpus_per_node:
        raise ValueError(
            f"gpus={gpus} is not a whole number of nodes of {gpus_per_node}. Fix: gpus="
            f"{gpus // gpus_per_node * gpus_per_node or gpus_per_node} or "
            f"{-(-gpus // gpus_per_node) * gpus_per_node}"
        )
    if not isinstance(gpu, GPU) and gpu not in GPUS:
        raise ValueError(f"gpu={gpu!r} is not known: expected one of {sorted(GPUS)}")
    spec = gpu if isinstance(gpu, GPU) else GPUS[gpu]
    if mfu is not None:
        if isinstance(mfu, bool) or not isinstance(mfu, int | float) or not 0.01 <= mfu <= 1:
            raise ValueError(
                f"mfu={mfu!r}: expected the share of peak FLOPS a step reaches, from 0.01 to 1. "
                "Fix: mfu=0.4 (--mfu 0.4; published runs: 0.38-0.57 on H100, 0.58-0.74 on A100)"
            )
        spec = dataclasses.replace(spec, efficiency=float(mfu))
    lab = STRATEGIES.get(strategy, strategy if strategy in LAB_NAMES else None)
    if lab is None:
        raise ValueError(f"strategy={strategy!r}: expected one of {sorted(STRATEGIES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r}: expected one of {sorted(PRECISIONS)}")
    if checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint={checkpoint!r}: expected one of {list(CHECKPOINTS)}")
    if verify not in (None, "fake"):
        raise ValueError(f"verify={verify!r}: expected None or 'fake'")
    hybrid = lab.startswith("hybrid")
    if mesh is not None and not hybrid:
        raise ValueError(
            f"mesh={mesh!r} is for HSDP only (strategy {strategy!r} shards over every GPU). "
            "Fix: strategy='hsdp', or leave mesh out"
        )
    if hybrid:
        mesh = tuple(mesh) if mesh else (max(1, gpus // gpus_per_node), min(gpus, gpus_per_node))
        if len(mesh) != 2 or mesh[0] * mesh[1] != gpus:
            raise ValueError(
                f"mesh={mesh!r}: replicas x shard group must be gpus={gpus}. Fix: mesh="
                f"({max(1, gpus // gpus_per_node)}, {min(gpus, gpus_per_node)})"
            )
    return {
        "model": model,
        "gpus": gpus,
        "gpus_per_node": gpus_per_node,
        "gpu": gpu.name if isinstance(gpu, GPU) else gpu,
        "strategy": LAB_NAMES[lab],
        "lab_strategy": lab,
        "mesh": mesh,
        "precision": precision,
        "checkpoint": checkpoint,
        "seq": seq,
        "micro_batch": micro_batch,
        "grad_accumulation": grad_accumulation,
        "mfu": spec.efficiency,
        "gpu_spec": spec,
        "shard_ranks": mesh[1] if hybrid else gpus,
    }


def model_layout(model: str, seq: int, shard_ranks: int) -> dict[str, Any]:
    """The model's units as `shard()` would cut and pad them over `shard_ranks`, its parameter
    tensors, and the shape the activation formula needs (built on meta: no memory)."""
    units, (tensors, largest_tensor), shape, vocab = models.built_units(model, seq)
    return {
        "units": [
            {
                "name": name,
                "numel": numel,
                "padded_numel": -(-numel // shard_ranks) * shard_ranks,
                "reshard_after_forward": i > 0,  # the root (first) stays gathered
            }
            for i, (name, numel) in enumerate(units)
        ],
        "param_tensors": tensors,
        "largest_tensor": largest_tensor,  # numel: what Adam's temporaries are the size of
        "shape": dict(shape) if shape else None,
        "vocab_size": vocab,
        "parameters": sum(numel for _, numel in units),
    }


def predict(setup: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """The plan's numbers for `setup` on `layout` (no run)."""
    gpu = setup["gpu_spec"]
    c = PRECISIONS[setup["precision"]]
    tokens = setup["seq"] * setup["micro_batch"]
    if layout["shape"] is not None:
        acts = theory.llama_activation_bytes(layout["shape"], tokens, setup["checkpoint"], c)
    else:  # no formula for this model's activations: --verify fake measures them
        acts = dict.fromkeys(theory.llama_activation_bytes(SHAPE_ONLY, 1), 0.0)
    moments = theory.rank_memory(
        setup["lab_strategy"],
        layout["units"],
        setup["shard_ranks"],
        c,
        layout["param_tensors"],
        acts,
        accumulating=setup["grad_accumulation"] > 1,
        largest_tensor=layout["largest_tensor"],
    )
    peak_moment = max(moments, key=lambda m: sum(moments[m].values()))
    memory: dict[str, float | None] = dict(moments[peak_moment])
    memory["total"] = sum(moments[peak_moment].values())
    if layout["shape"] is None:
        memory["activations"] = None  # not counted: said in the assumptions
    usable = gpu.memory_gib * 2**30 * (1 - RESERVE)
    comm = comm_bytes(setup, layout)
    timing = step_time(setup, layout, comm, gpu)
    return {
        **{k: setup[k] for k in SETTINGS},
        "shard_strategy": setup["lab_strategy"],  # the name `shard(strategy=...)` takes
        "mesh": list(setup["mesh"]) if setup["mesh"] else None,
        "nodes": max(1, setup["gpus"] // setup["gpus_per_node"]),
        "parameters": layout["parameters"],
        "per_rank_bytes": memory,
        "peak_moment": peak_moment,
        "per_rank_bytes_by_moment": moments,  # the peak is the largest of these
        "gpu_memory_bytes": gpu.memory_gib * 2**30,
        "usable_bytes": usable,
        # What PyTorch's caching allocator reserves (``max_memory_reserved``, what published
        # runs print) beside what is allocated: the peak and the cached block of the loss's
        # fp32 logits, a size nothing else reuses — a calibration on two published runs
        # (benchmarks/published_runs.py, TT12), not a measurement.
        "reserved_bytes": memory["total"] + acts["loss_grad"] / 2,
        "fits": memory["total"] <= usable,
        "to_fit": None,
        "comm_bytes_per_rank": comm,
        "step_time_s": timing["step_s"],
        "step_time_parts": timing,
        "assumptions": assumptions(setup, gpu, layout, RESERVE),
        # ZeRO's own accounting (Rajbhandari et al. 2020, Table 1: fp16 parameters and
        # gradients, fp32 Adam moments and master weights) for this Ψ (as typed, for a
        # count) over every GPU.
        "zero_paper_bytes": {
            theory.ZERO_NAMES[k]: v
            for k, v in theory.zero_table(
                parameter_count(setup["model"]) or layout["parameters"], setup["gpus"], MIXED_ADAM
            ).items()
            if k in theory.STRATEGIES
        },
    }


def comm_bytes(setup: dict[str, Any], layout: dict[str, Any]) -> dict[str, Any]:
    """Bytes per rank per step: by collective, by group ("shard", "replicate") and by link.
    Gathers move compute-dtype elements, reductions fp32 (`theory.sharding_step` per dtype)."""
    c = PRECISIONS[setup["precision"]]
    lab, mesh = setup["lab_strategy"], setup["mesh"]

    def at(element_size: int) -> dict[str, dict[str, float]]:
        units = [{**u, "element_size": element_size} for u in layout["units"]]
        if mesh:
            inner = theory.hybrid_step(lab, units, tuple(mesh))["comm_bytes"]
            return {"shard": inner["shard"], "replicate": inner["replicate"]}
        return {"shard": theory.sharding_step(lab, units, setup["gpus"])["comm_bytes"]}

    gathers, reductions = at(c), at(4)
    by_group = {
        group: {
            op: (gathers if op == "all_gather_into_tensor" else reductions)[group][op]
            for op in reductions[group]
        }
        for group in reductions
    }
    times = setup["grad_accumulation"]  # every forward and backward gathers and reduces again
    by_group = {group: {op: b * times for op, b in ops.items()} for group, ops in by_group.items()}
    by_collective: dict[str, float] = {}
    for ops in by_group.values():
        for op, b in ops.items():
            by_collective[op] = by_collective.get(op, 0.0) + b
    r, s = mesh or (1, setup["gpus"])
    rank0_groups = {"shard": range(s), "replicate": range(0, r * s, s)}  # rank 0's, in ring order
    by_link = netsim.bytes_by_link(
        ((rank0_groups[group], sum(ops.values())) for group, ops in by_group.items()),
        setup["gpus_per_node"],
    )
    return {"by_collective": by_collective, "by_group": by_group, "by_link": by_link}


def step_time(
    setup: dict[str, Any], layout: dict[str, Any], comm: dict[str, Any], gpu: GPU
) -> dict[str, float]:
    """Compute at the GPU's `efficiency` of its bf16 peak (6Ψ FLOPs per token, 2Ψ more for
    what is recomputed, plus causal attention's 6·L·s·D), communication from
    `netsim.comm_seconds` on this GPU's links; communication hidden behind compute as far as it
    lasts. Per optimizer step: every micro-batch of gradient accumulation counted."""
    tokens = setup["seq"] * setup["micro_batch"] * setup["grad_accumulation"]
    shape = layout["shape"]
    # of the forward: selective-op recomputes 3 of 7 matmuls, about 0.4 of a block's FLOPs
    recomputed = {"none": 0, "selective-op": 0.4, "selective": 0.5, "blocks": 1}[
        setup["checkpoint"]
    ]
    per_token = (6 + 2 * recomputed) * layout["parameters"]  # a recomputed forward: 2 more
    if shape is not None:
        per_token += 6 * shape["n_layers"] * setup["seq"] * shape["dim"]
    compute_s = per_token * tokens / (gpu.bf16_tflops * 1e12 * gpu.efficiency)
    network = netsim.Network(
        gpus_per_node=setup["gpus_per_node"],
        intra_bandwidth=gpu.intra_gbytes_s * 1e9,
        inter_bandwidth=gpu.nic_gbit_s * netsim.GBIT,
        nics_per_node=setup["gpus_per_node"],
    )
    r, s = setup["mesh"] or (1, setup["gpus"])
    rings = len(layout["units"]) * setup["grad_accumulation"]  # each unit's, every backward
    comm_s = netsim.comm_seconds(comm["by_group"], (r, s), network, rings)
    return {"compute_s": compute_s, "comm_s": comm_s, "step_s": max(compute_s, comm_s)}


def changes_that_fit(setup: dict[str, Any], most: int = 5) -> list[dict[str, Any]]:
    """Every combination of another checkpointing, a higher ZeRO stage (HSDP -> ZeRO-3), a smaller
    micro-batch and more GPUs (up to 128x) after which the plan fits, cheapest first by the
    planner's own cost — GPU-seconds per thousand tokens a step trains — then by headroom;
    at most `most`, each with its words, its cost and its peak."""
    order = ["none", "optimizer", "grad_op", "full"]
    lab = setup["lab_strategy"]
    strategies: list[tuple[str, dict[str, Any]]] = [("", {})]
    if lab in order[:-1]:
        strategies += [
            (
                f"strategy='{LAB_NAMES[s]}'",
                {"lab_strategy": s, "strategy": LAB_NAMES[s]},
            )
            for s in order[order.index(lab) + 1 :]
        ]
    if lab.startswith("hybrid"):
        strategies.append(
            (
                "strategy='zero3', mesh=None",  # a mesh is HSDP's only: the change drops it
                {"lab_strategy": "full", "strategy": "zero3", "mesh": None},
            )  # fmt: skip
        )
    checkpoints = [("", {})] + [
        (f"checkpoint='{other}'", {"checkpoint": other})
        for other in CHECKPOINTS
        if other != setup["checkpoint"]
    ]
    batches = [("", {})]
    b = setup["micro_batch"]
    while b > 1:
        b //= 2
        batches.append((f"micro_batch={b}", {"micro_batch": b}))
    fits = []
    for words_c, c in checkpoints:
        for words_s, st in strategies:
            for words_b, mb in batches:
                for doublings in range(8):
                    trial = {**setup, **c, **st, **mb}
                    more = setup["gpus"] * 2**doublings
                    if more > MAX_GPUS:
                        break
                    trial["gpus"] = more
                    if trial["mesh"]:
                        trial["mesh"] = (more // trial["mesh"][1], trial["mesh"][1])
                    trial["shard_ranks"] = trial["mesh"][1] if trial["mesh"] else more
                    words = [w for w in (words_c, words_s, words_b) if w]
                    words += [f"gpus={more}"] if doublings else []
                    if not words:
                        continue
                    planned = predict(trial, model_layout(trial["model"], trial["seq"],
                                                          trial["shard_ranks"]))  # fmt: skip
                    if planned["fits"]:
                        tokens = trial["seq"] * trial["micro_batch"] * trial["grad_accumulation"]
                        fits.append({
                            "change": ", ".join(words),
                            "gpu_s_per_1k_tokens": planned["step_time_s"] * 1e3 / tokens,
                            "peak_bytes": planned["per_rank_bytes"]["total"],
                            "headroom_bytes": planned["usable_bytes"]
                            - planned["per_rank_bytes"]["total"],
                        })  # fmt: skip
                        break  # more GPUs than the fewest that fit only cost more
    fits.sort(key=lambda f: (round(f["gpu_s_per_1k_tokens"], 9), -f["headroom_bytes"]))
    return fits[:most]
