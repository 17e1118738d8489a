"""Exercise of the sharding lab: the cast at a unit's edges that lets one model compute in two
precisions (`cast_floats`).

The recipe in docs/labs.md keeps each norm of a bf16 (or fp16) Llama whole and in fp32: a unit of its
own whose policy says `param_dtype=float32, output_dtype=bfloat16`, inside units that compute
in bf16. That works only if every unit casts what crosses its edges — its floating-point
inputs to its own `param_dtype` on the way in (FSDP2's `cast_forward_inputs`) and its output to
`output_dtype` on the way out. The learner's function is that cast (`ShardingSteps.cast_floats`),
called by every unit of the real sharded model, the last one called with keyword arguments, a
list, a dict, a mask, numbers and fp32 buffers. The check trains it beside the reference,
records per kind of module the dtype of the input it computed on, and holds each cast's result
to its contract (the same containers and keys, every other value as it was, each floating-point
tensor in the dtype asked and still in autograd's graph): the verdict names the first place
where it was not. The classic bugs: casting every tensor (the token ids become floats and the
embedding refuses them); casting only a bare tensor (a unit's inputs arrive as `(args,
kwargs)`, so nothing is cast on the way in); casting to one fixed dtype instead of the one asked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import (
    keystr,
    tree_flatten_with_path,
    tree_leaves,
    tree_map_only,
    tree_structure,
)

from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Impossible,
    Mismatch,
    WrongOutput,
    close,
    first_values,
    loss_curves,
)
from fsdp_lab.models import synthetic_batch
from fsdp_lab.models.llama import Llama, LlamaConfig, RMSNorm
from fsdp_lab.reference import local_slice
from fsdp_lab.sharding import MixedPrecision, ShardingSteps, UnitPolicy, shard
from fsdp_lab.sharding.steps import cast_floats as _mechanism_step

STEPS, BATCH, VOCAB, LR = 2, 12, 64, 1e-2
KINDS = (nn.Embedding, nn.Linear, RMSNorm)
LOW = {"float16": torch.float16, "bfloat16": torch.bfloat16}  # what the blocks compute in


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """Reference: the mechanism's own step (each floating-point tensor `.to(dtype)`)."""
    return _mechanism_step(tree, dtype)


def _every_tensor(tree: Any, dtype: torch.dtype) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.to(dtype), tree)  # token ids too


def _bare_tensor_only(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor) and tree.is_floating_point():
        return tree.to(dtype)
    return tree  # (args, kwargs) is a tuple: the inputs are never cast


def _one_fixed_dtype(tree: Any, dtype: torch.dtype) -> Any:
    return _mechanism_step(tree, torch.bfloat16)  # the dtype asked is ignored


# -- on every rank ---------------------------------------------------------------------------


def _dtype_name(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else "none"


class Head(nn.Module):
    """The model's last unit, called the way library models call their parts: keyword arguments,
    a list, a dict, a mask, numbers and None beside the activations — all of which a cast walks
    past, and fp32 tensors that need no gradient, which it must cast."""

    def __init__(self, dim: int, vocab: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(dim))  # the unit's own: its proj is a unit too
        self.proj = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor, extras: list, *, scale: float, keep: torch.Tensor,
                options: dict) -> torch.Tensor:  # fmt: skip
        h = (x + extras[0] + options["shift"][0]) * self.gain  # fp32 buffers, cast like x
        return (self.proj(h) * scale).masked_fill(~keep.unsqueeze(-1), 0.0)


