"""What flows between pipeline stages, found by running a probe batch through them.

A receiving stage must size its buffer before the message arrives (``comm.recv`` fills a
tensor), so the shape of what crosses each boundary must be known on every rank in advance.
``torch.distributed.pipelining`` infers it at run time (stage 0 runs, then sends the shapes
along, extra messages); here it is worked out when the model is split, on the whole model,
with no message at all (`stage_shapes`):

- `PipeGPT` declares it: (B, T, dim) between stages, logits over ``config.vocab_size``.
- Any other model: token ids of shape (B, T) = `PROBE_SHAPE` run through the stages one after
  another, each stage's output checked — an activation (B, T, ...), floating point, on every
  stage but the last, logits (B, T, vocab) on the last — and its shape after (B, T) kept. A
  model with values runs the chain for real (a few microseconds at this size, the global RNG
  restored, dropout and BatchNorm statistics off), and the chain's logits must equal the
  model's own forward bit for bit: a forward that does anything between its children (scales
  the embedding, adds a position table) would otherwise be trained as another function,
  silently. A meta model — or forward="model", whose stages are cut from copies — runs on meta
  (`meta_copy`): shapes only, at PyTorch's meta-kernel speed (~0.1 s for a small transformer).

Every rank computes the same answer, so a model that fails here fails on every rank.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn as nn

from fsdp_lab.pipeline.model import PipeGPT
from fsdp_lab.pipeline.stages import (
    StagePlan,
    StageSpec,
    build_stage,
    stage_module_names,
)

Activations = tuple[tuple[tuple[int, ...], torch.dtype], ...]
PROBE_SHAPE = (2, 3)  # (B, T) of the probe's token ids: B != T, so a swapped layout shows


def stage_shapes(
    model: nn.Module, names: list[list[str]], forward: str, vocab: int | None
) -> tuple[Activations, int]:
    """(per boundary: shape after (B, T) and dtype of what is sent; the vocab size)."""
    if isinstance(model, PipeGPT):
        return _pipegpt_shapes(model, names)
    return _probe(model, names, forward, vocab)


def has_values(model: nn.Module) -> bool:
    return any(not t.is_meta for t in (*model.parameters(), *model.buffers()))


def meta_copy(model: nn.Module) -> nn.Module:
    """A copy of `model` with every parameter and buffer on the meta device (ties kept): shapes
    to build stages from at no cost, the model itself untouched."""
    memo: dict[int, object] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(model, memo)  # deepcopy takes what memo already holds as copied


def _pipegpt_shapes(model: nn.Module, names: list[list[str]]) -> tuple[Activations, int]:
    """PipeGPT declares its shapes in its config: (B, T, dim) between stages, its vocab."""
    every = stage_module_names(model.config, 0, 1)  # all its modules, in forward order
    if [n for stage in names for n in stage] != every:
        raise ValueError(
            f"PipeGPT's stages must name its modules in forward order, each once: {every} "
            f"cut into pieces; got {names}"
        )
    dtype = model.tok_emb.weight.dtype
    return (((model.config.dim,), dtype),) * (len(names) - 1), model.config.vocab_size


def _probe(
    model: nn.Module, names: list[list[str]], forward: str, vocab: int | None
) -> tuple[Activations, int]:
    """Token ids (B, T) = PROBE_SHAPE through the stages, one after another: what each stage
    sends, and the vocab. A model with values runs its chain for real (a few microseconds at
    this size) and is compared with its own forward; a meta model (or forward="model", whose
    stages are cut from copies) runs on meta: shapes only, no values to compare."""
    real = forward == "sequence" and has_values(model)
    target = model if real or not has_values(model) else meta_copy(model)
    device = next(t.device for t in (*target.parameters(), *target.buffers()))
    ids = torch.zeros(PROBE_SHAPE, dtype=torch.long, device=device)
    x: object = ids
    plan = StagePlan(tuple(tuple(n) for n in names), forward, (), 0)
    sends = []
    with _probing(target):
        for s in range(len(names)):
            whole = copy.deepcopy(target) if forward == "model" else target  # "model" deletes
            try:
                x = build_stage(whole, StageSpec(plan, s))(x)
            except Exception as exc:
                raise ValueError(_cannot_run(model, names, forward, s, exc)) from exc
            _check_output(x, names, s)
            if s < len(names) - 1:
                sends.append((tuple(x.shape[2:]), x.dtype))
        if real:
            _check_chain_is_forward(model, names, x, model(ids))
    logits_vocab = x.shape[-1]
    vocab = logits_vocab if vocab is None else vocab
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 1 <= vocab <= logits_vocab:
        raise ValueError(
            f"vocab_size={vocab!r}: allowed 1..{logits_vocab} (the logits have {logits_vocab} "
            "entries per token); pass vocab_size= or set model.vocab_size"
        )
    return tuple(sends), vocab


@contextmanager
def _probing(model: nn.Module) -> Iterator[None]:
    """No gradients, no dropout, no BatchNorm statistics updated, the global RNG restored."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            yield
    finally:
        for m, mode in modes:
            m.training = mode


