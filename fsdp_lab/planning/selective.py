"""Per-operator selective activation checkpointing, as torchtitan's default runs it: PyTorch's
own (`torch.utils.checkpoint` with `create_selective_checkpoint_contexts`), so the fake rank can
measure what the planner's ``checkpoint="selective-op"`` predicts.

Inside each block, the outputs of attention and of every other matmul (the 1st, 3rd, 5th, ...)
are kept for backward; everything else is recomputed there, as under full checkpointing.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

aten = torch.ops.aten
ATTENTION = {
    aten._scaled_dot_product_flash_attention_for_cpu.default,  # this machine's
    aten._scaled_dot_product_flash_attention.default,  # a GPU's
    aten._scaled_dot_product_efficient_attention.default,
}


class OpSelective(nn.Module):
    """`block` run under selective checkpointing: attention's and every other matmul's outputs
    kept, the rest recomputed in backward."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, *args: Any) -> Any:
        matmuls = {"forward": 0, "recompute": 0}  # counted apart: the recompute counts again

        def policy(ctx: Any, func: Any, *_args: Any, **_kwargs: Any) -> CheckpointPolicy:
            if func == aten.mm.default:
                phase = "recompute" if ctx.is_recompute else "forward"
                matmuls[phase] += 1
                if matmuls[phase] % 2 == 1:
                    return CheckpointPolicy.MUST_SAVE
            elif func in ATTENTION:
                return CheckpointPolicy.MUST_SAVE
            return CheckpointPolicy.PREFER_RECOMPUTE

        contexts = functools.partial(create_selective_checkpoint_contexts, policy)
        return checkpoint(self.block, *args, use_reentrant=False, context_fn=contexts)