class _Llama(Llama):
    """The lab's Llama, its output head a `Head` called with everything a cast meets."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        del self.output
        self.head = Head(config.dim, config.vocab_size)
        self.register_buffer("bias", 0.1 * torch.randn(config.dim))
        self.register_buffer("shift", 0.1 * torch.randn(config.dim))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope(idx.shape[1])
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, cos, sin)
        options = {
            "shift": [self.shift],
            "ids": idx.int(),
            "layers": len(self.layers),
            "none": None,
        }
        return self.head(self.norm(x), [self.bias], scale=0.5, keep=idx >= 0, options=options)


def _where(path: tuple, inputs: bool) -> str:
    """A leaf's place, as the learner's code reaches it: args[0], kwargs['options']['shift'][0]."""
    if not inputs:
        return "the output" + keystr(path)
    return ("args", "kwargs")[path[0].idx] + keystr(path[1:]) if path else "the inputs"


def _a(name: str) -> str:
    return ("an " if name.startswith(("int", "uint")) else "a ") + name


def _breach(given: Any, back: Any, dtype: torch.dtype) -> tuple[str, str] | None:
    """The first way `back` is not `given` with each floating-point tensor cast to `dtype`, as
    (kind, what happened); None if it is exactly that."""
    inputs = isinstance(given, tuple) and len(given) == 2 and isinstance(given[1], dict)
    got, want = tree_flatten_with_path(back)[0], tree_flatten_with_path(given)[0]
    if tree_structure(back) != tree_structure(given):  # the same spec: the same key paths
        if type(back) is not type(given):
            what = f"{type(back).__name__} for {type(given).__name__}"
        else:
            paths = [p for p, _ in got]
            lost = [_where(p, inputs) for p, _ in want if p not in paths]
            what = f"{lost[0]} is missing" if lost else "a container changed type"
        return "structure", f"the tree came back with other containers or keys ({what})"
    for (path, g), (_, b) in zip(want, got, strict=True):
        where = _where(path, inputs)
        if not isinstance(g, torch.Tensor):
            if b is not g and not (type(b) is type(g) and b == g):
                return "structure", f"{where}: {g!r} came back as {b!r}"
            continue
        if not isinstance(b, torch.Tensor):
            return "structure", f"{where}: a tensor came back as {type(b).__name__}"
        name, asked = _dtype_name(g), str(dtype).removeprefix("torch.")
        if not g.is_floating_point():
            if b.dtype != g.dtype:
                return "not floating", f"{where}: {_a(name)} tensor came back {_dtype_name(b)}"
        elif b.dtype != dtype:
            kind = "not cast" if b.dtype == g.dtype else "other dtype"
            return kind, f"{where}: {_a(name)} tensor came back {_dtype_name(b)}, {asked} asked"
        if b.shape != g.shape or b.device != g.device:
            return "values", f"{where}: a tensor came back shaped {tuple(b.shape)} on {b.device}"
        if g.requires_grad and b.grad_fn is None and not b.requires_grad:
            return "graph", f"{where}: the cast tensor is cut from autograd's graph"
        if not torch.equal(b, g.detach().to(b.dtype)):
            return "values", f"{where}: the values changed, not only the dtype"
    return None


def _train(step: Any, case: Case) -> dict:
    own_error: list[BaseException] = []  # raised by the learner's function: not the model's
    breaches: list[tuple[str, str]] = []  # (kind, what happened): the first few, all calls
    inputs_cast = 0  # floating-point inputs that needed a cast and got it

    def watched(tree: Any, dtype: torch.dtype) -> Any:
        nonlocal inputs_cast
        given = [(t, t.dtype) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        try:
            out = step(tree, dtype)
        except BaseException as exc:
            own_error.append(exc)
            raise
        if out is None:
            exc = WrongOutput(
                "cast_floats returned None: expected the tree it was given, each floating-point "
                "tensor in it cast (return the new tree; a cast makes new tensors)"
            )
            own_error.append(exc)
            raise exc
        if any(t.dtype != was for t, was in given):
            breach = ("in place", "a tensor it was given changed dtype in place (.data = ...)")
        else:
            breach = _breach(tree, out, dtype)
        if breach is not None and len(breaches) < 3:
            breaches.append(breach)
        if isinstance(tree, tuple) and breach is None:
            inputs_cast += sum(t.is_floating_point() and t.dtype != dtype for t, _ in given)
        return out

    torch.manual_seed(0)  # every rank builds the same weights
    model = _Llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=case.params["layers"],
                              n_heads=2, n_kv_heads=1, ffn_dim=32, seq_len=8))  # fmt: skip
    low = LOW[case.params["dtype"]]
    norms = UnitPolicy(strategy="replicate", mixed_precision=MixedPrecision(
        torch.float32, torch.float32, output_dtype=low))  # fmt: skip
    # The injection point: every unit's casts, in and out, are the learner's step.
    shard(model, units=(*KINDS, Head), strategy=case.params["strategy"],
          mixed_precision=MixedPrecision(low, torch.float32), policies={RMSNorm: norms},
          mesh=dist.group.WORLD, steps=ShardingSteps(cast_floats=watched))  # fmt: skip
    computed_on: dict[str, str] = {}  # kind of module -> dtype of the input it computed on
    for module in model.modules():
        if isinstance(module, (*KINDS, Head)):

            def note(m: nn.Module, args: tuple, kind: str = type(module).__name__) -> None:
                computed_on.setdefault(kind, _dtype_name(next(iter(tree_leaves(args)), None)))

            module.register_forward_pre_hook(note)  # after the unit's own: sees its cast
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    me, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"computed_on": computed_on, "losses": [], "error": None}
    out["breaches"] = breaches
    for k in range(STEPS):
        x, y = (local_slice(t, me, n) for t in synthetic_batch(VOCAB, BATCH, 8, k))
        try:
            logits = model(x)
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), y.reshape(-1))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
        except (RuntimeError, TypeError) as exc:
            if own_error:  # the learner's own exception: the checker shows its traceback
                raise
            out["error"] = str(exc).splitlines()[0]  # the model's, on a wrongly cast input
            break
        out["losses"].append(loss.item())
        if k == 0:
            out["first_grad"] = [
                float(p.grad.float().norm()) if p.grad is not None else 0.0
                for p in model.parameters()
            ]
        optimizer.step()
    out["inputs_cast"] = inputs_cast
    return out


def trial(fn: Any, case: Case) -> dict:
    return _train(fn, case)


# -- in the notebook -------------------------------------------------------------------------

DTYPES = ("bfloat16", "float32", "float16", "float64", "int64", "int32", "bool", "none")


def _physical(got: dict, exp: dict) -> None:
    """What a run of this mechanism can have measured: the reference's kinds of module, each
    with a dtype a tensor has; no more losses than steps."""
    if not set(got["computed_on"]) <= set(exp["computed_on"]):
        raise Impossible("a kind of module the model does not have computed")
    if any(d not in DTYPES for d in got["computed_on"].values()):
        raise Impossible("a module computed on a dtype no tensor has")
    if len(got["losses"]) > STEPS:
        raise Impossible("more losses than steps")


def _dtype_rows(got: dict, exp: dict) -> list[tuple[str, str, str]]:
    return [
        (f"{kind} computed on", want, got["computed_on"].get(kind, "(never ran)"))
        for kind, want in exp["computed_on"].items()
        if got["computed_on"].get(kind) != want
    ]


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, (got, exp) in enumerate(zip(got_all, expected, strict=True)):
        _physical(got, exp)
        rows = _dtype_rows(got, exp)
        if got["error"]:
            return Mismatch(
                f"the forward failed on rank {r}: {got['error']}", rows=rows, hint=_hint(got)
            )
        if (
            rows
            or not close(got["losses"], exp["losses"])
            or not close(got.get("first_grad", []), exp["first_grad"])
        ):
            return Mismatch(
                f"rank {r}'s training differs from the reference's: "
                + (
                    "a unit computed on inputs it should have cast."
                    if rows
                    else "its losses or gradients."
                ),
                rows=rows
                or [
                    ("loss, each step", first_values(exp["losses"]), first_values(got["losses"])),
                    (
                        "gradient norms, first values",
                        first_values(exp["first_grad"]),
                        first_values(got.get("first_grad", [])),
                    ),
                ],
                hint=_hint(got),
                series=loss_curves(f"loss on rank {r}, {STEPS} SGD steps", got, exp),
            )
        if got["breaches"]:  # no symptom in this model: the next unit's own cast covered it
            return Mismatch(
                f"values right, but on rank {r} a cast did not return what it was given with "
                f"each floating-point tensor cast: {got['breaches'][0][1]}.",
                hint=_hint(got),
            )
    return None


HINTS = {
    "not cast": "cast every floating-point tensor to the dtype asked, whatever that dtype is "
    "and wherever the tensor sits (a buffer that needs no gradient too).",
    "other dtype": "cast to the `dtype` argument (a norm's unit asks for float32), not to a "
    "fixed one.",
    "not floating": "the token ids were cast too: cast only floating-point tensors "
    "(t.is_floating_point()); ids and masks must keep their integer dtype.",
    "structure": "return the same containers — a tuple stays a tuple, a dict keeps its keys, "
    "every value that is not a tensor stays as it is: only the floating-point tensors change.",
    "graph": "cast with t.to(dtype), which stays in autograd's graph; detach(), .data and "
    "torch.tensor(...) cut it, and the units before get no gradient.",
    "in place": "return new tensors and leave the ones you were given as they are: the unit's "
    "caller still holds them.",
    "values": "a cast changes the dtype only: t.to(dtype).",
}
WALK = (
    "a unit's inputs arrive as (args, kwargs), a tuple and a dict, the tensors nested inside: "
    "walk the whole tree (torch.utils._pytree.tree_map_only(torch.Tensor, fn, tree)) and cast "
    "each floating-point tensor."
)


def _hint(got: dict) -> str:
    """The first breach of the contract the learner's casts made, and what to do instead."""
    if not got["breaches"]:
        return HINTS["graph"] if got.get("first_grad") and not any(got["first_grad"]) else (
            "the casts returned what they should, yet the values differ: does your function "
            "change anything else (the model, torch's settings)?"
        )  # fmt: skip
    kind, what = got["breaches"][0]
    if kind == "not cast" and what.startswith(("args", "kwargs")) and not got["inputs_cast"]:
        return f"{what}: {WALK}"  # no input was ever cast: the tree was not walked
    return f"{what}: {HINTS[kind]}"


