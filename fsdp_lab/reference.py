"""The references every from-scratch mechanism is checked against, on the same model and data.

- `train_steps`: the one training loop everyone uses — next-token cross-entropy on synthetic
  tokens; with N ranks each rank takes its contiguous slice of the same global batch, so the
  mean of the rank losses is the single-process loss on the whole batch.
- `SYSTEMS`, `wrap`, `make_optimizer`: the one table of systems every comparison trains
  through — ours per strategy and PyTorch's own (`fully_shard`, `FullyShardedDataParallel`,
  `DistributedDataParallel`, `ZeroRedundancyOptimizer`), each at its own defaults, wrapped
  with the same units.
- `single_process`: the run everything is compared with — one process, the whole batch.
- `full_parameters`: every parameter by its original name, gathered to full size, whatever
  wrapped the model — so two runs can be compared element by element (`max_abs_diff`).
"""

from __future__ import annotations

import difflib
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import is_fake

from fsdp_lab.cluster.where import device as placed_device
from fsdp_lab.model_spec import declared_vocab, vocab_size_of
from fsdp_lab.models import synthetic_batch
from fsdp_lab.sharding.state import sharding_state
from fsdp_lab.trace import category, compute_span, mark


def local_slice(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous share of a global batch (the batch must divide evenly)."""
    if t.shape[0] % world:
        raise ValueError(f"global batch {t.shape[0]} does not split evenly over {world} ranks")
    per = t.shape[0] // world
    return t[rank * per : (rank + 1) * per]


def require_values(model: nn.Module) -> None:
    """Raise a clear error if `model` still has parameters on the meta device (no values)."""
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ValueError(
            f"parameter {meta[0]!r} (and {len(meta) - 1} more) is on the meta device: it has a "
            "shape but no values to train or compare. Fix: materialise the model first — "
            "fsdp_lab.sharding.materialize.materialize(model) on one process, or "
            "fsdp_lab.shard(model, ...) on the ranks"
        )


def train_steps(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    steps: int,
    *,
    global_batch: int = 12,
    seq_len: int = 16,
    rank: int = 0,
    world: int = 1,
    device: torch.device | str = "cpu",
    clip: Callable[[], Any] | None = None,
    on_step: Callable[[int], Any] | None = None,
    vocab_size: int | None = None,
    micro_batches: int = 1,
) -> list[float]:
    """Train `steps` steps; returns this rank's local losses (their mean is the global loss).

    `micro_batches` > 1: gradient accumulation — each step runs that many forwards and
    backwards on batches of `global_batch` (the gradients summed) before one optimizer step.

    Token ids are drawn below `vocab_size`, by default `vocab_size_of(model)`: the model's
    ``vocab_size``, else its ``config.vocab_size`` (a wrapper that hides both, or a model that
    declares neither, passes it: `fsdp_lab.model_spec.check_model` measures it).
    """
    require_values(model)
    losses = []
    vocab = vocab_size if vocab_size is not None else vocab_size_of(model)
    for step in range(steps):
        for micro in range(micro_batches):
            batch = synthetic_batch(vocab, global_batch, seq_len, step * micro_batches + micro)
            x, y = (local_slice(t, rank, world).to(device) for t in batch)
            # Memory made by forward and backward is activations (and their gradients); the
            # tracker re-files parameter gradients by role at the next mark.
            with compute_span("forward"), category("activations"):
                logits = model(x)  # (B, T, V)
                loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
            mark(f"step {step} forward done")
            if micro == 0:  # later micro-batches add to the gradients
                optimizer.zero_grad(set_to_none=True)
            with category("activations"):
                loss.backward()
            mark(f"step {step} backward done")
        if clip is not None:
            clip()
        with compute_span("optimizer step"):
            optimizer.step()
        mark(f"step {step} optimizer step")
        # Under FakeTensorMode (fake ranks, `fsdp_lab.planning`) a loss has a shape, no value.
        losses.append(float("nan") if is_fake(loss) else loss.item())
        if on_step is not None:
            on_step(step)
    return losses


def single_process(
    factory: Callable[[], nn.Module],
    make_optimizer: Callable[[Any], torch.optim.Optimizer],
    steps: int,
    *,
    global_batch: int = 12,
    vocab_size: int | None = None,
    seq_len: int = 16,
) -> dict[str, torch.Tensor]:
    """`factory()` trained `steps` steps in this process on the whole global batch: the
    reference every distributed run of the same model and data must reproduce.

    Returns every parameter by name (a tied one under each of its names), detached copies.
    """
    model = factory()
    optimizer = make_optimizer(model.parameters())
    train_steps(
        model, optimizer, steps, global_batch=global_batch, vocab_size=vocab_size, seq_len=seq_len
    )
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest element-wise |a - b| over parameters with the same names (in float32).

    Different name sets are an error, not a silent partial comparison.
    """
    if set(a) != set(b):
        raise ValueError(f"parameter names differ: {sorted(set(a) ^ set(b))}")
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# [Note: one table of systems] Every comparison of ours with PyTorch's — the labs, the
# benchmarks, the parity table, the exercises — wraps its model here, so "fully_shard" means
# one thing everywhere: each system at its own defaults. Where a comparison needs another
# setting it is a system of its own, named here with its reason.
SYSTEMS: dict[str, str] = {
    "single": "one process, the whole global batch: the ground truth",
    "ours:none": "fsdp_lab.shard(strategy='none'): one unit, its gradients in DDP's buckets",
    "ours:optimizer": "fsdp_lab.shard(units, strategy='optimizer'): ZeRO-1",
    "ours:grad_op": "fsdp_lab.shard(units, strategy='grad_op'): ZeRO-2",
    "ours:full": "fsdp_lab.shard(units, strategy='full'): ZeRO-3, the root kept gathered",
    "ours:hybrid": "fsdp_lab.shard(units, strategy='hybrid', mesh=(R, S)): HSDP",
    "ours:hybrid_zero2": "fsdp_lab.shard(units, strategy='hybrid_zero2', mesh=(R, S))",
    "fully_shard": "fully_shard on every unit, then the root, at FSDP2's defaults: every unit "
    "but the root freed after forward",
    # FSDP2 has no ZeRO-1 or ZeRO-2 strategy; nothing freed between the passes is their shape.
    "fully_shard:keep": "fully_shard, reshard_after_forward=False: nothing freed between passes",
    # FSDP2 has no NO_SHARD: a (N, 1) replicate x shard mesh is HSDP with one-rank shard groups.
    "fully_shard:replicate": "fully_shard on an (N, 1) mesh: plain replication (DDP's maths)",
    # use_orig_params=True (FSDP1's default is False): ours keeps the original parameters by
    # default, as FSDP2 does, so optimizer groups by name work alike.
    "fsdp1": "FullyShardedDataParallel, FULL_SHARD, a unit per module, use_orig_params=True",
    "fsdp1:SHARD_GRAD_OP": "FullyShardedDataParallel, SHARD_GRAD_OP (ZeRO-2)",
    "fsdp1:NO_SHARD": "FullyShardedDataParallel, NO_SHARD (deprecated for DDP)",
    "ddp": "DistributedDataParallel at its defaults (25 MiB buckets)",
    "ddp+zero": "DistributedDataParallel + ZeroRedundancyOptimizer (ZeRO-1 as an optimizer)",
}

# Module classes, module names, or tuples of names (one unit of several modules).
Units = tuple[Any, ...] | list[Any] | set[Any]
HYBRID_FSDP1 = ("fsdp1:HYBRID_SHARD", "fsdp1:_HYBRID_SHARD_ZERO2")
ONE_UNIT = ("ours:none", "ddp", "ddp+zero")  # DDP's shape: no units to choose


def wrap(
    model: nn.Module,
    system: str,
    units: Units = (),
    mesh: Any = None,
    own_options: dict[Any, dict[str, Any]] | None = None,
    **options: Any,
) -> nn.Module:
    """`model` wrapped by `system` (one of `SYSTEMS`) with a unit per module of `units` (module
    classes, or module names and tuples of names: one unit of several modules); the wrapped
    model, to train with `make_optimizer(system, ...)`.

    `mesh`: None (every rank), a DeviceMesh, or for ours and fully_shard (R, S) — a 2-D
    (replicate, shard) mesh makes them HSDP; FSDP1's hybrid strategies need one. `options` are
    the system's own keywords — `fsdp_lab.shard`'s (a lab's prefetch, policies, offload),
    every `fully_shard` call's (mp_policy), `DistributedDataParallel`'s — where a lab says why.
    `own_options` (fully_shard only) replace some of them for the units of a class or a name
    ("" the root): FSDP2 takes its settings per call, ours per unit (`policies=`).
    """
    if not isinstance(system, str):
        raise ValueError(f"system={system!r}: expected a name, one of {list(SYSTEMS)}")
    kind, option = system.partition(":")[::2]
    if system not in SYSTEMS and system not in HYBRID_FSDP1:
        near = difflib.get_close_matches(system.lower(), [*SYSTEMS, *HYBRID_FSDP1], n=1)
        raise ValueError(
            f"system={system!r}: expected one of {list(SYSTEMS)} or {list(HYBRID_FSDP1)}"
            + (f". Fix: {near[0]!r}" if near else "")
        )
    _check_wrap(system, units, mesh, own_options, options)
    if kind == "single":
        return model
    if kind == "ours":
        from fsdp_lab.sharding import shard

        return shard(model, units=units or None, strategy=option, mesh=mesh, **options)
    if kind in ("fully_shard", "fsdp1"):
        modules = _unit_modules(model, units, allow_groups=kind == "fully_shard")
        if kind == "fsdp1":
            return _fsdp1(model, [m for m, _ in modules], option or "FULL_SHARD", mesh, options)
        return _fully_shard(model, modules, option, mesh, options, own_options or {})
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, **options)
    _keep_vocab(ddp, model)
    return ddp


