"""The counter-based init against PyTorch's own meta-device paths: the same values, bitwise,
through our `shard(meta, shard_init=...)`, through FSDP1 (`param_init_fn` on a meta model) and
through FSDP2 (`fully_shard` on meta, `to_empty`, each rank filling its DTensor shard by its
global offset) — and equal to a single process filling the unsharded model."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab import reference
from fsdp_lab.meta_init.counter_init import DeterministicInit
from fsdp_lab.models import LlamaBlock, llama
from fsdp_lab.sharding import shard

SEED = 20261121
SIZES = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, seq_len=16)


def _meta_llama() -> nn.Module:
    with torch.device("meta"):
        return llama(**SIZES)


def _single_process() -> dict[str, torch.Tensor]:
    model = llama(**SIZES)
    DeterministicInit(SEED).init_module_(model)
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def _ours() -> dict[str, torch.Tensor]:
    model = shard(_meta_llama(), units={LlamaBlock}, shard_init=DeterministicInit(SEED))
    return reference.full_parameters(model)


def _fsdp1() -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    model = _meta_llama()
    names = {id(m): n for n, m in model.named_modules()}
    init = DeterministicInit(SEED)

    def param_init_fn(module: nn.Module) -> None:
        # FSDP1 hands over a module whose subtree may still be on meta: materialise and fill
        # every meta tensor below it, each under its name in the whole model.
        for sub in module.modules():
            if any(t.is_meta for t in [*sub.parameters(False), *sub.buffers(False)]):
                sub.to_empty(device="cpu", recurse=False)
                for pname, p in sub.named_parameters(recurse=False):
                    full = f"{names[id(sub)]}.{pname}" if names[id(sub)] else pname
                    with torch.no_grad():
                        p.copy_(init.values(full, tuple(p.shape), 0, p.numel()).view(p.shape))
                if hasattr(sub, "reset_parameters") and not list(sub.parameters(False)):
                    sub.reset_parameters()  # buffers only (the rotary cache)

    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy({LlamaBlock}),
        param_init_fn=param_init_fn,
        device_id=torch.device("cpu"),
    )
    wrapped.vocab_size = model.vocab_size
    return reference.full_parameters(wrapped)


def _fsdp2() -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    model = _meta_llama()
    mesh = init_device_mesh("cpu", (fsdp_lab.world_size(),))
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    init = DeterministicInit(SEED)
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local()
            _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
            # FSDP2 shards dim 0: this rank's rows are one contiguous range of the flattened
            # parameter, starting at its first row's offset.
            start = offset[0] * (p[0].numel() if p.dim() > 1 else 1)
            local.view(-1).copy_(init.values(name, tuple(p.shape), start, start + local.numel()))
    return reference.full_parameters(model)


@pytest.mark.parametrize("n", [2, 3])
def test_counter_init_is_bitwise_the_same_through_ours_fsdp1_and_fsdp2(cluster_of, n):
    expected = _single_process()
    cluster = cluster_of(n)
    for system, fn in (("ours", _ours), ("fsdp1", _fsdp1), ("fsdp2", _fsdp2)):
        for r, params in enumerate(cluster.run(fn)):
            assert set(params) == set(expected), system
            for k, v in expected.items():
                assert torch.equal(params[k], v), (system, k, r)
    # The reference is not trivially constant: the uniform and normal rules really drew.
    assert expected["layers.0.attention.wq.weight"].std() > 0
    assert expected["tok_embeddings.weight"].std() > 0.5
