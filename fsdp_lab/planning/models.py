"""The models a plan is made for: Llama-3 presets, their scaled-down twins, or any factory.

    llama3-8b, llama3-70b, llama3-405b     Meta's shapes (`fsdp_lab.models.llama3_config`)
    llama3-8b-twin, ...                    the same architecture at dim 64, 4 blocks: small
                                           enough to train on real ranks here
    package.module:factory                 your own model (built on meta: no memory)
    7.5e9, 70B                             a parameter count alone: model state and bytes
                                           only (one unit, no layers: no activations)

Every model is built under ``torch.device("meta")``: shapes only, so a 405B model costs its
Python objects and nothing else. A model's wrap units are its repeated blocks (the children
of its ``nn.ModuleList``s), the rest is the root unit — as the sharding lab wraps.
"""

from __future__ import annotations

from typing import Any

PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b")
MAX_PARAMETERS = 1e15  # a thousand times the largest model trained: beyond it, a typo
TWIN = "-twin"


def parameter_count(name: str) -> int | None:
    """A model given by its parameter count alone ("7.5e9", "70B"), or None for a named one."""
    text = name.strip().lower()
    scale = {"b": 1e9, "m": 1e6}.get(text[-1:], 1)
    try:
        count = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        return None
    if not 1 <= count <= MAX_PARAMETERS:  # NaN, inf and 1e400 (inf) included
        raise ValueError(
            f"--model {name!r}: a parameter count must be a number from 1 to "
            f"{MAX_PARAMETERS:.0e}, e.g. 7.5e9 or 70B"
        )
    return int(count)


def model_names() -> list[str]:
    """Every preset name, twins included."""
    return [*PRESETS, *(p + TWIN for p in PRESETS)]


def llama_config_of(name: str, seq: int) -> Any:
    """The `LlamaConfig` of preset `name` with a rotary cache of `seq` positions."""
    from fsdp_lab.models import llama3_config, twin_config

    base = name.removesuffix(TWIN)
    if base not in PRESETS:
        raise ValueError(_unknown(name))
    config = llama3_config(base.removeprefix("llama3-"), seq_len=seq)
    return twin_config(config) if name.endswith(TWIN) else config


def build_on_meta(name: str, seq: int) -> Any:
    """Model `name` (a preset or ``module:factory``) built on the meta device."""
    import torch

    from fsdp_lab.models import Llama

    if ":" in name:
        from fsdp_lab.model_spec import load_factory

        factory = load_factory(name)
        with torch.device("meta"):
            try:
                return factory()
            except Exception as exc:
                raise ValueError(
                    f"--model {name!r} cannot be built on the meta device: {exc}. Fix: a "
                    "factory that only creates modules (no .item(), no data-dependent code)"
                ) from exc
    config = llama_config_of(name, seq)
    with torch.device("meta"):
        return Llama(config)


def block_classes(model: Any) -> set[type]:
    """The wrap units' classes: what the model's ``nn.ModuleList``s hold."""
    import torch

    return {type(m) for lst in model.modules() if isinstance(lst, torch.nn.ModuleList) for m in lst}


def _unknown(name: str) -> str:
    import difflib

    near = difflib.get_close_matches(name, model_names(), n=1)
    hint = f"did you mean {near[0]!r}? " if near else ""
    return (
        f"--model {name!r} is not a preset: {hint}expected one of {model_names()} or "
        "'package.module:factory'"
    )
