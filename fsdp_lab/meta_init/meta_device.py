"""Build on the meta device without running the init that has nothing to write there.

``with torch.device("meta"): Llama(llama_70b_config())`` runs every module's
``reset_parameters()`` on tensors that have no storage. Most init fills are free there, but
``normal_`` (nn.Embedding's init, GPT-2's ``init_weights``) has no C++ meta kernel: its meta
kernel is a Python reference (``torch._refs.normal``) wrapped in ``torch._disable_dynamo``,
whose first call imports ``torch._dynamo`` and what it needs (sympy, torch._inductor): a cost
paid once per process that has nothing to do with the model (``python
benchmarks/bench_meta_init.py`` measures its time, its memory and the modules it imports on the
machine it runs on; lab 04 sets a first build in a fresh process beside a second one).

`meta_device()` is ``torch.device("meta")`` plus one `TorchFunctionMode`: on a meta tensor,
the fills that init code ends in return the tensor untouched. The values do not exist, so
nothing is lost; PyTorch's own ``nn.init.trunc_normal_`` and ``dirac_`` already return early
on meta for the same reason — this applies that rule to the rest. Everything else runs as in a
plain meta build: module constructors, shapes, dtypes, ``requires_grad``, ties, buffers, and
nn.init's own checks (``kaiming_uniform_`` on a 1-D tensor still raises). Materialising later
(``to_empty`` + ``reset_parameters()``) runs the real init on real tensors, and a meta fill
never drew from the CPU generator anyway, so the values are the same as after a plain build.

Why a `TorchFunctionMode` and not the alternatives:

- accelerate's ``init_empty_weights`` patches ``nn.Module.register_parameter`` (a global, for
  every thread) to move each parameter to meta as it is registered; ``reset_parameters()``
  then runs on meta and pays the same import. ``torch.nn.utils.skip_init`` needs a module
  that takes ``device=``, builds it on meta (same import), then materialises it with
  ``to_empty``: the opposite of what a 70B build wants.
- A `TorchDispatchMode` would see every aten op, nested calls included, but torch wraps each
  subclass's ``__torch_dispatch__`` in ``_disable_dynamo``: its first call imports
  ``torch._dynamo``, the very cost being avoided.
- A `TorchFunctionMode` is how ``torch.device("meta")`` itself works (``DeviceContext``); it is
  scoped to the ``with`` block and this thread, and patches nothing. It sees calls at the
  Python API, so a call that nn.init hands to modes (``nn.init.normal_``) is caught there; the
  fill inside it would run with the mode switched off.

What is not skipped: a fill's own argument checks (``std >= 0``, ``from <= to``), which run
again at materialisation where they matter; and other in-place arithmetic on meta
(``clamp_``, ``mul_``): it keeps PyTorch's shape and dtype checks, and the first such op
without a C++ meta kernel still pays the import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

# Tensor methods that only write values: every nn.init function ends in one of them.
VALUE_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {
        torch.Tensor.normal_,
        torch.Tensor.uniform_,
        torch.Tensor.fill_,
        torch.Tensor.zero_,
        torch.Tensor.random_,
        torch.Tensor.bernoulli_,
        torch.Tensor.exponential_,
        torch.Tensor.geometric_,
        torch.Tensor.log_normal_,
        torch.Tensor.cauchy_,
    }
)
# nn.init functions that hand themselves to torch-function modes before doing anything: the
# mode sees them, not the fill inside. kaiming_uniform_ also does, but is left to run: its
# checks (fan_in of a 1-D tensor) stay, and the uniform_ it ends in imports nothing on meta
# (its meta kernel is a decomposition that loads with torch).
INIT_FILLS: frozenset[Callable[..., Any]] = frozenset(
    {nn.init.normal_, nn.init.uniform_, nn.init.constant_}
)


class SkipInitOnMeta(TorchFunctionMode):
    """On a meta tensor, `VALUE_FILLS` and `INIT_FILLS` return the tensor without a kernel.

    The version counter is still bumped, as the in-place op would have, and an in-place fill
    that autograd forbids (a leaf that requires grad, outside ``no_grad``) still runs, so it
    raises exactly as in a plain meta build.
    """

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func in VALUE_FILLS or func in INIT_FILLS:
            # Methods: args = (self, ...). nn.init hands over args=() and tensor= in kwargs.
            tensor = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                # nn.init fills under no_grad itself; a bare method call is checked by autograd.
                legal = func in INIT_FILLS or not (torch.is_grad_enabled() and tensor.requires_grad)
                if legal:
                    torch.autograd.graph.increment_version(tensor)
                    return tensor
        return func(*args, **kwargs)


@contextmanager
def meta_device(skip_init: bool = True) -> Iterator[None]:
    """``torch.device("meta")`` for everything built inside; with `skip_init`, init fills on
    meta tensors are no-ops (`SkipInitOnMeta`). ``skip_init=False`` is the plain meta build.

    The model is the same either way: names, shapes, dtypes, ``requires_grad``, ties, buffers.
    """
    with torch.device("meta"):
        if not skip_init:
            yield
            return
        with SkipInitOnMeta():
            yield
