"""Small teaching models: big enough to have the structure of a real one, small enough for a CPU.

    gpt.py     TinyGPT (GPT-2-shaped, head tied to the token embedding), MLPStack, the
               synthetic tokens every lab trains on
    chain.py   Chain: N identical layers, the setting of activation checkpointing
    llama.py   Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU), Llama-3-70B's shape,
               and the meta-init lab's Llama of a given size

All map token ids ``(B, T)`` (values < `vocab_size`) to logits ``(B, T, vocab_size)`` (Chain:
``(B, dim)`` to ``(B, dim)``) and never import `torch.distributed`: parallelism is applied from
outside (torchtitan's rule). ``--model fsdp_lab.models:tiny_gpt`` names a factory here.
"""

from fsdp_lab.models.chain import Chain, ChainLayer
from fsdp_lab.models.gpt import (
    MLP,
    Block,
    CausalSelfAttention,
    GPTConfig,
    MLPBlock,
    MLPStack,
    TinyGPT,
    synthetic_batch,
    tiny_gpt,
)
from fsdp_lab.models.llama import (
    LLAMA3,
    Llama,
    LlamaAttention,
    LlamaBlock,
    LlamaConfig,
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rotary,
    lab_llama,
    lab_units,
    llama,
    llama3_config,
    llama_70b_config,
    llama_bytes,
    llama_config_of_bytes,
    llama_param_count,
    tied_llama,
    twin_config,
)

__all__ = [
    "MLP",
    "Block",
    "CausalSelfAttention",
    "Chain",
    "ChainLayer",
    "GPTConfig",
    "Llama",
    "LlamaAttention",
    "LlamaBlock",
    "LlamaConfig",
    "MLPBlock",
    "MLPStack",
    "RMSNorm",
    "Rotary",
    "SwiGLU",
    "TinyGPT",
    "apply_rotary",
    "lab_llama",
    "lab_units",
    "llama",
    "LLAMA3",
    "llama3_config",
    "llama_70b_config",
    "twin_config",
    "llama_bytes",
    "llama_config_of_bytes",
    "llama_param_count",
    "synthetic_batch",
    "tied_llama",
    "tiny_gpt",
]
