"""Models nobody here wrote, as the parity checks train them: each with its wrap units, its
data, its loss and its optimizer recipe (`parity_runs.py` trains them; `parity.py`
prints the table; the tests import the same builders). They are the benchmark's and the tests', not
the package's: they live here, and the ranks import them by module name because a script's folder
and the tests' `conftest.py` put this folder on the path every rank starts with.

- PyTorch's own FSDP test models, from `torch.testing._internal.common_fsdp` (shipped in the
  torch wheel): `NestedWrappedModule`, `NonUniformReqGradNWM` (everything frozen but
  `module.2.1`; both have a submodule called `module`), `TransformerWithSharedParams` (an
  `nn.Transformer` between an embedding and an output projection that share one weight) —
  wrapped as PyTorch's own tests wrap them.
- `WithUnused`: a layer forward never calls — no gradient, so no weight decay either.
- `TTTransformer`: torchtitan's Llama layout, initialised by its own `init_weights()`.
- `TinyGPT`: the package's teaching model (tied embedding/head).

Every build is seeded: every rank and every system starts from the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.models import Block, synthetic_batch, tiny_gpt
from fsdp_lab.sharding.materialize import materialize

GLOBAL_BATCH = 12  # splits evenly over 1, 2, 3, 4 and 6 ranks
TITAN_INIT_SEED = 3  # the seed init_weights() draws from, on every path


# -- PyTorch's own FSDP test models ------------------------------------------------------------


def _from_common_fsdp(name: str, **kwargs: Any) -> nn.Module:
    """One of `common_fsdp`'s models, unwrapped (NO_FSDP), on CPU (DEVICE_NEVER), seeded
    (`deterministic=True`).

    Imported on use: `common_fsdp` pulls in PyTorch's test harness. The models ask a process
    group for rank() and size() at construction; PyTorch's own `DummyProcessGroup` answers rank 0
    of 1 on every rank, so every rank builds the same model (a real group would only change
    `get_input`'s seed, which the parity runs do not use).
    """
    try:
        from torch.testing._internal import common_fsdp as c
    except ModuleNotFoundError as exc:  # its harness imports expecttest, a test-only package
        raise ModuleNotFoundError(
            f"PyTorch's FSDP test models need {exc.name!r} ({exc}). Fix: pip install -e '.[dev]' "
            "(or pip install expecttest)"
        ) from exc

    return getattr(c, name).init(
        c.DummyProcessGroup(rank=0, size=1),
        c.FSDPInitMode.NO_FSDP,
        c.DEVICEInitMode.DEVICE_NEVER,
        deterministic=True,
        **kwargs,
    )


def nested_wrapped_module() -> nn.Module:
    """PyTorch's `NestedWrappedModule`: Linear layers in nested Sequentials (`module.1.0` is a
    unit inside the unit `module.1`)."""
    return _from_common_fsdp("NestedWrappedModule")


def nonuniform_req_grad() -> nn.Module:
    """PyTorch's `NonUniformReqGradNWM`: everything frozen but `module.2.1`."""
    return _from_common_fsdp("NonUniformReqGradNWM")


def transformer_with_shared_params() -> nn.Module:
    """PyTorch's `TransformerWithSharedParams`, built on CPU, without its BatchNorm.

    `deterministic=True` also puts it in eval mode (dropout off), as PyTorch's tests do. The
    BatchNorm is left out (`add_bn=False`): it normalises over `BatchNorm1d(2)` channels that are
    the *batch* positions of a (T, B=2, C) input, so it only runs with 2 samples per rank and
    its weights would mean different samples on a split batch than on the whole one.
    """
    return _from_common_fsdp("TransformerWithSharedParams", add_bn=False)


NWM_UNITS = ("module.1", "module.1.0", "module.2")  # PyTorch's RECURSIVE wrap of these models


# -- frozen and unused parameters --------------------------------------------------------------


class WithUnused(nn.Module):
    """A layer that forward never calls: it gets no gradient, and must get no weight decay."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.unused = nn.Linear(16, 16)
        self.out = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.inp(x)))


# -- torchtitan's Llama layout: the init lives in init_weights() on the blocks and the root ----


class TTAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.wq, self.wo = nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.wq.weight, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.wo.weight, mean=0.0, std=init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.wo(torch.tanh(self.wq(x)))


class TTBlock(nn.Module):
    def __init__(self, dim: int, layer_id: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = TTAttention(dim)
        self.weight_init_std = 0.02 / (2 * (layer_id + 1)) ** 0.5

    def init_weights(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.init_weights(self.weight_init_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attention(self.attention_norm(x))


class TTTransformer(nn.Module):
    """torchtitan's Llama layout and init: `init_weights()` on the root calls the blocks'."""

    def __init__(self, vocab: int = 64, dim: int = 16, n_layers: int = 3) -> None:
        super().__init__()
        self.vocab_size = vocab
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleDict({str(i): TTBlock(dim, i) for i in range(n_layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    @torch.no_grad()
    def init_weights(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight)
        for layer in self.layers.values():
            layer.init_weights()
        self.norm.reset_parameters()
        cutoff = 3 * self.output.weight.shape[1] ** -0.5
        nn.init.trunc_normal_(self.output.weight, std=0.02, a=-cutoff, b=cutoff)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(idx)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(self.norm(x))


def titan_single_process() -> TTTransformer:
    """torchtitan's pattern in one process: build on meta, allocate, then `init_weights()`."""
    with torch.device("meta"):
        model = TTTransformer()
    materialize(model, {TTBlock}, param_init_fn="empty")
    torch.manual_seed(TITAN_INIT_SEED)
    model.init_weights()
    return model


