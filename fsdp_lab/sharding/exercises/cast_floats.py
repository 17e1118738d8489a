"""Exercise of the sharding lab: the cast at a unit's edges that lets one model compute in two
precisions (`cast_floats`).

The README's recipe keeps each norm of a bf16 (or fp16) Llama whole and in fp32: a unit of its
own whose policy says `param_dtype=float32, output_dtype=bfloat16`, inside units that compute
in bf16.
That works only if every unit casts what crosses its edges — its floating-point inputs to its
own `param_dtype` on the way in (FSDP2's `cast_forward_inputs`) and its output to
`output_dtype` on the way out. The learner's function is that cast (`ShardingSteps.cast_floats`),
called by every unit of the real sharded model; the check trains it beside the reference and
records, per kind of module, the dtype of the input it computed on. The classic bugs: casting
every tensor (the token ids become floats and the embedding refuses them), and casting only a
bare tensor (a unit's inputs arrive as `(args, kwargs)`, so nothing is cast on the way in: the
norms compute in half precision and the loss drifts from the reference's); and casting to one
fixed dtype instead of the one asked.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._pytree import tree_leaves, tree_map_only

from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Impossible,
    Mismatch,
    WrongOutput,
    close,
    first_values,
    series_of,
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


def _train(step: Any, case: Case) -> dict:
    own_error: list[BaseException] = []  # raised by the learner's function: not the model's
    miscast = {"left as it was": 0, "cast to another dtype": 0}  # floating tensors, all calls

    def watched(tree: Any, dtype: torch.dtype) -> Any:
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
        for given, back in zip(tree_leaves(tree), tree_leaves(out), strict=False):
            if isinstance(back, torch.Tensor) and back.is_floating_point() and back.dtype != dtype:
                same = isinstance(given, torch.Tensor) and back.dtype == given.dtype
                miscast["left as it was" if same else "cast to another dtype"] += 1
        return out

    torch.manual_seed(0)  # every rank builds the same weights
    model = Llama(LlamaConfig(vocab_size=VOCAB, dim=16, n_layers=case.params["layers"],
                              n_heads=2, n_kv_heads=1, ffn_dim=32, seq_len=8))  # fmt: skip
    low = LOW[case.params["dtype"]]
    norms = UnitPolicy(strategy="replicate", mixed_precision=MixedPrecision(
        torch.float32, torch.float32, output_dtype=low))  # fmt: skip
    # The injection point: every unit's casts, in and out, are the learner's step.
    shard(model, units=KINDS, strategy=case.params["strategy"],
          mixed_precision=MixedPrecision(low, torch.float32), policies={RMSNorm: norms},
          mesh=dist.group.WORLD, steps=ShardingSteps(cast_floats=watched))  # fmt: skip
    computed_on: dict[str, str] = {}  # kind of module -> dtype of the input it computed on
    for module in model.modules():
        if isinstance(module, KINDS):

            def note(m: nn.Module, args: tuple, kind: str = type(module).__name__) -> None:
                computed_on.setdefault(kind, _dtype_name(next(iter(tree_leaves(args)), None)))

            module.register_forward_pre_hook(note)  # after the unit's own: sees its cast
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    me, n = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {"computed_on": computed_on, "losses": [], "error": None}
    out["miscast"] = miscast
    for k in range(STEPS):
        x, y = (local_slice(t, me, n) for t in synthetic_batch(VOCAB, BATCH, 8, k))
        try:
            logits = model(x)
            out["logits_dtype"] = _dtype_name(logits)
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
            ids = got["computed_on"].get("Embedding", "int64") != "int64"
            return Mismatch(
                f"the forward failed on rank {r}: {got['error']}",
                rows=rows,
                hint="the token ids were cast too: cast only floating-point tensors "
                "(t.is_floating_point()); ids and masks must keep their integer dtype."
                if ids
                else _hint(got["miscast"]),
            )
        if rows or not close(got["losses"], exp["losses"]):
            kept, other = (
                got["miscast"].get(k, 0) for k in ("left as it was", "cast to another dtype")
            )
            return Mismatch(
                f"rank {r}'s training differs from the reference's: "
                + (
                    "a unit computed on inputs it should have cast."
                    if rows
                    else "the casts are right, but the values are not."
                ),
                rows=rows
                or [
                    (
                        "gradient norms, first values",
                        first_values(exp["first_grad"]),
                        first_values(got.get("first_grad", [])),
                    )
                ],
                hint=_hint(got["miscast"]),
                series=series_of(
                    f"loss on rank {r}, {STEPS} SGD steps",
                    "step",
                    "loss",
                    {"reference": exp["losses"], "yours": got["losses"]},
                ),
            )
    return None


def _hint(miscast: dict[str, int]) -> str:
    """The bug that explains the floating-point tensors the learner's casts handed back."""
    kept, other = miscast.get("left as it was", 0), miscast.get("cast to another dtype", 0)
    if other:
        return (
            f"{other} floating-point tensors came back in another dtype than the one asked: "
            "cast to the `dtype` argument (a norm's unit asks for float32), not to a fixed one."
        )
    if kept:
        return (
            f"{kept} floating-point tensors came back as they were: a unit's inputs arrive as "
            "(args, kwargs), a tuple and a dict — walk the whole tree "
            "(torch.utils._pytree.tree_map_only(torch.Tensor, fn, tree)) and cast each one."
        )
    return (
        "cast with t.to(dtype), which stays in autograd's graph (detach(), .data and "
        "torch.tensor(...) cut it), and leave every other value as it is."
    )


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
        "the sharded model calls it, and the check trains the model for two steps beside the "
        "reference."
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
