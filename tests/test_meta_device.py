"""meta_device: skipping init fills on meta builds the very model a plain meta build does
(names, shapes, dtypes, strides, requires_grad, ties, buffers, modules, version counters, the
RNG left as it was), materialises to the same values bitwise, keeps PyTorch's errors, and
imports nothing (the plain build imports torch._dynamo: checked in fresh processes)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_lab.meta_init.counter_init import build_on_meta
from fsdp_lab.meta_init.meta_device import SkipInitOnMeta, meta_device
from fsdp_lab.models import Chain, Llama, LlamaBlock, LlamaConfig, MLPStack, TinyGPT, llama
from fsdp_lab.pipeline.model import pipe_gpt
from fsdp_lab.sharding.materialize import materialize

ROOT = Path(__file__).resolve().parents[1]
SMALL = dict(vocab_size=50, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=40, seq_len=8)


class InitZoo(nn.Module):
    """Every nn.init function and the built-in modules' own inits, a frozen parameter, a
    padding index, BatchNorm's buffers, a parameter tied across two modules."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.conv = nn.Conv2d(3, 4, 3)
        self.conv.weight.requires_grad_(False)  # frozen
        self.bn = nn.BatchNorm2d(4)
        self.lstm = nn.LSTM(4, 6)
        self.gru = nn.GRU(4, 5, bias=False)
        self.mha = nn.MultiheadAttention(8, 2)
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.w = nn.Parameter(torch.empty(4, 6, dtype=torch.float64))
        self.conv3 = nn.Conv3d(2, 2, 3, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        init, w = nn.init, self.w
        init.uniform_(w, -1, 1)
        init.normal_(w, 0, 0.1)
        init.constant_(w, 0.5)
        init.ones_(w)
        init.zeros_(w)
        init.trunc_normal_(w, std=0.02)
        init.xavier_uniform_(w)
        init.xavier_normal_(w)
        init.kaiming_uniform_(w, a=0.1)
        init.kaiming_normal_(w)
        init.orthogonal_(w)
        init.sparse_(w, 0.5)
        init.eye_(w)
        init.dirac_(self.conv3.weight)
        w.normal_().uniform_().fill_(2.0).zero_().bernoulli_(0.5).exponential_()
        w.geometric_(0.5).log_normal_().cauchy_().random_(0, 5)
        w.data.normal_()  # through .data: a tensor that does not require grad


def transformer() -> nn.Module:
    return nn.Transformer(
        d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=24
    )


FACTORIES: dict[str, Callable[[], nn.Module]] = {
    "llama": lambda: Llama(LlamaConfig(**SMALL)),
    "llama_tied": lambda: Llama(LlamaConfig(**SMALL, tie_embeddings=True)),
    "tiny_gpt": TinyGPT,  # tied head; init_weights() calls normal_/fill_/zero_ directly
    "mlp_stack": MLPStack,
    "chain": Chain,
    "pipe_gpt": pipe_gpt,
    "transformer": transformer,  # torch.nn.Transformer: xavier_uniform_, MHA's constant_
    "init_zoo": InitZoo,
}


def structure(model: nn.Module) -> dict[str, Any]:
    """Everything a meta model has besides values: what the fast build must reproduce."""
    params = model.named_parameters(remove_duplicate=False)
    buffers = model.named_buffers(remove_duplicate=False)
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    return {
        "parameters": [
            (n, type(p), p.shape, p.dtype, p.stride(), p.requires_grad, p.device, p._version)
            for n, p in params
        ],
        "ties": sorted(names for names in owners.values() if len(names) > 1),
        "buffers": [(n, type(b), b.shape, b.dtype, b.device, b._version) for n, b in buffers],
        "state_dict": list(model.state_dict()),  # persistent buffers included, in order
        "modules": [
            (n, type(m), m.training, _plain_attributes(m))
            for n, m in model.named_modules(remove_duplicate=False)
        ],
    }


def _plain_attributes(module: nn.Module) -> dict[str, Any]:
    return {
        k: v
        for k, v in vars(module).items()
        if not k.startswith("_") and not isinstance(v, (torch.Tensor, nn.Module))
    }


def build(factory: Callable[[], nn.Module], skip_init: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model built on meta from seed 0, and the CPU generator's state afterwards."""
    torch.manual_seed(0)
    with meta_device(skip_init):
        model = factory()
    return model, torch.get_rng_state()


@pytest.mark.parametrize("name", list(FACTORIES))
def test_fast_meta_build_is_structurally_identical_to_a_plain_one(name):
    plain, plain_rng = build(FACTORIES[name], skip_init=False)
    fast, fast_rng = build(FACTORIES[name], skip_init=True)
    assert all(t.is_meta for t in [*fast.parameters(), *fast.buffers()])
    a, b = structure(plain), structure(fast)
    for key in a:
        assert a[key] == b[key], key
    assert torch.equal(plain_rng, fast_rng)  # a meta fill draws nothing: the stream goes on alike


def materialise(model: nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Any model: ``to_empty``, zeros (so that what no init touches compares equal), then every
    module's ``reset_parameters`` / ``_reset_parameters`` in module order, from `seed`."""
    model.to_empty(device="cpu")
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.zero_()
    torch.manual_seed(seed)
    for module in model.modules():
        for method in ("reset_parameters", "_reset_parameters"):
            if hasattr(module, method):
                getattr(module, method)()
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]
    return {n: t.detach().clone() for n, t in named}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_materialising_after_a_fast_build_gives_the_same_values_bitwise(name):
    plain = materialise(build(FACTORIES[name], skip_init=False)[0], seed=7)
    fast = materialise(build(FACTORIES[name], skip_init=True)[0], seed=7)
    assert list(plain) == list(fast)
    for key in plain:
        assert torch.equal(plain[key], fast[key]), key
    assert any(t.count_nonzero() for t in fast.values())  # init did run: not all zeros


@pytest.mark.parametrize("tie", [False, True])
def test_package_materialize_after_build_on_meta_gives_the_same_values(tie):
    # The path the labs and `shard` take: build_on_meta, then materialize() unit by unit.
    config = dict(SMALL, tie_embeddings=tie)
    values = {}
    for skip_init in (False, True):
        meta, _ = build_on_meta(lambda: llama(**config), skip_init=skip_init)
        torch.manual_seed(0)
        materialize(meta, {LlamaBlock})
        assert (meta.output.weight is meta.tok_embeddings.weight) is tie
        values[skip_init] = meta.state_dict()
    assert list(values[False]) == list(values[True])
    for key, plain in values[False].items():
        assert torch.equal(plain, values[True][key]), key


def test_errors_stay_those_of_a_plain_meta_build():
    for skip_init in (False, True):
        with meta_device(skip_init):
            p = nn.Parameter(torch.empty(3, 4))
            # An in-place fill on a leaf that requires grad, outside no_grad: autograd refuses.
            with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
                p.normal_()
            assert p._version == 0
            with pytest.raises(ValueError, match="fewer than 2 dimensions"):
                nn.init.kaiming_uniform_(torch.empty(3))  # nn.init's own check still runs
            with pytest.raises(ValueError, match="2 dimensions"):
                nn.init.eye_(torch.empty(2, 2, 2))


def test_only_meta_tensors_are_skipped_and_the_context_is_undone():
    torch.manual_seed(3)
    expected = torch.empty(5).normal_()
    torch.manual_seed(3)
    with meta_device():
        real = torch.empty(5, device="cpu").normal_()  # a real tensor draws as usual
        filled = torch.ones(4, device="cpu").fill_(2.0)
        assert torch.empty(2).is_meta
    assert torch.equal(real, expected) and torch.equal(filled, torch.full((4,), 2.0))
    assert torch.empty(1).device.type == "cpu"
    with pytest.raises(KeyError), meta_device():
        raise KeyError("boom")
    assert torch.empty(1).device.type == "cpu"  # undone after an exception too
    with SkipInitOnMeta():  # the mode alone: tensors where the caller puts them
        meta = torch.empty(3, device="meta")
        assert meta.normal_() is meta and meta._version == 1


FRESH_PROCESS = """
import json, sys, torch
from fsdp_lab.meta_init.counter_init import build_on_meta
from fsdp_lab.models import Llama, llama_70b_config
before = set(sys.modules)
model, _ = build_on_meta(lambda: Llama(llama_70b_config()), skip_init={skip_init})
imported = sorted(set(sys.modules) - before)
print(json.dumps({{"dynamo": "torch._dynamo" in sys.modules, "imported": len(imported)}}))
"""


def test_a_fast_build_in_a_fresh_process_imports_nothing_a_plain_one_imports_dynamo():
    # Behaviour, not time: the plain build's cost is this import (timed in the benchmark).
    out = {}
    for skip_init in (False, True):
        proc = subprocess.run(
            [sys.executable, "-c", FRESH_PROCESS.format(skip_init=skip_init)],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=240,
            check=True,
        )
        out[skip_init] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out[False]["dynamo"] and out[False]["imported"] > 100
    assert not out[True]["dynamo"] and out[True]["imported"] <= 5, out[True]