CAST_FLOATS = Exercise(
    name="cast_floats",
    lab="shard",
    title="Cast what crosses a unit's edges: one model in two precisions",
    statement=(
        "With per-unit mixed precision, every Linear and Embedding of a Llama computes in "
        "fp16 or bf16 while each RMSNorm is a unit of its own that computes in fp32 and hands "
        "fp16 or bf16 on. "
        "That works only if each unit casts what crosses its edges: before its forward, its "
        "inputs `(args, kwargs)` to its own `param_dtype` (FSDP2's `cast_forward_inputs`); "
        "after it, its output to `output_dtype`. Write `cast_floats(tree, dtype)`: return "
        "`tree` with **each floating-point tensor** in it, however deeply nested in tuples, "
        "lists and dicts, cast to `dtype`, and everything else left as it is. Every unit of "
        "the sharded model calls it — the last one the way library models call their parts, "
        "with keyword arguments, a list, a dict, a mask, numbers and None beside the tensors — "
        "and the check trains the model for two steps beside the reference, holding each "
        "cast to what it should return."
    ),
    stub=(
        "def cast_floats(tree, dtype):\n"
        '    """`tree` with each floating-point tensor in it cast to `dtype`; the rest as is."""\n'
    ),
    hints=(
        "A unit's inputs are not one tensor: the unit receives `(args, kwargs)`, a tuple and "
        "a dict, with the tensors inside; its output may be a tuple too.",
        "`torch.utils._pytree.tree_map_only(torch.Tensor, fn, tree)` applies `fn` to every "
        "tensor of a nested structure and rebuilds it.",
        "Token ids are integers: cast `t` only when `t.is_floating_point()`, with "
        "`t.to(dtype)` — the gradient flows back through it.",
    ),
    solution=cast_floats,
    trial=trial,
    judge=judge,
    cases=(
        Case(
            "2 ranks, a Llama of 1 block in fp16, its norms in fp32, ZeRO-3",
            2,
            {"layers": 1, "strategy": "full", "dtype": "float16"},
        ),
        Case(
            "3 ranks, a Llama of 2 blocks in bf16, its norms in fp32, ZeRO-2",
            3,
            {"layers": 2, "strategy": "grad_op", "dtype": "bfloat16"},
        ),
    ),
    bugs=(
        Bug(
            "every-tensor",
            "casts every tensor",
            _every_tensor,
            "the token ids are cast to fp16 with the rest, and the embedding refuses them: "
            "the forward fails at the first unit",
        ),
        Bug(
            "bare-tensor-only",
            "casts only a bare tensor",
            _bare_tensor_only,
            "the inputs arrive as (args, kwargs), so nothing is cast on the way in: the norms "
            "compute on fp16 inputs and the loss drifts from the reference's",
        ),
        Bug(
            "fixed-dtype",
            "casts to bf16 whatever dtype is asked",
            _one_fixed_dtype,
            "the fp16 blocks receive bf16 activations and the matmul refuses the mix; the norms "
            "never compute in fp32",
        ),
    ),
    points=2,
    minutes=10,
)
