"""Exercise of the sharding lab: free the gathered parameters after forward, for real
(`free_unsharded`).

ZeRO-3's memory saving is this step: each unit's full parameters exist only while the unit
computes. The learner's function runs inside the real unit as its post-forward step
(`ShardingSteps.free_unsharded`; the mechanism's own `regather` brings the parameters back
before backward) while a `MemoryTracker` measures the gathered buffers' bytes, beside the same
training with the reference step. The classic bugs: never freeing (deleting the name frees
nothing: autograd holds views of the buffer; the memory trace never drops after a forward),
and zeroing the values instead of freeing the bytes (nothing is freed, and since the buffer
still looks gathered, backward computes with zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_lab.exercise import (
    Bug,
    Case,
    Exercise,
    Impossible,
    Mismatch,
    at_least,
    close,
    first_values,
    series_of,
)
from fsdp_lab.models import MLPBlock, MLPStack, synthetic_batch
from fsdp_lab.reference import local_slice
from fsdp_lab.sharding import ShardingSteps, shard, sharding_state
from fsdp_lab.sharding.steps import free_unsharded as _mechanism_step
from fsdp_lab.sharding.steps import regather
from fsdp_lab.trace import MemoryTracker, category

STEPS = 2
LR = 0.5


def free_unsharded(buffer: torch.Tensor) -> None:
    """Reference: the mechanism's own step (the storage resized to 0 bytes)."""
    _mechanism_step(buffer)


def _del_buffer(buffer: torch.Tensor) -> None:
    del buffer  # the name goes; the unit and autograd's saved views keep the storage


def _zero_values(buffer: torch.Tensor) -> None:
    buffer.data.zero_()  # the bytes stay, the values go


# -- on every rank ---------------------------------------------------------------------------


def _held(buffer: torch.Tensor, before: float | None) -> str:
    """What `buffer` holds as its unit's backward begins, beside the sum of its values at the
    end of its forward (None: not freed after forward, as the root)."""
    if buffer.untyped_storage().nbytes() == 0:
        return "0 bytes (freed)"
    total = float(torch.sum(buffer.detach(), dtype=torch.float64))
    if before is None or abs(total - before) <= 1e-6 * max(1.0, abs(before)):
        return "the gathered parameters"
    return "zeros" if not bool(buffer.detach().any()) else "other values (garbage)"


def _train(step: Any, case: Case) -> dict:
    sums: dict[int, float] = {}  # per buffer: its values at the end of its forward
    seen: list[tuple[str, str]] = []  # (unit, what its buffer held when its backward began)
    label_of: dict[int, str] = {}  # buffer -> its unit's label, once sharded
    own_error: list[BaseException] = []  # raised by the learner's function: not autograd's

    def watched_free(buffer: torch.Tensor) -> None:
        sums[id(buffer)] = float(torch.sum(buffer.detach(), dtype=torch.float64))
        try:
            step(buffer)
        except BaseException as exc:
            own_error.append(exc)
            raise

    def watched_regather(buffer: torch.Tensor, all_gather: Callable[[], None]) -> None:
        regather(buffer, all_gather)  # the mechanism's own
        seen.append((label_of[id(buffer)], _held(buffer, sums.pop(id(buffer), None))))

    torch.manual_seed(0)
    model = MLPStack(vocab_size=16, dim=case.params["dim"], n_layers=case.params["layers"])
    # The injection point: every unit's post-forward free is the learner's step.
    steps = ShardingSteps(free_unsharded=watched_free, regather=watched_regather)
    shard(model, units={MLPBlock}, strategy="full", prefetch=False, mesh=dist.group.WORLD,
          steps=steps)  # fmt: skip
    state = sharding_state(model)
    label_of.update({id(u.flat.unsharded): u.label for u in state.units})
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    out: dict[str, Any] = {"held": seen, "error": None}
    with MemoryTracker() as mem:
        for unit in state.units:
            mem.track(unit.flat.unsharded, "comm_buffers")
        for unit in state.units[1:]:  # after each unit's own post-forward hook
            unit.module.register_forward_hook(
                lambda *_, label=unit.label: mem.mark(f"after forward {label}")
            )
        for k in range(STEPS):
            x, y = synthetic_batch(16, 12, 4, k)
            x, y = (
                local_slice(x, dist.get_rank(), dist.get_world_size()),
                local_slice(y, dist.get_rank(), dist.get_world_size()),
            )
            with category("activations"):
                loss = F.cross_entropy(model(x).reshape(-1, 16), y.reshape(-1))
            mem.mark(f"step {k + 1} forward done")
            optimizer.zero_grad(set_to_none=True)
            try:
                with category("activations"):
                    loss.backward()
            except RuntimeError as exc:
                if own_error:  # the learner's own exception: the checker shows its traceback
                    raise
                out["error"] = str(exc).splitlines()[0]  # autograd's, on freed parameters
                break
            mem.mark(f"step {k + 1} backward done")
            if k == 0:
                grad = torch.cat([u.flat_shard_grad() for u in state.units])
                out["first_grad"] = grad.tolist()
            optimizer.step()
    trace = mem.trace()
    where = {t: i for i, t in enumerate(trace["t"])}
    out["markers"] = [
        (m["label"], trace["bytes"]["comm_buffers"][where[m["t"]]])
        for m in trace["markers"]
        if m["label"].startswith(("after forward", "step "))
    ]
    return out


