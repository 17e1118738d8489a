"""What a plan takes for granted, in words: the GPU, the compute, the links, the memory model,
and, for a bare parameter count, the shape it was planned as (printed under every plan)."""

from __future__ import annotations

from typing import Any

from fsdp_lab.planning.models import count_config, parameter_count


def assumptions(
    setup: dict[str, Any], gpu: Any, layout: dict[str, Any], reserve: float
) -> list[str]:
    """What the plan takes for granted, in words."""
    if layout["shape"] is not None:
        acts = (
            "activations from the lab's Llama, read off its forward (theory.llama_activation_bytes)"
        )
    else:
        acts = "activations NOT counted (no formula for this model: --verify fake measures them)"
    stated, count = [], parameter_count(setup["model"])
    if count is not None:
        c = count_config(count)
        stated = [
            f"model: the parameter count {setup['model']} planned as a Llama-3-like decoder "
            f"of {layout['parameters'] / 1e9:.3g}B parameters — dim {c.dim}, {c.n_layers} "
            f"blocks of {c.n_heads} heads ({c.n_kv_heads} K/V), SwiGLU {c.ffn_dim}, vocabulary "
            f"{c.vocab_size} (after Llama-3-8B's proportions; models.count_config)"
        ]
    return stated + [
        f"GPU: {gpu.name}, {gpu.memory_gib:.3g} GiB, {reserve:.0%} kept back (on a GPU: the "
        "CUDA context, allocator fragmentation, NCCL buffers)",
        f"compute: {gpu.bf16_tflops:,.4g} {gpu.flops_kind} TFLOPS at {gpu.efficiency:.0%} utilisation; 6 FLOPs "
        "per parameter per token (+2 for each recomputed block: 8 with every block, 7 with "
        "selective, about 6.8 per-op) + causal attention",
        f"links: {gpu.intra_gbytes_s:.3g} GB/s per GPU inside a node, {gpu.nic_gbit_s:.3g} Gbit/s "
        "per GPU between nodes; ring collectives (alpha-beta, netsim); communication fully "
        "overlapped with compute",
        "memory: fsdp_lab.shard with Adam — fp32 shards, gradients and moments; "
        f"{setup['precision']} compute; {acts}; no tensor or pipeline parallelism",
    ]
