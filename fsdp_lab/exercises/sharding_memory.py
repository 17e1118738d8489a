"""Exercise of the sharding lab: free the gathered parameters after forward, for real, and
gather them again before backward (`free_and_regather`).

ZeRO-3's memory saving is this step: each unit's full parameters exist only while the unit
computes. The learner's function runs inside the real unit (`ShardingState.free_and_regather`:
post-forward and pre-backward) while a `MemoryTracker` measures the gathered buffers' bytes,
beside the same training with the reference step. The classic bugs: never freeing (deleting
the name frees nothing: autograd holds views of the buffer; the memory trace never drops
after a forward), freeing without gathering again (backward fails on a 0-byte storage), and
allocating the storage back without gathering into it (backward computes with zeros).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_lab.exercises.exercise import Bug, Case, Exercise, Mismatch
from fsdp_lab.exercises.judging import close, series_of
from fsdp_lab.models import MLPBlock, MLPStack, synthetic_batch
from fsdp_lab.reference import local_slice
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.sharding.unit import free_and_regather as _mechanism_step
from fsdp_lab.trace import MemoryTracker, category

STEPS = 2
LR = 0.5


def free_and_regather(buffer: torch.Tensor, moment: str, all_gather: Callable[[], None]) -> None:
    """Reference: the mechanism's own step (storage resized to 0; all_gather before backward)."""
    _mechanism_step(buffer, moment, all_gather)


def _del_buffer(buffer: torch.Tensor, moment: str, all_gather: Callable[[], None]) -> None:
    if moment == "post-forward":
        del buffer  # the name goes; the unit and autograd's saved views keep the storage
    else:
        all_gather()


def _no_regather(buffer: torch.Tensor, moment: str, all_gather: Callable[[], None]) -> None:
    if moment == "post-forward":
        buffer.untyped_storage().resize_(0)


def _alloc_zeros(buffer: torch.Tensor, moment: str, all_gather: Callable[[], None]) -> None:
    if moment == "post-forward":
        buffer.untyped_storage().resize_(0)
    elif buffer.untyped_storage().nbytes() == 0:  # the bytes back, but nothing gathered
        buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())
        buffer.data.zero_()


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
    torch.manual_seed(0)
    model = MLPStack(vocab_size=16, dim=case.params["dim"], n_layers=case.params["layers"])
    shard(model, units={MLPBlock}, strategy="full", prefetch=False, mesh=dist.group.WORLD)
    state = sharding_state(model)
    sums: dict[int, float] = {}  # per buffer: its values at the end of its forward
    seen: list[tuple[str, str]] = []  # (unit, what its buffer held when its backward began)
    label_of = {id(u.flat.unsharded): u.label for u in state.units}

    own_error: list[BaseException] = []  # raised by the learner's function: not autograd's

    def watched(buffer: torch.Tensor, moment: str, all_gather: Callable[[], None]) -> None:
        if moment == "post-forward":
            sums[id(buffer)] = float(torch.sum(buffer.detach(), dtype=torch.float64))
        try:
            step(buffer, moment, all_gather)
        except BaseException as exc:
            own_error.append(exc)
            raise
        if moment == "pre-backward":
            seen.append((label_of[id(buffer)], _held(buffer, sums.pop(id(buffer), None))))

    state.free_and_regather = watched  # the injection point: post-forward and pre-backward
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


def judge(got_all: list[Any], expected: list[Any], case: Case) -> Mismatch | None:
    for r, (got, exp) in enumerate(zip(got_all, expected, strict=True)):
        held = dict(got["held"])
        wrong = [(u, h) for u, h in got["held"] if h != "the gathered parameters"]
        if got["error"]:
            unit, what = wrong[0] if wrong else ("?", "?")
            return Mismatch(
                f"backward failed on rank {r}: {got['error']}",
                rows=[(f"buffer of {unit} as its backward began", "the gathered parameters", what)],
                hint="your post-forward freed the buffer, but pre-backward did not gather it "
                "again: backward's saved views read that storage — call all_gather() there.",
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
                        _first(exp["first_grad"]),
                        _first(got["first_grad"]),
                    ),
                ],
                hint="allocating the storage again gives bytes, not values: all_gather() both "
                "allocates the buffer and fills it with every rank's shard.",
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
                    "memory marker",
                    "bytes",
                    {
                        "reference": [b for _, b in exp["markers"]],
                        "yours": [b for _, b in got["markers"]],
                    },
                    in_bytes=True,
                ),
            )
    return None


def _first(values: list[float]) -> str:
    return ", ".join(f"{v:.4g}" for v in values[:3])


FREE_AND_REGATHER = Exercise(
    name="free_and_regather",
    lab="shard",
    title="Free the gathered parameters after forward, gather them again before backward",
    statement=(
        "ZeRO-3 keeps each unit's full parameters only while the unit computes. After a unit's "
        "forward, its gathered flat buffer `buffer` must be **freed for real**, but autograd "
        "saved views of it for backward, so the tensor itself must survive: only its memory "
        "goes. Before the unit's backward, the full parameters must be back. Write "
        '`free_and_regather(buffer, moment, all_gather)`: when `moment == "post-forward"`, '
        'release the buffer\'s bytes; when `moment == "pre-backward"`, make the parameters '
        "available again — `all_gather()` allocates the buffer's storage and fills it with "
        "every rank's shard. The check trains a sharded MLP without prefetch and measures the "
        "buffers' bytes with `fsdp_lab.trace.MemoryTracker`."
    ),
    stub=(
        "def free_and_regather(buffer, moment, all_gather):\n"
        '    """moment "post-forward": free buffer\'s memory, keep the tensor.\n'
        '    moment "pre-backward": gather the full parameters again. Returns None."""\n'
    ),
    hints=(
        "A tensor's bytes live in its storage (`buffer.untyped_storage()`); the views autograd "
        "saved share that storage, so `del buffer` frees nothing.",
        "A storage can be resized in place: to 0 bytes now, and back to full size by "
        "`all_gather()` later — the saved views then read the gathered values.",
        "post-forward: `buffer.untyped_storage().resize_(0)`; pre-backward: `all_gather()`.",
    ),
    solution=free_and_regather,
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
            "no-regather",
            "frees before backward, never gathers again",
            _no_regather,
            "backward fails: the views it saved point into a storage of 0 bytes",
        ),
        Bug(
            "alloc-zeros",
            "allocates the storage again without gathering",
            _alloc_zeros,
            "backward runs, but with zeros where the parameters should be: wrong gradients",
        ),
    ),
    points=2,
    minutes=15,
)
