"""`Chain`: N identical residual layers in a row, the textbook setting of activation
checkpointing."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ChainLayer(nn.Module):
    """One link of a layer chain: x + dropout(gelu(W x)). Residual, so deep chains train."""

    def __init__(self, dim: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(F.gelu(self.fc(x)))  # (B, dim)


class Chain(nn.Module):
    """N identical layers in a row: the textbook setting of activation checkpointing.

    `layers[i]` maps (B, dim) -> (B, dim); each stores its input and its GELU input for
    backward, so store-all memory grows linearly in N.
    """

    def __init__(self, n_layers: int = 8, dim: int = 64, dropout: float = 0.0) -> None:
        super().__init__()
        if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 1:
            raise ValueError(f"n_layers={n_layers!r}: expected an int >= 1")
        self.layers = nn.ModuleList(ChainLayer(dim, dropout) for _ in range(n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x
