"""A model's init, watched call by call: what it is, which modules it touches, in which order.

Seeding a pipeline (`fsdp_lab.pipeline.rng`) runs the model's own init on every stage, over the
whole model with only the stage's modules real — the others stay on the meta device, where
``nn.init`` draws nothing and writes nothing. It needs three things from that init, for any
model:

- what the init *is* (`model_init`): ``init(model)`` if one is given; else the model's
  ``init_weights()`` (torchtitan's convention, and `PipeGPT`'s); else ``reset_parameters()`` of
  every module that owns a parameter or a buffer, in ``named_modules()`` order — for PyTorch's
  own layers the very calls their constructors made, in the same order, so
  ``manual_seed(s); model = Model()`` and ``model = Model(); manual_seed(s); init(model)``
  give the same values (a test checks it).
- the order in which it touches modules (`watch_init`; `record_init_order` on a meta copy): a
  ``TorchFunctionMode`` (`OwnerWatch`) sees every ``nn.init`` function and tensor method together
  with the tensor it is applied to, and notes the module that owns that tensor — on meta
  tensors too, where nothing is drawn, so every rank sees the same calls. `check_touched` then
  checks that the init touched every parameter and buffer of every stage: one it leaves alone
  keeps whatever memory ``to_empty`` gave it — silently wrong numbers.
- `materialise`: make some modules real (``to_empty``), a tied Parameter made once.

A strategy of `fsdp_lab.pipeline.rng` then does, on every rank: `prepare` (the whole model on
meta, the split checked, the init found — no message yet), `own_stage` (this stage's modules
made real), `run_init` (the init over the whole model, watched, every stage's tensors checked
touched), and cuts the stage out with `fsdp_lab.pipeline.stages.build_stage`.

Assumed of an init, as torchtitan's and PipeGPT's are written: it draws straight into the
tensors (``nn.init.normal_(w)``, ``w.uniform_()``), not into a temporary copied in later, and it
makes the same calls whatever device a module is on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig
from fsdp_lab.pipeline.probe import meta_copy
from fsdp_lab.pipeline.split import plan_stages
from fsdp_lab.pipeline.stages import StageInfo, StagePlan, StageSpec

InitFn = Callable[[nn.Module], None]
Model = PipeGPTConfig | nn.Module  # a PipeGPT's config, or any whole model (best on meta)
Stages = Sequence[Sequence[str]] | StagePlan | None


# Ops that only write values into the tensor they are given: on a meta tensor there is nothing
# to compute (and PyTorch's meta kernel for normal_ is a Python decomposition, ~1 ms a call).
_VALUE_FILLS = frozenset(
    {"normal_", "uniform_", "fill_", "zero_", "exponential_", "log_normal_", "cauchy_"}
    | {"geometric_", "random_", "bernoulli_"}
)


def _fills_values(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return getattr(func, "__module__", None) == "torch.nn.init" or name in _VALUE_FILLS


class OwnerWatch(TorchFunctionMode):
    """Calls ``on_touch(module_name, tensor_id)`` before every op applied to a tensor in
    `owner_of` (id of a tensor -> name of the module holding it). A fill (``nn.init.*``,
    ``normal_``, ``uniform_``, ...) of a meta tensor is noted and skipped: nothing to draw."""

    def __init__(self, owner_of: dict[int, str], on_touch: Callable[[str, int], None]) -> None:
        super().__init__()
        self.owner_of, self.on_touch = owner_of, on_touch

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        # nn.init functions pass the tensor by keyword (``tensor=``), Tensor methods as self.
        for t in (*args, *kwargs.values()):
            if id(t) in self.owner_of:
                self.on_touch(self.owner_of[id(t)], id(t))
                break
        target = kwargs.get("tensor", args[0] if args else None)
        if isinstance(target, torch.Tensor) and target.is_meta and _fills_values(func):
            return target  # what the fill returns: the tensor it filled
        return func(*args, **kwargs)


def owners(model: nn.Module) -> dict[int, str]:
    """id of every parameter and buffer -> the name of the module that holds it directly."""
    return {
        id(t): name
        for name, m in model.named_modules()
        for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))
    }


def _owns_tensors(module: nn.Module) -> bool:
    return any(True for _ in (*module.parameters(recurse=False), *module.buffers(recurse=False)))


@torch.no_grad()
def reset_every_module(model: nn.Module) -> None:
    """``reset_parameters()`` of every module that owns a tensor, in ``named_modules()`` order."""
    for _, module in model.named_modules():
        if _owns_tensors(module):
            module.reset_parameters()


def model_init(model: nn.Module, init: InitFn | None = None) -> InitFn:
    """The init to run on the whole model (see the module docstring), checked to exist."""
    if init is not None:
        if not callable(init):
            raise TypeError(f"init={init!r}: expected a function of the whole model")
        return init
    if callable(getattr(model, "init_weights", None)):
        return lambda m: m.init_weights()
    missing = [
        f"{name or '<root>'} ({type(m).__name__})"
        for name, m in model.named_modules()
        if _owns_tensors(m) and not callable(getattr(m, "reset_parameters", None))
    ]
    if missing:
        raise ValueError(
            f"{type(model).__name__} has no init_weights(), and {missing[:4]} own parameters "
            "or buffers but have no reset_parameters(): there is no init a stage could run. "
            "Fix: pass init=<a function that initialises the whole model from the global "
            "RNG>, or give the model an init_weights() (torchtitan's convention)"
        )
    return reset_every_module


def watch_init(
    model: nn.Module, init: InitFn, on_touch: Callable[[str], None] | None = None
) -> tuple[list[str], set[int]]:
    """Run `init` on `model` (meta, real, or both mixed), watched: (the modules it touches, in
    order, consecutive repeats merged; ids of every tensor touched). `on_touch(module_name)`
    is called before each op, so it may act before a value is drawn (rng_replay does)."""
    order: list[str] = []
    touched: set[int] = set()

    def note(name: str, tensor_id: int) -> None:
        touched.add(tensor_id)
        if not order or order[-1] != name:
            order.append(name)
        if on_touch is not None:
            on_touch(name)

    with torch.no_grad(), OwnerWatch(owners(model), note):
        init(model)
    return order, touched


def record_init_order(model: nn.Module, init: InitFn | None = None) -> list[str]:
    """The modules the init (`model_init`) touches, in the order it does (run on meta).

    Args:
        model: a whole model on the meta device (nothing is drawn or written there).
        init: the init to watch; default the model's own (`model_init`).
    """
    tensors = [*model.parameters(), *model.buffers()]
    if not tensors or not all(t.is_meta for t in tensors):
        raise ValueError("record_init_order runs the init on a model built on meta")
    return watch_init(model, model_init(model, init))[0]


def check_touched(model: nn.Module, plan: StagePlan, touched: set[int]) -> None:
    """Raise unless the init touched every parameter and buffer the stages own.

    Run after an init over the whole model (its untouched part on meta), it gives the same
    answer on every rank: each saw the same calls."""
    left = [
        name
        for name, t in (*model.named_parameters(), *model.named_buffers())
        if plan.stage_of(name) is not None and id(t) not in touched
    ]
    if left:
        more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
        raise ValueError(
            f"the init of {type(model).__name__} never touches {left[:5]}{more}: built on meta "
            "and made real with to_empty, they would keep whatever memory was there. Fix: "
            "make the init set them (torchtitan's init_weights() recomputes its rotary "
            "table), or pass init=<a function that does>"
        )


def materialise(modules: Iterable[nn.Module], device: torch.device | str) -> None:
    """``to_empty`` for these modules (values: garbage until the init), a tie made once."""
    made: dict[int, torch.Tensor] = {}
    for module in modules:
        for sub in module.modules():
            for key, p in list(sub.named_parameters(recurse=False)):
                if not p.is_meta:
                    continue  # real already (a module shared by two of `modules`)
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(_empty_on(p, device), p.requires_grad)
                setattr(sub, key, made[id(p)])
            for key, b in list(sub.named_buffers(recurse=False)):
                if not b.is_meta:
                    continue
                if id(b) not in made:
                    made[id(b)] = _empty_on(b, device)
                setattr(sub, key, made[id(b)])


def _empty_on(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    # A meta tensor's twin on `device`, same shape, strides and dtype. Not
    # ``empty_like(t, device=...)``: from meta that runs a Python decomposition whose first call
    # imports sympy (seconds on every rank), for what is one allocation.
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)


# -- a stage's share of the init (`fsdp_lab.pipeline.rng`'s four strategies all use these) ----


def whole_on_meta(model: Model) -> nn.Module:
    """The whole model on the meta device: `PipeGPT(config)` built there, or a meta copy."""
    if isinstance(model, PipeGPTConfig):
        with torch.device("meta"):
            return PipeGPT(model)
    if isinstance(model, nn.Module):
        return meta_copy(model)  # the caller's model is left as it is
    raise TypeError(
        f"model={type(model).__name__}: expected a PipeGPTConfig or the whole nn.Module to "
        "seed (its values are not used; build it on meta: with torch.device('meta'): ...)"
    )


def prepare(
    model: Model,
    info: StageInfo,
    layers_per_stage: list[int] | None,
    stages: Stages,
    init: InitFn | None,
) -> tuple[nn.Module, StagePlan, InitFn]:
    """(whole model on meta, the checked split, the init); no message sent."""
    whole = whole_on_meta(model)
    # The split is checked on the model as given: one with values is probed for real (cheap,
    # and its forward compared), a meta one on meta.
    given = whole if isinstance(model, PipeGPTConfig) else model
    plan = plan_stages(given, info.stages if stages is None else stages, layers_per_stage)
    held = plan.layers(info.stage)
    if plan.stages != info.stages or (info.layers and held != list(info.layers)):
        raise ValueError(
            f"the split has {plan.stages} stages (stage {info.stage} holds layers {held}), but "
            f"the StageInfo is for stage {info.stage} of {info.stages} owning layers "
            f"{list(info.layers)}: build both from the same stages and layers_per_stage"
        )
    return whole, plan, model_init(whole, init)


def own_stage(
    whole: nn.Module, plan: StagePlan, info: StageInfo, device: torch.device | str
) -> StageSpec:
    """Make this stage's modules real (values: garbage until the init); the rest stay meta."""
    spec = StageSpec(plan, info.stage)
    materialise((whole.get_submodule(n) for n in spec.names), device)
    return spec


def run_init(
    whole: nn.Module,
    plan: StagePlan,
    init: InitFn,
    on_touch: Callable[[str], None] | None = None,
) -> None:
    """The init over the whole model, watched; every stage's tensors must have been touched."""
    _, touched = watch_init(whole, init, on_touch)
    check_touched(whole, plan, touched)  # the same verdict on every rank: all saw every call