def trial(fn: Any, case: Case) -> dict:
    return _train(fn, case)


# -- in the notebook -------------------------------------------------------------------------


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB"


HELD = ("0 bytes (freed)", "the gathered parameters", "zeros", "other values (garbage)")


def _physical(got: dict, exp: dict) -> None:
    """What a run of this mechanism can have measured: the units and markers the reference
    measured, in its order; what a buffer held, one of `_held`'s words; at every marker, no
    fewer gathered bytes than the reference holds (it frees all a unit can)."""
    if [u for u, _ in got["held"]] != [u for u, _ in exp["held"]]:
        raise Impossible("the units whose backward began are not the mechanism's")
    if any(h not in HELD for _, h in got["held"]):
        raise Impossible("a buffer 'held' something no measurement says")
    if [label for label, _ in got["markers"]] != [label for label, _ in exp["markers"]]:
        raise Impossible("the memory markers are not the trial's")
    for (label, g), (_, e) in zip(got["markers"], exp["markers"], strict=True):
        at_least(g, e, f"gathered bytes {label}")


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, (got, exp) in enumerate(zip(got_all, expected, strict=True)):
        if not got["error"]:
            _physical(got, exp)
        held = dict(got["held"])
        wrong = [(u, h) for u, h in got["held"] if h != "the gathered parameters"]
        if got["error"]:
            unit, what = wrong[0] if wrong else ("?", "?")
            return Mismatch(
                f"backward failed on rank {r}: {got['error']}",
                rows=[(f"buffer of {unit} as its backward began", "the gathered parameters", what)],
                hint="backward reads the views it saved of the buffer: free its bytes with "
                "buffer.untyped_storage().resize_(0) and leave the tensor itself as it is.",
            )
        if not close(got["first_grad"], exp["first_grad"]):
            unit, what = wrong[0] if wrong else (next(iter(held), "?"), "?")
            kind = "zeros" if what == "zeros" else "garbage"
            return Mismatch(
                f"rank {r}'s gradients of step 1 are wrong: backward computed with {kind} where "
                f"the parameters should be (the buffer of {unit} held {what}).",
                rows=[
                    (f"buffer of {unit} as its backward began", "the gathered parameters", what),
                    (
                        "gradient, first values",
                        first_values(exp["first_grad"]),
                        first_values(got["first_grad"]),
                    ),
                ],
                hint="the buffer kept its bytes, so it still looks gathered and nothing gathers "
                "it again before backward: free the storage with "
                "buffer.untyped_storage().resize_(0) instead of changing its values.",
            )
        exp_fw = {lab: b for lab, b in exp["markers"] if lab.startswith("after forward")}
        got_fw = {lab: b for lab, b in got["markers"] if lab.startswith("after forward")}
        grown = [lab for lab in exp_fw if got_fw.get(lab, 0) > exp_fw[lab]]
        if grown:
            last = [lab for lab, _ in exp["markers"] if lab.endswith("forward done")][0]
            e_end, g_end = dict(exp["markers"])[last], dict(got["markers"])[last]
            return Mismatch(
                f"values right, but on rank {r} the gathered parameters are never freed after "
                f"forward: {_kib(g_end)} gathered at the end of forward, where the reference "
                f"holds {_kib(e_end)} (measured tensor storages).",
                rows=[
                    (f"gathered bytes {lab}", _kib(exp_fw[lab]), _kib(got_fw.get(lab, 0)))
                    for lab in grown[:3]
                ],
                hint="deleting or rebinding the name frees nothing (the unit and autograd's saved "
                "views keep the tensor alive): release its memory with "
                "buffer.untyped_storage().resize_(0).",
                series=series_of(
                    f"gathered parameters on rank {r}, {STEPS} steps",
                    "moment, in order: after each unit's forward, each step's forward and backward",
                    "memory",
                    {
                        "reference": [b for _, b in exp["markers"]],
                        "yours": [b for _, b in got["markers"]],
                    },
                    in_bytes=True,
                ),
            )
    return None