def _check_wrap(
    system: str, units: Units, mesh: Any, own: dict | None, options: dict[str, Any]
) -> None:
    """What `system` cannot take, refused rather than ignored."""
    if isinstance(units, (str, type)) or not isinstance(units, (tuple, list, set)):
        fix = f"units=({units!r},)" if isinstance(units, (str, type)) else "units=()"
        raise ValueError(
            f"units={units!r}: expected a tuple, list or set of module classes or names. Fix: {fix}"
        )
    if system == "single" and options:
        raise ValueError(
            f"'single' is the model itself and takes no options; got {sorted(options)}"
        )
    if isinstance(mesh, list):
        raise ValueError(f"mesh={mesh!r}: expected None, a DeviceMesh or a tuple (R, S)")
    if units and system in ONE_UNIT + ("single",):
        raise ValueError(
            f"{system!r} takes no units (one process, or DDP's shape: the whole model one "
            f"unit); got units={units!r}. Fix: leave units out"
        )
    one_dim = system.startswith(("ddp", "single", "fully_shard:replicate")) or system in (
        "fsdp1", "fsdp1:SHARD_GRAD_OP", "fsdp1:NO_SHARD",
    )  # fmt: skip
    if mesh is not None and one_dim:
        raise ValueError(f"{system!r} takes no mesh (it runs on every rank); got mesh={mesh!r}")
    if mesh is None and system in HYBRID_FSDP1:
        raise ValueError(f"{system!r} needs a 2-D (replicate, shard) DeviceMesh. Fix: mesh=...")
    if own and not system.startswith("fully_shard"):
        raise ValueError(
            f"own_options are fully_shard's per-call settings; {system!r} takes none. Fix: "
            "for ours, policies={unit or class: UnitPolicy(...)}"
        )
    if system == "fully_shard:keep" and "reshard_after_forward" in options:
        raise ValueError(
            '"fully_shard:keep" sets reshard_after_forward=False itself. Fix: "fully_shard" '
            "with your reshard_after_forward"
        )


