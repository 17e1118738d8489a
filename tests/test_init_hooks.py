"""Init code that lives on parent modules, through `shard` on a meta model (issue 12, item 5).

- `param_init_fn` is called on every module, parents included, children first: a GPT-2-style
  block that rescales its residual projection, and a root whose `init_weights()` re-initialises
  everything, give bitwise what an ordinary build gives.
- torchtitan's pattern: shard on meta (`param_init_fn="empty"`), then the model's own
  `init_weights()` on the sharded model under `full_init` — bitwise the single-process init,
  then trained next to single process and `fully_shard`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from parity_models import TITAN_INIT_SEED, TTBlock, TTTransformer, titan_single_process

import fsdp_lab
from fsdp_lab import reference
from fsdp_lab.models import Block, TinyGPT, tiny_gpt
from fsdp_lab.sharding import full_init, shard
from fsdp_lab.sharding.materialize import materialize, reset_parameters

# -- a GPT-2-style block: the depth-scaled init lives on the block, not on the Linear ----------


class GPT2Block(nn.Module):
    def __init__(self, dim: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.n_layers = n_layers
        self.c_fc = nn.Linear(dim, 4 * dim)
        self.c_proj = nn.Linear(4 * dim, dim)
        self.reset_parameters()

    def reset_parameters(self) -> None:  # what GPT-2 does in `_init_weights` for c_proj
        nn.init.normal_(self.c_proj.weight, std=0.02 / math.sqrt(2 * self.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c_proj(F.gelu(self.c_fc(x)))


class GPT2ish(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, n_layers: int = 2) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.wte = nn.Embedding(vocab, dim)
        self.h = nn.ModuleList(GPT2Block(dim, n_layers) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _meta(factory):
    with torch.device("meta"):
        return factory()


def _ordinary(factory, seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return dict(factory().named_parameters(remove_duplicate=False))


def _tiny_gpt_init(module: nn.Module) -> None:
    """Each module's reset_parameters(), and TinyGPT's own init_weights() on the root."""
    reset_parameters(module)
    if isinstance(module, TinyGPT):
        module.init_weights()


def _sharded_from_meta(factory, units, init_fn) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = shard(_meta(factory), units=units, param_init_fn=init_fn)
    return reference.full_parameters(model)


@pytest.mark.parametrize(
    ("factory", "units", "init_fn"),
    [(GPT2ish, {GPT2Block}, None), (tiny_gpt, {Block}, _tiny_gpt_init)],
    ids=["gpt2-block-init", "tinygpt-root-init_weights"],
)
@pytest.mark.parametrize("n", [2, 3])
def test_init_on_parent_modules_reproduces_an_ordinary_build(
    cluster_of, n, factory, units, init_fn
):
    """On main `param_init_fn` reached only modules that own parameters: the block's scaled
    c_proj (and the root's init_weights) never ran, and `materialize()` had the same gap."""
    expected = _ordinary(factory)
    torch.manual_seed(0)
    reference_model = materialize(_meta(factory), units, param_init_fn=init_fn or reset_parameters)
    for name, p in reference_model.named_parameters(remove_duplicate=False):
        assert torch.equal(p, expected[name]), f"materialize(): {name}"
    for params in cluster_of(n).run(_sharded_from_meta, factory, units, init_fn):
        assert list(params) == list(expected)
        for name, value in expected.items():
            assert torch.equal(params[name], value), name
    # Control: without the parent's init the values differ (the test can fail).
    plain = materialize(_meta(factory), units, param_init_fn=_own_params_only)
    assert any(not torch.equal(p, expected[k]) for k, p in plain.named_parameters())


def _own_params_only(module: nn.Module) -> None:
    """main's rule: only modules owning a parameter directly were initialised."""
    if list(module.parameters(recurse=False)) or list(module.buffers(recurse=False)):
        module.reset_parameters()


def test_default_init_error_names_the_module_and_its_own_parameters_only():
    class NoReset(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))
            self.fc = nn.Linear(4, 4)

    with pytest.raises(
        ValueError, match=r"NoReset has no reset_parameters\(\) to initialise \['scale'\]"
    ):
        shard(_meta(NoReset), units=["fc"])


# -- torchtitan's pattern: shard on meta, then the model's own init_weights() ------------------


def _titan(how: str, steps: int) -> dict[str, torch.Tensor]:
    if how == "fsdp2":
        model = reference.wrap(titan_single_process(), "fully_shard", (TTBlock,))
    else:
        model = shard(_meta(TTTransformer), units={TTBlock}, param_init_fn="empty")
        assert all(torch.isnan(p).all() for p in model.parameters())  # loudly uninitialised
        torch.manual_seed(TITAN_INIT_SEED)
        with full_init(model):
            model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reference.train_steps(model, opt, steps, rank=fsdp_lab.rank(), world=fsdp_lab.world_size())
    return reference.full_parameters(model)


@pytest.mark.parametrize("n", [2, 3])
def test_torchtitan_init_weights_on_the_sharded_model(cluster_of, n):
    """On main `init_weights()` after sharding failed (`'Embedding' object has no attribute
    'weight'`): the parameters were gone from the modules."""
    initial = dict(titan_single_process().named_parameters())
    trained = titan_single_process()
    opt = torch.optim.AdamW(trained.parameters(), lr=1e-2, weight_decay=0.1)
    reference.train_steps(trained, opt, 3)
    for params in cluster_of(n).run(_titan, "ours", 0):
        for name, value in initial.items():
            assert torch.equal(params[name], value), name  # bitwise the one-process init
    for how in ("ours", "fsdp2"):
        for params in cluster_of(n).run(_titan, how, 3):
            for name, p in trained.named_parameters():
                torch.testing.assert_close(params[name], p, rtol=1e-5, atol=1e-6, msg=how)


def _indexing_init() -> str:
    model = shard(_meta(TTTransformer), units={TTBlock}, param_init_fn="empty")
    try:
        with full_init(model):
            model.output.weight[0].zero_()  # indexes: rows of a slice mean nothing
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_full_init_refuses_init_that_needs_the_whole_values(cluster_of):
    for message in cluster_of(2).run(_indexing_init):
        assert "'output.weight'" in message and "param_init_fn=" in message
