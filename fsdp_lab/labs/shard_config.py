"""Lab 01 — FSDP / ZeRO from scratch, trained on real ranks, checked and measured.

Its config and command-line options, torch-free so that ``fsdp-lab --help`` stays fast;
`fsdp_lab.labs.shard` runs it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_lab.choices import SHARDING_STRATEGIES


@dataclass(frozen=True)
class ShardConfig:
    """Args:
    world_size: ranks.
    strategy: "none" (DDP), "optimizer" (ZeRO-1), "grad_op" (ZeRO-2), "full" (ZeRO-3).
    steps: training steps.
    prefetch: overlap the next unit's all-gather with the current unit's compute.
    model: "module:factory" returning a token model (default: TinyGPT with a tied head).
    optimizer: "adam" (16 B/param of model state, DESIGN.md's formulas) or "sgd" (momentum).
    lr: learning rate.
    global_batch: sequences per step over all ranks (must divide by world_size).
    compare_fsdp2: also train PyTorch's fully_shard on the same model and data (and, beside
        the sharded optimizer, PyTorch's DDP + ZeroRedundancyOptimizer).
    sharded_optimizer: with strategy="optimizer", also train ZeRO-1 as an optimizer — DDP
        (``shard(strategy="none")``) + `fsdp_lab.ShardedOptimizer` — and measure it beside.
    backend: "auto", "gloo" or "nccl".
    """

    world_size: int = 2
    strategy: str = "full"
    steps: int = 5
    prefetch: bool = True
    model: str = "fsdp_lab.models:tiny_gpt"
    optimizer: str = "adam"
    lr: float = 1e-3
    global_batch: int = 12
    compare_fsdp2: bool = True
    sharded_optimizer: bool = True
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.strategy not in SHARDING_STRATEGIES:
            raise ValueError(
                f"strategy={self.strategy!r} is not one of {sorted(SHARDING_STRATEGIES)}"
            )
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer={self.optimizer!r} is not 'adam' or 'sgd'")
        if isinstance(self.steps, bool) or not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps={self.steps!r}: expected an int >= 1")
        if ":" not in self.model:
            raise ValueError(
                f"model={self.model!r}: expected 'module:factory'. "
                "Fix: e.g. --model fsdp_lab.models:tiny_gpt"
            )
        ws, batch = self.world_size, self.global_batch
        # Checked here, before any rank starts, as well as in run() (torchrun's world wins there).
        if isinstance(ws, int) and ws >= 1 and batch % ws:
            fits = [n for n in range(1, batch + 1) if batch % n == 0]
            raise ValueError(
                f"global_batch={batch} does not divide over world_size={ws} ranks: allowed "
                f"world sizes {fits}. Fix: --world-size {max(n for n in fits if n <= ws)}"
            )


def add_arguments(parser: Any) -> None:
    parser.add_argument("--strategy", choices=sorted(SHARDING_STRATEGIES), default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--no-prefetch", dest="prefetch", action="store_false", default=None)
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default=None)
    parser.add_argument(
        "--no-sharded-optimizer",
        dest="sharded_optimizer",
        action="store_false",
        default=None,
        help="with --strategy optimizer: skip DDP + ShardedOptimizer (ZeRO-1 as an optimizer)",
    )


def config_from_args(args: Any) -> dict[str, Any]:
    keys = ("strategy", "steps", "prefetch", "optimizer", "sharded_optimizer")
    return {k: getattr(args, k) for k in keys if getattr(args, k, None) is not None}
