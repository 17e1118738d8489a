"""Activation checkpointing from scratch: trade one extra forward for most of the activations.

Backward needs what the forward saved (a Linear's input, a GELU's input, a dropout mask);
store-all keeps it all, so activation memory grows with depth. `checkpoint(fn, x)` keeps only
the *inputs* of `fn`: in its forward every tensor autograd wants to save is swapped for a
ticket (an int); when backward first asks for a ticket, `fn` is rerun from the kept inputs
under grad mode and the tensors it saves are handed out in the same order. N layers in
checkpointed segments of k keep ~N/k segment inputs plus one segment's activations: O(N/k + k)
memory for one extra forward, best at k ≈ √N (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost").

The recompute must be the *same* computation: the RNG state (CPU, and CUDA for CUDA inputs)
is saved before the forward, set again for the recompute and put back after it
(`rerun_with_forward_rng`), so dropout
draws the same masks, gradients are bitwise those of store-all and the generator advances as
without checkpointing. Autocast is thread-local (backward may run on another thread): restored.

Mirrors `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, built on the same
saved-tensor hooks, including its early stop: the recompute ends once the last ticket is back.
[Note: reentrant] The older `use_reentrant=True` is an `autograd.Function` that runs `fn` under
no_grad and, in its backward, reruns it and calls `torch.autograd.backward` inside backward:
parameters get gradients only through that side door (`torch.autograd.grad` cannot see them),
and when no input requires grad, neither does the output, so the parameters get nothing.
Torch goes further with nested checkpoints, value determinism checks and selective
checkpointing (`context_fn`: keep the outputs of chosen ops instead of recomputing them).

`ForwardCounter` counts forward calls, recomputations included: store-all N, checkpointed 2N.
(`fsdp_lab.checkpointing.schedules` drives the textbook schedules by hand; this is the autograd-integrated
mechanism real training uses.)
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.nn as nn


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    rerun: Callable[[Callable[[], None], RNGState, Sequence[int]], None] | None = None,
    **kwargs: Any,
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """Run ``fn(*args, **kwargs)`` keeping only its inputs; recompute it during backward.

    Args:
        fn: a module or function returning a Tensor or a tuple of Tensors. Parameters of
            modules it uses get their gradients through the recompute; they are not inputs.
        args, kwargs: passed to `fn` unchanged, in the forward and in the recompute (tensors,
            ints, None, strings, flags). Kept alive until backward — that is the memory cost.
        preserve_rng_state: restore the RNG state for the recompute, so dropout draws the
            same masks. False is faster and wrong for random ops (the lab's control).
        rerun: how the recompute is run with the forward's RNG state,
            ``rerun(run, rng_at_forward, cuda_devices)``; default `rerun_with_forward_rng`
            (course mode swaps in a learner's version here).
    """
    if not torch.is_grad_enabled():  # nothing will be saved, so there is nothing to recompute
        return _checked_output(fn(*args, **kwargs), fn)

    tensors = [a for a in itertools.chain(args, kwargs.values()) if isinstance(a, torch.Tensor)]
    cuda_devices = sorted({t.device.index for t in tensors if t.is_cuda})
    rng_at_forward = _rng_state(cuda_devices) if preserve_rng_state else None
    autocast_at_forward = _autocast_state(["cpu", "cuda"] if cuda_devices else ["cpu"])

    saved_meta: list[tuple[torch.Size, torch.dtype]] = []  # ticket -> what the forward saved
    recomputed: dict[int, torch.Tensor] = {}  # ticket -> tensor, until backward consumes it

    def pack_ticket(tensor: torch.Tensor) -> int:
        # Forward: autograd wants to keep `tensor`; give it an int instead, so it can be freed.
        saved_meta.append((tensor.shape, tensor.dtype))
        return len(saved_meta) - 1

    def unpack_ticket(ticket: int) -> torch.Tensor:
        # Backward: the first ticket asked for triggers one recompute that refills them all.
        if ticket not in recomputed:
            recompute()
        return recomputed.pop(ticket)  # popped: freed as soon as its backward node is done

    def recompute() -> None:
        recomputed.clear()  # a second backward (retain_graph) refills every ticket
        order = itertools.count()

        def keep(tensor: torch.Tensor) -> None:
            # detach: we want the values, not the graph of the recompute (it is thrown away)
            recomputed[next(order)] = tensor.detach()
            if len(recomputed) == len(saved_meta):
                raise _RecomputeDone  # early stop: what follows in `fn` would only be discarded

        ran: list[bool] = []  # whether `run` was called: the rerun step is swappable

        def run() -> None:
            ran.append(True)
            # Grad mode on, or the ops would save nothing; same autocast as the forward.
            with (
                torch.enable_grad(),
                _autocast_as(autocast_at_forward),
                torch.autograd.graph.saved_tensors_hooks(keep, _never_unpacked),
                contextlib.suppress(_RecomputeDone),
            ):
                fn(*args, **kwargs)

        if rng_at_forward is None:  # preserve_rng_state=False: draw whatever comes next
            run()
        else:  # the same RNG as the forward, so that dropout draws the same masks
            (rerun or rerun_with_forward_rng)(run, rng_at_forward, cuda_devices)
        if not ran:
            raise RuntimeError(
                f"checkpoint: the recompute of {_name(fn)} never ran: the rerun step must "
                "call `run()`"
            )
        if [(t.shape, t.dtype) for _, t in sorted(recomputed.items())] != saved_meta:
            raise RuntimeError(
                f"checkpoint: the recompute of {_name(fn)} saved {len(recomputed)} tensors, the "
                f"forward {len(saved_meta)} (or different shapes/dtypes): `fn` must do the same "
                "computation both times (no data-dependent control flow on mutable state)"
            )

    with torch.autograd.graph.saved_tensors_hooks(pack_ticket, unpack_ticket):
        out = fn(*args, **kwargs)
    return _checked_output(out, fn)


class _RecomputeDone(Exception):
    """Raised by the recompute once it has every tensor the backward will ask for."""


def _never_unpacked(_: None) -> torch.Tensor:
    raise RuntimeError("the recompute's own graph is never backpropagated")


def _checked_output(out: Any, fn: Callable[..., Any]) -> torch.Tensor | tuple[torch.Tensor, ...]:
    items = out if isinstance(out, tuple) else (out,)
    wrong = sorted({type(o).__name__ for o in items if not isinstance(o, torch.Tensor)})
    if not wrong:
        return out
    inside = f" holding {', '.join(wrong)}" if isinstance(out, tuple) else ""
    raise TypeError(
        f"checkpoint: {_name(fn)} returned a {type(out).__name__}{inside}; "
        "expected a Tensor or a tuple of Tensors"
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)  # a function, or a module's class


# -- the state a recompute must see again ------------------------------------------------------
RNGState = tuple[torch.Tensor, list[torch.Tensor]]  # (CPU state, one per CUDA device)


def _rng_state(cuda_devices: Sequence[int]) -> RNGState:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in cuda_devices]


def _set_rng_state(state: RNGState, cuda_devices: Sequence[int]) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    for d, s in zip(cuda_devices, cuda, strict=True):
        torch.cuda.set_rng_state(s, d)


def rerun_with_forward_rng(
    run: Callable[[], None], rng_at_forward: RNGState, cuda_devices: Sequence[int]
) -> None:
    """Call `run()` (the recompute) with the generators as they were at the forward, then put
    them back as they were before it: the recompute draws the forward's dropout masks, and
    the training's random stream goes on as if there had been no recompute.

    Args:
        run: reruns the checkpointed function; takes nothing, returns nothing.
        rng_at_forward: (CPU state, [state per CUDA device]) saved just before the forward.
        cuda_devices: the CUDA device indexes of the inputs, in the order of the states.
    """
    now = _rng_state(cuda_devices)  # where the training's stream is now, to come back to
    _set_rng_state(rng_at_forward, cuda_devices)
    try:
        run()
    finally:
        _set_rng_state(now, cuda_devices)


def _autocast_state(device_types: Iterable[str]) -> list[tuple[str, bool, torch.dtype]]:
    return [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in device_types]


@contextlib.contextmanager
def _autocast_as(state: list[tuple[str, bool, torch.dtype]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in state:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled))
        yield


# -- applying it to a model ----------------------------------------------------------------------


class CheckpointWrapper(nn.Module):
    """``module`` with its forward checkpointed; its parameters appear under ``module.``.

    Args:
        module: the module whose activations are recomputed instead of stored.
        preserve_rng_state: see `checkpoint`.
    """

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True) -> None:
        super().__init__()
        self.module = module
        self.preserve_rng_state = preserve_rng_state

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return checkpoint(self.module, *args, preserve_rng_state=self.preserve_rng_state, **kwargs)


def checkpoint_modules(model: nn.Module, predicate: Callable[[str, nn.Module], bool]) -> list[str]:
    """Wrap in place every submodule for which ``predicate(name, module)`` is True.

    Like torch's ``apply_activation_checkpointing``: walked from the top, a match is wrapped
    in a `CheckpointWrapper` and not searched further (no nested wrappers).

    Args:
        model: the model to change in place (the root itself is never wrapped).
        predicate: ``(qualified name, module) -> bool``, e.g.
            ``lambda name, m: isinstance(m, ChainLayer)``.

    Returns: the qualified names wrapped, e.g. ``["layers.0", "layers.1", ...]``.
    """
    wrapped: list[str] = []

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            qualified = f"{prefix}{name}"
            if isinstance(child, CheckpointWrapper):
                continue  # already checkpointed
            if predicate(qualified, child):
                setattr(parent, name, CheckpointWrapper(child))  # ModuleList names are "0", …
                wrapped.append(qualified)
            else:
                visit(child, f"{qualified}.")

    visit(model, "")
    return wrapped


def run_segments(
    layers: Sequence[nn.Module],
    x: torch.Tensor,
    segment_size: int | None,
    checkpoint_fn: Callable[..., Any] = checkpoint,
) -> torch.Tensor:
    """Run `layers` in order, each run of `segment_size` layers under `checkpoint_fn`.

    Unlike ``torch.utils.checkpoint.checkpoint_sequential``, the last segment is checkpointed
    too, so every layer runs exactly twice (2N calls).

    Args:
        layers: modules mapping a tensor to a tensor of the same kind.
        x: the input of the first layer.
        segment_size: layers per checkpointed segment; None stores all activations.
        checkpoint_fn: `checkpoint`, or torch's (``functools.partial(torch.utils.checkpoint.
            checkpoint, use_reentrant=False)``) to compare on the same segments.
    """
    if segment_size is None:
        return _run_in_order(layers, x)
    if segment_size < 1:
        raise ValueError(f"segment_size={segment_size}: expected an int >= 1 or None")
    for start in range(0, len(layers), segment_size):
        x = checkpoint_fn(_run_in_order, layers[start : start + segment_size], x)
    return x


def _run_in_order(layers: Sequence[nn.Module], x: torch.Tensor) -> torch.Tensor:
    for layer in layers:
        x = layer(x)
    return x


class ForwardCounter:
    """Counts forward calls of modules, recomputations included, with forward pre-hooks.

        with ForwardCounter(model.layers) as calls:
            model(x).sum().backward()
        calls.total, calls.per_module  # 2N and [2, 2, ...] with every segment checkpointed

    Pre-hooks count a call when it starts, so a recompute that stops early (torch's
    ``early_stop``) still counts. A `CheckpointWrapper` is counted through the module it wraps,
    the one that is recomputed (the wrapper's own forward runs once).

    Args:
        modules: the modules to count, in the order of `per_module`.
    """

    def __init__(self, modules: Iterable[nn.Module]) -> None:
        self.modules = [m.module if isinstance(m, CheckpointWrapper) else m for m in modules]
        self.per_module = [0] * len(self.modules)
        self._handles: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def total(self) -> int:
        return sum(self.per_module)

    def __enter__(self) -> ForwardCounter:
        for i, module in enumerate(self.modules):
            hook = functools.partial(self._count, i)
            self._handles.append(module.register_forward_pre_hook(hook))
        return self

    def _count(self, i: int, module: nn.Module, args: tuple) -> None:
        self.per_module[i] += 1

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