FREE_UNSHARDED = Exercise(
    name="free_unsharded",
    lab="shard",
    title="Free the gathered parameters after forward",
    statement=(
        "ZeRO-3 keeps each unit's full parameters only while the unit computes. After a unit's "
        "forward, its gathered flat buffer `buffer` must be **freed for real**, but autograd "
        "saved views of it for backward, so the tensor itself must survive: only its memory "
        "goes. Before the unit's backward the mechanism's own `regather` step calls "
        "`all_gather()`, which allocates the buffer's storage again and fills it with every "
        "rank's shard — when the storage is empty. Write `free_unsharded(buffer)`: release the "
        "buffer's bytes. The check trains a sharded MLP without prefetch and measures the "
        "buffers' bytes with `fsdp_lab.trace.MemoryTracker`."
    ),
    stub=(
        "def free_unsharded(buffer):\n"
        '    """Free buffer\'s memory after the unit\'s forward; keep the tensor. Returns None."""\n'
    ),
    hints=(
        "A tensor's bytes live in its storage (`buffer.untyped_storage()`); the views autograd "
        "saved share that storage, so `del buffer` frees nothing.",
        "A storage can be resized in place: to 0 bytes now, and back to full size by "
        "`all_gather()` before backward — the saved views then read the gathered values.",
        "`buffer.untyped_storage().resize_(0)`.",
    ),
    solution=free_unsharded,
    trial=trial,
    judge=judge,
    cases=(
        Case("2 ranks, an MLP of 3 blocks (a unit each), no prefetch", 2, {"dim": 8, "layers": 3}),
        Case("3 ranks, an MLP of 2 blocks, 2 steps", 3, {"dim": 8, "layers": 2}),
    ),
    bugs=(
        Bug(
            "never-frees",
            "never frees (del buffer)",
            _del_buffer,
            "the values are right, but every unit stays gathered until its backward: the memory "
            "trace climbs through the forward instead of dropping after each unit",
        ),
        Bug(
            "zeroes",
            "zeroes the values instead of freeing the bytes",
            _zero_values,
            "nothing is freed and the buffer still looks gathered, so backward runs with zeros "
            "where the parameters should be: wrong gradients",
        ),
    ),
    points=2,
    minutes=10,
)
