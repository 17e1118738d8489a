"""Lab 04 without ranks: what one process computes — the parameters and buffers the ranks must
reproduce bitwise, and why the ranks cannot simply run PyTorch's init on their shards."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from fsdp_lab.cluster import intra_op_threads
from fsdp_lab.meta_init.counter_init import DeterministicInit
from fsdp_lab.meta_init.meta_device import meta_device
from fsdp_lab.models import GPTConfig, Llama, LlamaConfig, TinyGPT, lab_units
from fsdp_lab.sharding.materialize import materialize
from fsdp_lab.sharding.ties import record_ties, retie


def _fork_rng(device: str) -> Any:
    """Leave the caller's generator as it was (CUDA's too when the references run there)."""
    return torch.random.fork_rng(devices=[0] if device == "cuda" else [])


# The references run in the driver, beside rank processes that sleep in the meantime. One
# intra-op thread: on a shared machine, torch's default (one per core) had OpenMP threads
# spinning against other processes, and the slice initialiser ran many times slower.
ONE_THREAD = 1


def reference_parameters(
    config: LlamaConfig, approach: str, seed: int, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """One process, the same scheme as `approach`: what the ranks must reproduce bitwise.

    `device`: the ranks' device type (torch's init draws from another generator on CUDA).
    """
    with meta_device():
        model = Llama(config)
    with intra_op_threads(ONE_THREAD):
        if approach == "deterministic":
            ties = record_ties(model)
            model.to_empty(device=device)
            retie(model, ties)
            DeterministicInit(seed).init_module_(model)
        else:  # sync_module_states (and the control): rank 0's init, unit by unit, in plan order
            with _fork_rng(device):
                torch.manual_seed(seed)
                materialize(model, lab_units(config), device=device)
    return {k: p.detach().cpu() for k, p in model.named_parameters(remove_duplicate=False)}


def ordinary_buffers(config: LlamaConfig, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The buffers (rotary cache) of a Llama built the ordinary way on `device`."""
    with _fork_rng(device), torch.device(device), intra_op_threads(ONE_THREAD):
        return {k: b.detach().cpu() for k, b in Llama(config).named_buffers()}


def parent_init_reference(how: str, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """TinyGPT as one process initialises it on `device`: an ordinary build from `seed` (its
    constructors' resets, then ``init_weights()`` on the root), or for ``"torchtitan"``
    ``init_weights()`` run again from `seed` on the built model."""
    with _fork_rng(device), torch.device(device), intra_op_threads(ONE_THREAD):
        torch.manual_seed(seed)
        model = TinyGPT(GPTConfig())
        if how == "torchtitan":
            torch.manual_seed(seed)
            model.init_weights()
    return {k: p.detach().cpu() for k, p in model.named_parameters(remove_duplicate=False)}


def mismatches(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """Names whose tensors differ in any bit (or are missing on either side)."""
    names = sorted(set(got) | set(expected))
    return [
        k for k in names if not (k in got and k in expected and torch.equal(got[k], expected[k]))
    ]


def kaiming_on_a_shard_differs(
    shape: tuple[int, int] = (512, 256), world_size: int = 4, seed: int = 0
) -> dict[str, Any]:
    """What goes wrong when each rank runs ``manual_seed(seed); kaiming_uniform_`` on its own
    shard, and that `DeterministicInit`'s slices do equal its full tensor. JSON-able numbers.

    ``kaiming_uniform_`` draws from one sequential stream: element i is the i-th number drawn.
    Row shards: rank r's shard vs rows [r R/N, (r+1) R/N) of the full tensor, and vs its *first*
    rows (the stream restarts on every rank). Column shard: fan_in is shape[1]/N, the bound
    sqrt(N) times wider. The caller's global RNG state is left as it was.
    """
    rows, cols = shape
    if rows % world_size or cols % world_size:
        raise ValueError(f"shape={shape} does not split evenly over world_size={world_size}")
    R = rows // world_size

    def kaiming(*size: int) -> torch.Tensor:  # what each rank would run, from a fresh seed
        torch.manual_seed(seed)
        return nn.init.kaiming_uniform_(torch.empty(size), a=math.sqrt(5))

    def bound(fan_in: int) -> float:  # kaiming_uniform_'s own formula: gain * sqrt(3 / fan_in)
        return nn.init.calculate_gain("leaky_relu", math.sqrt(5)) * math.sqrt(3 / fan_in)

    with _fork_rng("cpu"), intra_op_threads(ONE_THREAD):
        full, shards = kaiming(rows, cols), [kaiming(R, cols) for _ in range(world_size)]
        column_shard = kaiming(rows, cols // world_size)
    pairs = [(s, full[r * R : (r + 1) * R]) for r, s in enumerate(shards)]  # (shard, own rows)

    init, name, numel = DeterministicInit(seed), "layers.0.attention.wq.weight", rows * cols
    per = -(-numel // world_size)  # FSDP's equal shards, the last one padded
    with intra_op_threads(ONE_THREAD):
        slices = [init.values(name, shape, min(r * per, numel), min(r * per + per, numel))
                  for r in range(world_size)]  # fmt: skip
        whole = init.values(name, shape, 0, numel)
    return {
        "shape": list(shape),
        "world_size": world_size,
        "row_shards_max_abs_diff": [(s - o).abs().max().item() for s, o in pairs],
        "row_shards_equal_own_rows": [torch.equal(s, o) for s, o in pairs],
        "row_shards_equal_first_rows": [torch.equal(s, full[:R]) for s in shards],
        "bound_full": bound(cols),
        "bound_column_shard": bound(cols // world_size),
        "max_abs_full": full.abs().max().item(),
        "max_abs_column_shard": column_shard.abs().max().item(),
        "deterministic_slices_equal_full": torch.equal(torch.cat(slices), whole),
        "deterministic_max_abs": whole.abs().max().item(),
    }
