"""Lab 04, part 5, on the ranks: a model whose init lives on its root (TinyGPT's
``init_weights()``), built on meta and sharded the `PARENT_INIT` ways — the course-note recipe
(``reset_parameters()`` only on modules that own a parameter), `shard`'s order (every module,
children first, the root last) and torchtitan's ``init_weights()`` under `full_init` — each
rank's full parameters compared bitwise with `one_process.parent_init_reference`."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_lab import reference
from fsdp_lab.cluster import AttachedCluster, Cluster, device
from fsdp_lab.meta_init.lab import one_process
from fsdp_lab.meta_init.lab.config import PARENT_INIT
from fsdp_lab.meta_init.meta_device import meta_device
from fsdp_lab.models import Block, GPTConfig, TinyGPT
from fsdp_lab.sharding import full_init, shard
from fsdp_lab.sharding.materialize import reset_parameters


def _reset_then_root_init(module: torch.nn.Module) -> None:
    """Each module's own ``reset_parameters()``, and TinyGPT's ``init_weights()`` on the root."""
    reset_parameters(module)
    if isinstance(module, TinyGPT):
        module.init_weights()


def _owners_only(module: torch.nn.Module) -> None:
    """The recipe of course notes: ``reset_parameters()`` only where a module owns a parameter."""
    if list(module.parameters(recurse=False)):
        module.reset_parameters()


def parent_init_worker(how: str, seed: int) -> dict[str, torch.Tensor]:
    """On every rank: TinyGPT (its init on the root) built on meta, sharded one `PARENT_INIT`
    way; its full parameters (all-gathered), to compare with one process."""
    with meta_device():
        model = TinyGPT(GPTConfig())
    torch.manual_seed(seed)
    if how == "torchtitan":  # allocate the shards, then the model's own init_weights() on them
        shard(model, units={Block}, device=device(), param_init_fn="empty")
        torch.manual_seed(seed)
        with full_init(model):
            model.init_weights()
    else:
        init = _reset_then_root_init if how == "param_init_fn" else _owners_only
        shard(model, units={Block}, device=device(), param_init_fn=init)
    return reference.full_parameters(model)


def measure_parent_init(seed: int, cluster: Cluster | AttachedCluster) -> dict[str, Any]:
    """Each `PARENT_INIT` way on every rank, against one process: per rank, the names that differ."""
    on = cluster.placement.device  # the reference where the ranks drew
    out = {}
    for how in PARENT_INIT:
        expected = one_process.parent_init_reference(how, seed, on)
        ranks = cluster.run(parent_init_worker, how, seed)
        out[how] = {
            "parameter_names": len(expected),
            "mismatched_per_rank": [one_process.mismatches(got, expected) for got in ranks],
        }
    return out
