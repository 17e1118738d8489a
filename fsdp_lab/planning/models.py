"""The models a plan is made for: Llama-3 presets, their scaled-down twins, or any factory.

    llama3-8b, llama3-70b, llama3-405b     Meta's shapes (`fsdp_lab.models.llama3_config`)
    llama3-8b-twin, ...                    the same architecture at dim 64, 4 blocks: small
                                           enough to train on real ranks here
    package.module:factory                 your own model (built on meta: no memory)
    7.5e9, 70B                             a parameter count: planned as the Llama-3-shaped
                                           decoder of about that size (`count_config`), said

Every model is built under ``torch.device("meta")``: shapes only, so a 405B model costs its
Python objects and nothing else. A model's wrap units are its repeated blocks (the children
of its ``nn.ModuleList``s), the rest is the root unit — as the sharding lab wraps.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from dataclasses import replace
from typing import Any

PRESETS = ("llama3-8b", "llama3-70b", "llama3-405b")
MIN_PARAMETERS = 1e8  # a Llama-3 shape's embeddings alone are 33M at width 128
MAX_PARAMETERS = 1e15  # a thousand times the largest model trained: beyond it, a typo
TWIN = "-twin"
BUILD_TIME_LIMIT_S = 120  # a model builds on meta in seconds (405B: about five); beyond, a hang


def parameter_count(name: str) -> int | None:
    """A model given by its parameter count alone ("7.5e9", "70B"), or None for a named one."""
    text = name.strip().lower()
    scale = {"b": 1e9, "m": 1e6}.get(text[-1:], 1)
    try:
        count = float(text[:-1] if scale != 1 else text) * scale
    except ValueError:
        return None
    if not MIN_PARAMETERS <= count <= MAX_PARAMETERS:  # NaN, inf and 1e400 (inf) included
        fix = (
            "a smaller model as package.module:factory (a count is planned as a Llama-3 shape, "
            "and below 100M parameters its vocabulary would be most of it)"
            if count < MIN_PARAMETERS
            else "a count of a model that can be built: 1e15 is a thousand times the largest "
            "trained"
        )
        raise ValueError(
            f"--model {name!r}: a parameter count must be a number from {MIN_PARAMETERS:.0e} "
            f"to {MAX_PARAMETERS:.0e}, e.g. 7.5e9 or 70B. Fix: {fix}"
        )
    return int(count)


def count_config(count: int) -> Any:
    """The Llama-3-shaped decoder a bare parameter count is planned as, after Llama-3-8B's
    proportions: width 128·k — k blocks, k heads of 128, K/V heads the largest divisor of k up
    to k/4 (8B: 8 of 32), Llama-3's
    vocabulary — with the k whose count is nearest `count` at SwiGLU 3.5x wide, then the SwiGLU
    width that lands nearest it (8e9 gives 8B's own shape). Stated in the plan: the shape sets
    the units and the activations."""
    from fsdp_lab.models import LlamaConfig, llama_param_count

    def config(k: int) -> Any:
        kv_heads = max(d for d in range(1, max(1, k // 4) + 1) if k % d == 0)  # groups whole
        return LlamaConfig(
            vocab_size=128256, dim=128 * k, n_layers=k, n_heads=k, n_kv_heads=kv_heads,
            ffn_dim=448 * k, seq_len=1,
        )  # fmt: skip

    k, step = 1, 1
    while llama_param_count(config(k + step)) < count:  # gallop, then bisect: k to ~2,000
        k, step = k + step, step * 2
    while step > 1:
        step //= 2
        if llama_param_count(config(k + step)) < count:
            k += step
    near = config(min((k, k + 1), key=lambda j: abs(llama_param_count(config(j)) - count)))
    # then the SwiGLU width (a multiple of 256, as Llama rounds it) that lands nearest the count
    per_width = 3 * near.dim * near.n_layers  # parameters per unit of ffn_dim
    width = near.ffn_dim + (count - llama_param_count(near)) / per_width
    return replace(near, ffn_dim=max(256, round(width / 256) * 256))


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
    if name.endswith(TWIN):  # the twin at the sequence asked for (its default cache is 64)
        return replace(twin_config(config), seq_len=seq)
    return config


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
    count = parameter_count(name)
    if count is not None:  # a bare count: the stated shape
        config = replace(count_config(count), seq_len=seq)
    else:
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


@functools.lru_cache(maxsize=16)
def built_units(model: str, seq: int) -> tuple[tuple, tuple, tuple | None, int | None]:
    """(unit name, numel) in wrap order, the root first; (parameter tensors, the largest one's
    numel); the Llama's shape; the vocabulary it declares (None: none).
    Cached: building 405B's 126 blocks on meta takes seconds, and a widget asks again."""
    count = parameter_count(model)
    if count is not None:  # the stated shape, counted as `Llama` holds it (a 1e15 model is
        from fsdp_lab.models import llama_param_count  # 1,676 blocks: too many to build)

        c = count_config(count)
        one, two = (llama_param_count(replace(c, n_layers=n)) for n in (1, 2))
        block = two - one  # one block's parameters, by the model's own count
        units = (("", one - block),) + tuple((f"layers.{i}", block) for i in range(c.n_layers))
        tensors = 3 + 9 * c.n_layers  # embedding, final norm, head; 7 linears + 2 norms each
        largest = max(c.vocab_size, c.ffn_dim) * c.dim
        return units, (tensors, largest), _shape(c), c.vocab_size
    if ":" in model:  # the user's code: built in a child process, within a time limit
        return built_elsewhere(model, seq)
    return units_of_built(model, seq)


def units_of_built(model: str, seq: int) -> tuple[tuple, tuple, tuple | None, int | None]:
    """`built_units` of a model built here, on meta (a factory: in `built_elsewhere`'s child)."""
    from torch import nn

    from fsdp_lab.sharding.wrap import build_plan

    built = build_on_meta(model, seq)
    if not isinstance(built, nn.Module):
        raise ValueError(
            f"--model {model!r}: the factory returned {type(built).__name__}, not a "
            "torch.nn.Module. Fix: return the model it builds"
        )
    if next(built.parameters(), None) is None:
        raise ValueError(f"--model {model!r}: the model has no parameters: nothing to plan")
    wrap = build_plan(built, block_classes(built) or None)
    params = dict(built.named_parameters(remove_duplicate=True))
    units = tuple(
        (name, sum(params[r.name].numel() for r in wrap.params[name])) for name in wrap.units
    )
    config = getattr(built, "config", None)
    shape = _shape(config) if hasattr(config, "ffn_dim") else None  # the lab's Llama: a formula
    vocab = getattr(built, "vocab_size", None) or getattr(config, "vocab_size", None)
    largest = max((p.numel() for p in params.values()), default=0)
    return units, (len(params), largest), shape, vocab


def _shape(config: Any) -> tuple:
    """What `theory.llama_activation_bytes` needs of a `LlamaConfig` (hashable: cached)."""
    return (
        ("dim", config.dim),
        ("ffn_dim", config.ffn_dim),
        ("n_heads", config.n_heads),
        ("kv_dim", config.n_kv_heads * config.head_dim),
        ("n_layers", config.n_layers),
        ("vocab_size", config.vocab_size),
    )


def built_elsewhere(spec: str, seq: int) -> tuple:
    """`built_units` of a ``module:factory``, run in a child Python: a factory that
    hangs, exits the process or crashes the interpreter costs a ValueError naming it, not the
    caller's process (the child gets `BUILD_TIME_LIMIT_S`)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or "." for p in sys.path)}
    fail = f"--model {spec!r}: building it on the meta device"
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp_lab.planning.models", spec, str(seq)],
            capture_output=True,
            text=True,
            timeout=BUILD_TIME_LIMIT_S,
            env=env,
        )
    except subprocess.TimeoutExpired:
        raise ValueError(
            f"{fail} did not finish in {BUILD_TIME_LIMIT_S} s. Fix: a factory that only creates "
            "modules (no waiting, downloading or loops over data)"
        ) from None
    lines = proc.stdout.strip().splitlines()
    answer = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None
    if answer is None:
        last = (proc.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(
            f"{fail} ended the process (exit code {proc.returncode}) without an answer: "
            f"{last[:300]}. Fix: a factory that returns its model (no os._exit, no sys.exit)"
        )
    if "error" in answer:
        raise ValueError(answer["error"])
    shape = tuple(tuple(pair) for pair in answer["shape"]) if answer["shape"] else None
    units = tuple(map(tuple, answer["units"]))
    return units, tuple(answer["tensors"]), shape, answer["vocab"]


if __name__ == "__main__":  # the child of `built_elsewhere`: one JSON line
    try:
        units, tensors, shape, vocab = units_of_built(sys.argv[1], int(sys.argv[2]))
        reply = {"units": units, "tensors": tensors, "shape": shape, "vocab": vocab}
    except ValueError as exc:
        reply = {"error": str(exc)}
    print(json.dumps(reply))