# -- what a parity run needs to know about each model ------------------------------------------

Batch = tuple[tuple[torch.Tensor, ...], torch.Tensor]  # (the model's inputs, the target)


def _regression_batch(step: int) -> Batch:
    x = torch.rand(GLOBAL_BATCH, 8, generator=torch.Generator().manual_seed(step))
    return (x,), x  # the target is unused: the loss is the mean squared output


def _mean_square(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def _token_batch(vocab: int) -> Callable[[int], Batch]:
    def batch(step: int) -> Batch:
        x, y = synthetic_batch(vocab, GLOBAL_BATCH, 16, step)  # (B, T) each
        return (x,), y

    return batch


def _seq2seq_batch(step: int) -> Batch:
    """TransformerWithSharedParams takes (T, B) token ids: source, target, and labels."""
    g = torch.Generator().manual_seed(step)
    src = torch.randint(0, 23, (6, GLOBAL_BATCH), generator=g)  # (T_src, B)
    tgt = torch.randint(0, 23, (4, GLOBAL_BATCH), generator=g)  # (T_tgt, B)
    labels = torch.randint(0, 23, (4, GLOBAL_BATCH), generator=g)
    return (src, tgt), labels


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    # A mean over this rank's tokens: with equal slices, the mean of the ranks' losses is the
    # single-process loss of the whole batch, so averaged gradients are its gradients.
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


@dataclass(frozen=True)
class ParityModel:
    """One model of the parity table.

    Args:
        build: the model, initialised, the same on every call (seeded).
        units: the wrap units — module names, or module classes (every instance is a unit).
        batch: step -> (inputs, target) of the whole global batch; each rank takes its slice.
        batch_dim: the inputs' batch dimension (1 for PyTorch's seq-first Transformer).
        loss: (output, target) -> the mean loss over this rank's slice.
        optimizer: "sgd" (momentum, weight decay, every parameter) or "adamw" (weight decay on
            weights, none on biases and norm weights: two parameter groups). SGD where it can
            be: Adam is blind to a gradient's scale (a missing 1/N in the average passes), and
            see [Note: Adam and a zero gradient].
        unused_parameters: some parameters get no gradient (DDP needs find_unused_parameters).
        meta_factory: torchtitan's pattern for ours: built on meta from this, sharded with
            param_init_fn="empty", then `with full_init(model): model.init_weights()`.
        what: what the model checks, for the table's legend.
    """

    build: Callable[[], nn.Module]
    units: tuple[str, ...] | tuple[type[nn.Module], ...]
    batch: Callable[[int], Batch]
    loss: Callable[[Any, torch.Tensor], torch.Tensor]
    optimizer: str
    what: str
    batch_dim: int = 0
    unused_parameters: bool = False
    meta_factory: Callable[[], nn.Module] | None = None


# [Note: Adam and a zero gradient]
# An attention key bias has a gradient that is exactly zero in exact arithmetic: it adds
# q·b to every score of a query, and softmax ignores a shift shared by all scores. Computed in
# fp32 it is rounding noise (1e-8 next to 1e-1 for the query and value thirds of
# TransformerWithSharedParams' in_proj_bias; 1e-12 next to 1e-3 in TinyGPT's qkv.bias), and
# Adam divides a gradient by its own running magnitude: noise becomes a step of about lr in a
# random direction. Two correct implementations that sum the batch in a different order (one
# process vs N ranks' partial sums) then drift apart by up to ~lr per step, while every
# distributed system (ours, fully_shard, FSDP1, DDP: the same order) agrees bitwise with the
# others. That measures Adam, not sharding, so models with attention biases train with SGD
# here; `python benchmarks/parity.py --optimizer adamw` shows the effect.


PARITY_MODELS: MappingProxyType[str, ParityModel] = MappingProxyType(
    {
        "NestedWrappedModule": ParityModel(
            nested_wrapped_module,
            NWM_UNITS,
            _regression_batch,
            _mean_square,
            "sgd",
            "PyTorch's; nested units (`module.1.0` inside `module.1`)",
        ),
        "NonUniformReqGradNWM": ParityModel(
            nonuniform_req_grad,
            NWM_UNITS,
            _regression_batch,
            _mean_square,
            "sgd",
            "PyTorch's; frozen parameters (in the optimizer, with weight decay)",
        ),
        "TransformerWithSharedParams": ParityModel(
            transformer_with_shared_params,
            (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer),
            _seq2seq_batch,
            _cross_entropy,
            "sgd",  # attention key biases: see [Note: Adam and a zero gradient]
            "PyTorch's; tied embedding/output, nn.Transformer, batch in dim 1",
            batch_dim=1,
        ),
        "WithUnused": ParityModel(
            WithUnused,
            ("out",),  # the root unit holds `inp` (used) and `unused` together
            _regression_batch,
            _mean_square,
            "adamw",
            "a layer forward never calls, in a unit with one it does",
            unused_parameters=True,
        ),
        "TTTransformer": ParityModel(
            titan_single_process,
            (TTBlock,),
            _token_batch(64),
            _cross_entropy,
            "adamw",
            "torchtitan's Llama layout; ours sharded on meta, then its own init_weights()",
            meta_factory=TTTransformer,
        ),
        "tiny_gpt": ParityModel(
            tiny_gpt,
            (Block,),
            _token_batch(64),
            _cross_entropy,
            "sgd",  # attention key biases: see [Note: Adam and a zero gradient]
            "fsdp_lab.models.TinyGPT; tied embedding/head",
        ),
    }
)
