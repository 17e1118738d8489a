"""Published measurements of real FSDP runs, each with its source and exact configuration, for
`bench_plan.py --published` to hold the planner against.

Every row is a run someone else measured on GPUs and printed: tokens per second per GPU, and,
where printed, memory per GPU (torchtitan prints ``torch.cuda.max_memory_reserved``: the
allocator's reserve, not only the tensors alive). A row the planner cannot express says why
(``not_expressible``) and is printed, never dropped.

Sources (read 2026-11-28):

TT24  pytorch/torchtitan, docs/performance.md at 157a12c56 (2024-04-24): FSDP2, 64 A100 80GB
      (8 nodes), bf16 parameters with fp32 reduction, no torch.compile, no float8; train
      configs of the same commit: Llama 3 seq 8192, Llama 2 seq 4096. "selective layer" is
      torchtitan's `selective_ac_option = <int>`: every that-many-th block recomputed; the
      table does not print the int, and 2 (the config's own example) is assumed here.
TT12  pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md (2024-12): Llama 3.1
      8B, H100 96GB HBM2e at a 500 W limit (8 per host, 400 Gb/s per GPU), FSDP, local batch
      2, seq 8192 (llama3_8b.toml), selective activation checkpointing (the config's default:
      per-op).
"""

from __future__ import annotations

from typing import Any


def llama2_13b() -> Any:
    """Llama 2 13B as torchtitan built it (TT24): dim 5120, 40 layers, 40 heads (no GQA),
    SwiGLU 13824, vocabulary 32000 — the lab's Llama at that shape."""
    from fsdp_lab.models import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=32000, dim=5120, n_layers=40, n_heads=40,
                             n_kv_heads=40, ffn_dim=13824, seq_len=4096))  # fmt: skip


def llama2_70b() -> Any:
    """Llama 2 70B (TT24): dim 8192, 80 layers, 64 heads, 8 K/V heads, SwiGLU 28672,
    vocabulary 32000."""
    from fsdp_lab.models import Llama, LlamaConfig

    return Llama(LlamaConfig(vocab_size=32000, dim=8192, n_layers=80, n_heads=64,
                             n_kv_heads=8, ffn_dim=28672, seq_len=4096))  # fmt: skip


SOURCES = {
    "TT24": "pytorch/torchtitan docs/performance.md at 157a12c56 (2024-04): 64 A100 80GB, FSDP2",
    "TT12": "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md (2024-12): H100 "
    "96GB at 500 W, FSDP",
}
A100_64 = {"gpus": 64, "gpus_per_node": 8, "gpu": "a100-80gb", "strategy": "zero3"}
H100_TT = {"gpu": "h100-96gb", "gpus_per_node": 8, "strategy": "zero3", "seq": 8192}

RUNS: list[dict[str, Any]] = [
    {"source": "TT24, Llama 3 table, row 1", "model": "llama3-8b", **A100_64, "seq": 8192,
     "micro_batch": 1, "checkpoint": "selective", "tokens_per_s": 2904, "mfu": 0.568},
    {"source": "TT24, Llama 3 table, row 2", "model": "llama3-8b", **A100_64, "seq": 8192,
     "micro_batch": 1, "checkpoint": "selective-op", "tokens_per_s": 2973, "mfu": 0.582},
    {"source": "TT24, Llama 3 table, row 3", "model": "llama3-70b", **A100_64, "seq": 8192,
     "micro_batch": 1, "checkpoint": "blocks", "tokens_per_s": 331, "mfu": 0.517},
    {"source": "TT24, Llama 2 table, row 1", "model": "published_runs:llama2_13b", **A100_64,
     "seq": 4096, "micro_batch": 2, "checkpoint": "none", "tokens_per_s": 2162, "mfu": 0.611},
    {"source": "TT24, Llama 2 table, row 2", "model": "published_runs:llama2_13b", **A100_64,
     "seq": 4096, "micro_batch": 2, "checkpoint": "selective", "tokens_per_s": 1914,
     "mfu": 0.541},
    {"source": "TT24, Llama 2 table, row 3", "model": "published_runs:llama2_13b", **A100_64,
     "seq": 4096, "micro_batch": 2, "checkpoint": "selective-op", "tokens_per_s": 1904,
     "mfu": 0.538},
    {"source": "TT24, Llama 2 table, row 4", "model": "published_runs:llama2_70b", **A100_64,
     "seq": 4096, "micro_batch": 1, "checkpoint": "selective-op", "tokens_per_s": 355,
     "mfu": 0.508},
    {"source": "TT24, Llama 2 table, row 5", "model": "published_runs:llama2_70b", **A100_64,
     "seq": 4096, "micro_batch": 2, "checkpoint": "blocks", "tokens_per_s": 353, "mfu": 0.505},
    {"source": "TT12, Table 1, FSDP", "model": "llama3-8b", "gpus": 8, **H100_TT,
     "micro_batch": 2, "checkpoint": "selective-op", "tokens_per_s": 5762, "memory_gib": 82.4},
    {"source": "TT12, Table 3, FSDP", "model": "llama3-8b", "gpus": 128, **H100_TT,
     "micro_batch": 2, "checkpoint": "selective-op", "tokens_per_s": 5605, "memory_gib": 67.0},
    {"source": "TT12, Table 1, FSDP + torch.compile + Float8", "model": "llama3-8b", "gpus": 8,
     **H100_TT, "micro_batch": 2, "checkpoint": "selective-op", "tokens_per_s": 8532,
     "memory_gib": 76.8, "not_expressible": "torch.compile and float8 linears: not modelled"},
]  # fmt: skip