def make_optimizer(
    system: str, params: Any, optimizer_class: type[torch.optim.Optimizer], **kwargs: Any
) -> torch.optim.Optimizer:
    """`optimizer_class(params, **kwargs)`, or, for "ddp+zero", PyTorch's
    ZeroRedundancyOptimizer stepping it (each parameter's state on one rank)."""
    if system not in SYSTEMS and system not in HYBRID_FSDP1:
        raise ValueError(f"system={system!r}: expected one of {list(SYSTEMS)}")
    if system != "ddp+zero":
        return optimizer_class(params, **kwargs)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **kwargs)


def _unit_modules(model: nn.Module, units: Units, allow_groups: bool) -> list[tuple[Any, str]]:
    """(the unit's module — a list of them for a tuple of names —, its name or class name),
    each unit after the units inside it (reversed pre-order), as fully_shard requires."""
    names = {m: n for n, m in model.named_modules()}
    order = {m: i for i, m in enumerate(names)}
    classes = tuple(u for u in units if isinstance(u, type))
    if classes and len(classes) != len(units):
        raise ValueError(
            f"units={units!r} mixes module classes and names. Fix: one kind — classes, or "
            "names (and tuples of names)"
        )
    found: list[tuple[Any, str]] = [
        (m, type(m).__name__) for m in order if m is not model and isinstance(m, classes)
    ]
    missing = [c.__name__ for c in classes if not any(isinstance(m, c) for m in order)]
    for unit in [] if classes else units:
        group = (unit,) if isinstance(unit, str) else unit
        if not isinstance(group, tuple) or not all(isinstance(n, str) for n in group):
            raise ValueError(f"units: {unit!r} is neither a module class, a name nor a tuple")
        if isinstance(unit, tuple) and not allow_groups:
            raise ValueError(f"units: {unit!r}: FSDP1 has no unit of several modules")
        if "" in group:
            raise ValueError("units: '' is the root, a unit already. Fix: leave it out")
        bad = [n for n in group if n not in {*names.values()} - {""}]
        missing += bad
        if not bad:
            modules = [model.get_submodule(n) for n in group]
            found.append((modules if isinstance(unit, tuple) else modules[0], ", ".join(group)))
    if missing:
        raise ValueError(f"units: {missing} — no such module in {type(model).__name__}")
    first = lambda u: order[u[0][0] if isinstance(u[0], list) else u[0]]  # noqa: E731
    return sorted(found, key=first, reverse=True)


