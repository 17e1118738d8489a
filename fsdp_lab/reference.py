"""The references every from-scratch mechanism is checked against, on the same model and data.

- `train_steps`: the one training loop everyone uses — next-token cross-entropy on synthetic
  tokens; with N ranks each rank takes its contiguous slice of the same global batch, so the
  mean of the rank losses is the single-process loss on the whole batch.
- `apply_ddp`, `apply_fsdp1`, `apply_fsdp2`: PyTorch's own data parallelism on that model
  (`DistributedDataParallel`, `FullyShardedDataParallel`, `fully_shard`), wrapped with the same
  units as ours.
- `single_process`: the run everything is compared with — one process, the whole batch.
- `full_parameters`: every parameter by its original name, gathered to full size, whatever
  wrapped the model — so two runs can be compared element by element (`max_abs_diff`).
"""

from __future__ import annotations

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


def _keep_vocab(wrapper: nn.Module, model: nn.Module) -> None:
    # The wrapper hides the model's attributes from `vocab_size_of`: copy a declared vocab
    # (a model that declares none is trained with train_steps(..., vocab_size=)).
    declared = declared_vocab(model)
    if declared is not None:
        wrapper.vocab_size = declared[0]


def apply_ddp(model: nn.Module) -> nn.Module:
    """PyTorch's DistributedDataParallel (gradients all-reduced in buckets)."""
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model)
    _keep_vocab(ddp, model)
    return ddp


def apply_fsdp2(
    model: nn.Module, unit_classes: tuple[type, ...], reshard: bool = True, mesh: Any = None
) -> nn.Module:
    """`fully_shard` on every module of `unit_classes`, then on the root (FSDP2's recipe).

    `mesh`: None (a 1-D mesh of every rank) or a DeviceMesh — a 2-D (replicate, shard) one
    makes it HSDP.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        mesh = init_device_mesh(placed_device().type, (dist.get_world_size(),))
    for module in model.modules():
        if isinstance(module, unit_classes):
            fully_shard(module, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model


def apply_fsdp1(
    model: nn.Module,
    unit_classes: tuple[type, ...],
    use_orig_params: bool = True,
    hybrid: str | None = None,
    mesh: Any = None,
) -> nn.Module:
    """FSDP1 (`FullyShardedDataParallel`) with a module-class auto-wrap policy; `hybrid`
    ("HYBRID_SHARD" or "_HYBRID_SHARD_ZERO2") on a 2-D (replicate, shard) DeviceMesh `mesh`."""
    from torch.distributed.fsdp import FullyShardedDataParallel, ShardingStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    device = placed_device()  # its own GPU, a shared one, or the CPU
    wrapped = FullyShardedDataParallel(
        model,
        auto_wrap_policy=ModuleWrapPolicy(set(unit_classes)),
        device_id=device,
        use_orig_params=use_orig_params,
        **({"sharding_strategy": ShardingStrategy[hybrid], "device_mesh": mesh} if hybrid else {}),
    )
    _keep_vocab(wrapped, model)
    return wrapped


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full-size copies of every parameter by original name (on CPU), whatever wrapped it."""
    require_values(model)
    if sharding_state(model, required=False) is not None:  # ours
        from fsdp_lab.sharding.state_dict import full_state_dict

        names = _param_names(model)
        full = full_state_dict(model, rank0_only=False)
        return {k: v.detach().cpu().clone() for k, v in full.items() if k in names}
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
