"""``--model module:factory``: load the factory, and check DESIGN.md's contract before any rank.

The contract: ``factory()`` returns a `torch.nn.Module` with an int ``vocab_size`` that maps a
LongTensor of token ids ``(batch, seq)`` to logits ``(batch, seq, vocab_size)``.
`check_model` builds the model on the meta device (shapes, no storage: cheap at any size), so
a wrong spec is one clear line from the driver instead of a traceback from every rank.
Loading is torch-free; only the check imports torch, and only when a lab is about to run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

EXAMPLE = "fsdp_lab.models:tiny_gpt"


def load_factory(spec: str) -> Callable[[], Any]:
    """``"package.module:factory"`` -> the factory function (ValueError naming what failed)."""
    module_name, _, attr = spec.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(
            f"--model {spec!r}: cannot load {attr!r} from {module_name!r} ({exc}). "
            f"Fix: an importable module and a name in it, e.g. --model {EXAMPLE}"
        ) from exc


def check_model(spec: str) -> None:
    """Load ``spec``, build its model on meta, check the contract; ValueError if it breaks it."""
    import torch  # a lab is about to run: torch is needed anyway

    factory = load_factory(spec)
    if not callable(factory):
        raise ValueError(
            f"--model {spec!r}: {type(factory).__name__} {factory!r} is not callable. "
            f"Fix: name a function that returns the model, e.g. --model {EXAMPLE}"
        )
    try:
        with torch.device("meta"):  # shapes only: no memory, no init time, whatever the size
            model = factory()
    except Exception as exc:
        raise ValueError(
            f"--model {spec!r}: the factory raised {exc!r} when called with no arguments "
            "(on the meta device). Fix: make factory() build the model without arguments and "
            "without reading tensor values (it must work under torch.device('meta'))"
        ) from exc
    if not isinstance(model, torch.nn.Module):
        raise ValueError(
            f"--model {spec!r}: the factory returned {type(model).__name__}, expected a "
            "torch.nn.Module. Fix: return the model itself"
        )
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(
            f"--model {spec!r}: the {type(model).__name__} has no int attribute vocab_size "
            f"(got {vocab!r}); the lab draws token ids below it. Fix: set "
            "self.vocab_size in the model's __init__"
        )