def _fully_shard(
    model: nn.Module,
    modules: list[tuple[Any, str]],
    option: str,
    mesh: Any,
    options: dict[str, Any],
    own: dict[Any, dict[str, Any]],
) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if option == "replicate":  # (N, 1): HSDP with one-rank shard groups (no mesh given)
        mesh = _as_mesh((dist.get_world_size(), 1))
    elif mesh is None:
        mesh = init_device_mesh(placed_device().type, (dist.get_world_size(),))
    else:  # a DeviceMesh, or (R, S) as ours takes it
        mesh = _as_mesh(mesh)
    if option == "keep":
        options = {**options, "reshard_after_forward": False}  # else FSDP2's default
    firsts = [m[0] if isinstance(m, list) else m for m, _ in modules]
    unknown = set(own) - {"", *(label for _, label in modules), *map(type, firsts)}
    if unknown:
        raise ValueError(f"own_options keys {sorted(map(str, unknown))} name no unit")
    for (module, label), first in zip(modules, firsts, strict=True):
        mine = own.get(type(first), own.get(label, {}))
        fully_shard(module, **{"mesh": mesh, **options, **mine})
    return fully_shard(model, **{"mesh": mesh, **options, **own.get("", {})})


def _fsdp1(
    model: nn.Module, modules: list[Any], strategy: str, mesh: Any, options: dict[str, Any]
) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy

    chosen = set(modules)
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=chosen.__contains__),
        sharding_strategy=ShardingStrategy[strategy],
        use_orig_params=True,
        device_id=placed_device(),  # its own GPU, a shared one, or the CPU
        **({"device_mesh": _as_mesh(mesh)} if "HYBRID" in strategy else {}),
        **options,
    )
    _keep_vocab(wrapped, model)
    return wrapped


def _as_mesh(mesh: Any) -> Any:
    """A DeviceMesh, from (R, S) as ours takes a mesh."""
    from fsdp_lab.sharding.mesh import device_mesh

    return device_mesh(*mesh) if isinstance(mesh, tuple) else mesh


def _keep_vocab(wrapper: nn.Module, model: nn.Module) -> None:
    # The wrapper hides the model's attributes from `vocab_size_of`: copy a declared vocab
    # (a model that declares none is trained with train_steps(..., vocab_size=)).
    declared = declared_vocab(model)
    if declared is not None:
        wrapper.vocab_size = declared[0]


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full-size copies of every parameter by original name (on CPU), whatever wrapped it."""
    require_values(model)
    if sharding_state(model, required=False) is not None:  # ours
        from fsdp_lab.sharding.state_dict import full_state_dict

        names = _param_names(model)
        full = full_state_dict(model, rank0_only=False)
        return {_clean(k): v.detach().cpu().clone() for k, v in full.items() if k in names}
    if hasattr(model, "_fsdp_wrapped_module") or type(model).__name__ == "FullyShardedDataParallel":
        from torch.distributed.fsdp import FullyShardedDataParallel

        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            named = model.named_parameters(remove_duplicate=False)
            return {_clean(k): p.detach().cpu().clone() for k, p in named}
    from torch.nn.parallel import DistributedDataParallel

    ddp = isinstance(model, DistributedDataParallel)
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):  # tied: both names
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # DTensor (FSDP2)
        out[_clean(name, ddp)] = full.detach().cpu().clone()
    return out


def _param_names(model: nn.Module) -> set[str]:
    return {
        name for unit in sharding_state(model).units for names in unit.aliases for name in names
    }


# Attributes PyTorch's wrappers put between a model and its parameters, as whole name
# components: FSDP1, `checkpoint_wrapper`, `torch.compile`. DDP adds one leading "module".
_WRAPPER_COMPONENTS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def _clean(name: str, ddp: bool = False) -> str:
    """The original name of a wrapped model's parameter.

    Only what a wrapper really adds is removed, and only as a whole component: a submodule the
    user called `module` (PyTorch's own `NestedWrappedModule` has one) or `submodule` keeps it.
    """
    parts = [p for p in name.split(".") if p not in _WRAPPER_COMPONENTS]
    if ddp and parts and parts[0] == "module":
        parts = parts[1:]
    return ".".join(parts)
