"""A GPT whose pieces can be removed: the model a pipeline splits into stages.

Pipeline parallelism gives each rank a contiguous slice of the network — stage 0 the
embeddings and the first layers, the last stage the final layers, the norm and the head — and
passes activations between them. torchtitan (`torchtitan/distributed/pipeline_parallel.py`,
``pipeline_module_split``) builds the *whole* model on every rank, on the meta device, and
then deletes what a stage does not own. `PipeGPT` is written so that this works:

- `layers` is an ``nn.ModuleDict`` keyed "0".."L-1", not an ``nn.ModuleList``: deleting layer
  "2" from a dict keeps the others' names ("layers.3.attn.qkv.weight" stays that), so a
  stage's state_dict keys are the full model's keys and checkpoints line up. A ModuleList
  would renumber the survivors.
- `tok_emb`, `pos_emb`, `norm` and `head` may be None; `forward` and `init_weights` skip what
  is absent instead of crashing.
- The head is **untied** from the token embedding. A tie would put one Parameter on stage 0
  (embedding) and on stage S-1 (head): two ranks would each hold a copy and would have to
  all-reduce its two gradient halves every step to stay equal (Megatron-LM's "embedding
  group"). That is a lesson of its own (see `fsdp_lab.sharding.ties`); Llama does not tie either.

Initialisation is where pipelines go wrong (the pp-seed lab, `fsdp_lab.pipeline.rng`):
`init_weights` walks the present modules in one fixed order, `init_order()`,

    tok_emb, pos_emb,
    layers.0.ln1, layers.0.attn.qkv, layers.0.attn.proj, layers.0.ln2, layers.0.mlp.fc,
    layers.0.mlp.proj, layers.1.ln1, ..., layers.{L-1}.mlp.proj,
    norm, head

(only modules that own parameters directly; within a layer, ``named_modules`` order), and
draws every random value from the global torch RNG. So the *reference* init is

    model = PipeGPT(config)              # construction leaves the global RNG untouched
    torch.manual_seed(s); model.init_weights()

and a stage that owns only some modules draws different numbers for them than the full model
would — unless something (a seed checkpoint, RNG replay) makes up for the modules it skipped.

This module never imports ``torch.distributed``: parallelism is applied from outside.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
import torch.nn as nn

from fsdp_lab.models import Block

INIT_STD = 0.02  # GPT-2's N(0, 0.02) for every Linear and Embedding weight


@dataclass(frozen=True)
class PipeGPTConfig:
    """Args:
    vocab_size: tokens in the vocabulary (rows of the embedding, outputs of the head).
    dim: model width (the size of the activation passed between stages, per token).
    n_layers: transformer blocks, the units a pipeline distributes over its stages.
    n_heads: attention heads (must divide `dim`).
    seq_len: longest sequence (rows of the position embedding).
    """

    vocab_size: int = 64
    dim: int = 32
    n_layers: int = 6
    n_heads: int = 4
    seq_len: int = 16

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipeGPTConfig.{name}={value!r}: expected an int >= 1")
        if self.dim % self.n_heads:
            raise ValueError(
                f"PipeGPTConfig: dim={self.dim} is not divisible by n_heads={self.n_heads}: "
                f"allowed n_heads are the divisors of {self.dim}"
            )


def _rng_left_untouched() -> AbstractContextManager[None]:
    """Restore the global RNG after construction (CPU, and the CUDA device if building there).

    ``nn.Linear.__init__`` draws its default init from the global RNG; without this, building
    a model would shift the stream that `init_weights` later reads.
    """
    device = torch.get_default_device()
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.random.fork_rng(devices=[index])
    return torch.random.fork_rng(devices=[])


class PipeGPT(nn.Module):
    """Embedding, ``n_layers`` pre-norm blocks in a ModuleDict, final norm, untied head.

    Any of `tok_emb`, `pos_emb`, `norm`, `head` may be None and `layers` may lack keys (a
    pipeline stage, see `fsdp_lab.pipeline.split.split_model`). Construction does not touch
    the global RNG; call `init_weights()` after seeding (on the meta device: after
    ``to_empty``).
    """

    def __init__(self, config: PipeGPTConfig = PipeGPTConfig()) -> None:
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size  # what fsdp_lab.reference.train_steps reads
        with _rng_left_untouched():
            self.tok_emb: nn.Embedding | None = nn.Embedding(config.vocab_size, config.dim)
            self.pos_emb: nn.Embedding | None = nn.Embedding(config.seq_len, config.dim)
            self.layers = nn.ModuleDict(
                {str(i): Block(config.dim, config.n_heads) for i in range(config.n_layers)}
            )
            self.norm: nn.LayerNorm | None = nn.LayerNorm(config.dim)
            self.head: nn.Linear | None = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) if this model has `tok_emb`, else the activation (B, T, dim).

        Returns logits (B, T, vocab) if it has `head`, else the activation (B, T, dim).
        """
        if self.tok_emb is not None:
            x = self.tok_emb(x)  # (B, T) ids -> (B, T, dim)
        if self.pos_emb is not None:
            x = x + self.pos_emb(torch.arange(x.shape[1], device=x.device))  # (B, T, dim)
        for key in sorted(self.layers.keys(), key=int):  # "10" after "9", not after "1"
            x = self.layers[key](x)  # (B, T, dim)
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)  # (B, T, vocab)
        return x

    def init_modules(self) -> list[tuple[str, nn.Module]]:
        """(name, module) of every present module that owns parameters, in init order."""
        out: list[tuple[str, nn.Module]] = []
        for name in ("tok_emb", "pos_emb"):
            if getattr(self, name) is not None:
                out.append((name, getattr(self, name)))
        for key in sorted(self.layers.keys(), key=int):
            for sub, module in self.layers[key].named_modules(prefix=f"layers.{key}"):
                if any(True for _ in module.parameters(recurse=False)):
                    out.append((sub, module))  # containers (Block, attn, mlp) own none
        for name in ("norm", "head"):
            if getattr(self, name) is not None:
                out.append((name, getattr(self, name)))
        return out

    def init_order(self) -> list[str]:
        """Names of the present modules in the order `init_weights` draws their values."""
        return [name for name, _ in self.init_modules()]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every present module from the global RNG, in `init_order()`."""
        for name, module in self.init_modules():
            init_module(name, module)


@torch.no_grad()
def init_module(name: str, module: nn.Module) -> None:
    """Initialise `module`'s own parameters (not its children's) from the global torch RNG.

    Linear: weight ~ N(0, 0.02), bias 0. Embedding: weight ~ N(0, 0.02). LayerNorm: weight 1,
    bias 0 (draws nothing). On the meta device nothing is drawn or written.
    """
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, 0.0, INIT_STD)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, 0.0, INIT_STD)
    elif isinstance(module, nn.LayerNorm):
        if module.weight is not None:
            nn.init.ones_(module.weight)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif any(True for _ in module.parameters(recurse=False)):
        raise TypeError(
            f"init_module({name!r}): no rule for {type(module).__name__}; "
            "allowed: nn.Linear, nn.Embedding, nn.LayerNorm"
        )


def pipe_gpt(**overrides: int) -> PipeGPT:
    """Factory: a `PipeGPT` initialised with seed 0 (``--model fsdp_lab.pipeline.model:pipe_gpt``)."""
    model = PipeGPT(PipeGPTConfig(**overrides))
    torch.manual_seed(0)
    model.init_weights()
    return model