def _check_output(x: object, names: list[list[str]], s: int) -> None:
    last = s == len(names) - 1
    ok = isinstance(x, torch.Tensor) and tuple(x.shape[:2]) == PROBE_SHAPE
    if ok and (x.dim() == 3 if last else x.is_floating_point()):
        return
    got = (
        f"{x.dtype} of shape {tuple(x.shape)}"
        if isinstance(x, torch.Tensor)
        else (f"a {type(x).__name__}")
    )
    want = (
        "logits (B, T, vocab)"
        if last
        else "an activation (B, T, ...), floating point to carry a gradient back"
    )
    raise ValueError(
        f"stage {s} of {len(names)} ({names[s]}) returns {got} for token ids (B, T) = "
        f"{PROBE_SHAPE}, but a pipeline stage must return {want}. Check the order of the "
        "names (a stage runs them in the order given), or give the stages explicitly"
    )


def _cannot_run(
    model: nn.Module, names: list[list[str]], forward: str, s: int, exc: Exception
) -> str:
    what = type(model).__name__
    if forward == "model":
        return (
            f"stage {s} of {len(names)} ({names[s]}): {what}'s own forward fails once the "
            f"other stages' modules are removed — {type(exc).__name__}: {exc}. forward='model' "
            "needs a forward that skips absent modules (torchtitan's convention: "
            "`h = self.tok_embeddings(x) if self.tok_embeddings else x`); else use "
            "forward='sequence'"
        )
    return (
        f"stage {s} of {len(names)} cannot run its modules {names[s]} one after another "
        f"(forward='sequence': x = module(x), each in turn) on token ids (B, T) = {PROBE_SHAPE} "
        f"— {type(exc).__name__}: {exc}. So the names are not in the order the forward runs "
        f"them, or {what}'s forward is not a plain sequence of these modules (a layer takes "
        "extra arguments, say rotary tables, or two modules' outputs are added). Fix: give each piece one tensor in and one out (e.g. compute the rotary "
        "table inside the attention), or give the model a forward that skips absent modules "
        "(torchtitan's `h = self.tok_embeddings(x) if self.tok_embeddings else x`) and pass "
        "forward='model', or name other modules in stages=[[...], [...]]"
    )


def _check_chain_is_forward(
    model: nn.Module, names: list[list[str]], chained: torch.Tensor, expected: object
) -> None:
    """The chain of all stages must compute the model's own logits, bit for bit (the same
    kernels on the same inputs); else the pipeline would train another function, silently."""
    if isinstance(expected, torch.Tensor) and torch.equal(chained, expected):
        return
    diff = (
        f"max |difference| {(chained - expected).abs().max().item():.3g}"
        if isinstance(expected, torch.Tensor) and expected.shape == chained.shape
        else f"its forward returns {type(expected).__name__}"
    )
    raise ValueError(
        f"{type(model).__name__}'s forward is not the plain sequence of the stages' modules "
        f"{[n for stage in names for n in stage]}: on token ids {PROBE_SHAPE} the chain's "
        f"logits differ from model(x) ({diff}), so the pipeline would train another function. "
        "Its forward does something between the modules (scales, adds, reshapes): move that "
        "into a module, or give the model a forward that skips absent modules and pass "
        "forward='model'"
    )
