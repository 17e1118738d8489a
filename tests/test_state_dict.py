"""fsdp_lab.sharding.state_dict: full and sharded checkpoints, and clipping across shards.

Every check compares against the unsharded model (its `state_dict()`, single-process
`clip_grad_norm_`) or against an uninterrupted run, bit for bit where the arithmetic allows.
"""

from __future__ import annotations

import io
import json
import math
import os
from pathlib import Path

import psutil
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fsdp_lab import Cluster, RankError, comm, rank, world_size
from fsdp_lab.models import Block, TinyGPT, synthetic_batch, tiny_gpt
from fsdp_lab.reference import train_steps
from fsdp_lab.sharding import shard, sharding_state
from fsdp_lab.sharding import sharded_checkpoint as state_dict_module
from fsdp_lab.sharding.sharded_checkpoint import load_sharded, save_sharded
from fsdp_lab.sharding.state_dict import clip_grad_norm_, full_state_dict, load_full_state_dict


def _sharded(strategy: str = "full", seed: int | None = None, buffers: bool = False):
    """tiny_gpt (seed None) or the same architecture from another seed, sharded by Block."""
    if seed is None:
        model = tiny_gpt()
    else:
        torch.manual_seed(seed)
        model = TinyGPT()
    if buffers:  # one buffer state_dict() keeps, one it leaves out
        model.register_buffer("scale", torch.full((3,), float(seed or 0)))
        model.register_buffer("scratch", torch.zeros(2), persistent=False)
    return shard(model, units={Block}, strategy=strategy)


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- full_state_dict ----------------------------------------------------------------------------


def _full_state_dicts(strategy: str) -> dict:
    model = _sharded(strategy)
    with comm.CommLog() as log:
        sd = full_state_dict(model)
    everywhere = full_state_dict(model, rank0_only=False)
    units = sharding_state(model).units
    return {
        "sd": sd,
        "everywhere": everywhere,
        "tied": everywhere["tok_emb.weight"] is everywhere["head.weight"],
        "padding": [u.flat.padding for u in units],
        "padded_bytes": 4 * sum(u.flat.padded_numel for u in units),
        "bytes": log.bytes_by_op(),
    }


@pytest.mark.parametrize("strategy", ["full", "none"])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_full_state_dict_is_the_unsharded_state_dict(cluster_of, n, strategy):
    expected = tiny_gpt().state_dict()
    results = cluster_of(n).run(_full_state_dicts, strategy)
    for r, res in enumerate(results):
        assert res["tied"]
        assert list(res["everywhere"]) == list(expected)  # same keys, same order
        assert _equal(res["everywhere"], expected)
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in res["sd"].values())
        if r == 0:
            assert _equal(res["sd"], expected)
            assert res["sd"]["tok_emb.weight"] is res["sd"]["head.weight"]
            # Every other tensor owns its storage: torch.save writes each once, only the tie shared.
            ptrs = [t.untyped_storage().data_ptr() for t in res["sd"].values()]
            assert len(set(ptrs)) == len(ptrs) - 1
        else:
            assert res["sd"] == {}
        # Counted by comm: each rank receives the n-1 shards it lacks of every unit (ring).
        gathered = (n - 1) / n * res["padded_bytes"] if strategy == "full" else 0
        assert res["bytes"].get("all_gather_into_tensor", 0) == pytest.approx(gathered)
    if n == 3 and strategy == "full":  # 12704 and 2624 elements: both units need a pad element
        assert all(p > 0 for p in results[0]["padding"])


def _flat_round_trip() -> dict:
    """FSDP1's view (`use_orig_params=False`): the full state dict, then loaded back."""
    model = shard(tiny_gpt(), units={Block}, use_orig_params=False)
    sd = full_state_dict(model, rank0_only=False)
    mine = {n: p.detach().clone() for n, p in model.named_parameters()}  # this rank's shards
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    load_full_state_dict(model, sd)
    return {"sd": sd, "same_shards": _equal(mine, dict(model.named_parameters()))}


def test_the_flat_view_saves_and_loads_the_original_names(cluster_of):
    """On main the units' flat shards went in as extra keys ("flat_param", …: each rank's own),
    a plain model's dict was refused, and a round trip gave rank 1 rank 0's shards."""
    expected = tiny_gpt().state_dict()
    for res in cluster_of(2).run(_flat_round_trip):
        assert list(res["sd"]) == list(expected) and _equal(res["sd"], expected)
        assert res["same_shards"]


# -- load_full_state_dict -----------------------------------------------------------------------


def _train_then_round_trip() -> dict:
    r, n = rank(), world_size()
    model = _sharded()
    train_steps(
        model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2, rank=r, world=n
    )
    sd = full_state_dict(model)
    fresh = _sharded(seed=1)
    before = full_state_dict(fresh, rank0_only=False)
    load_full_state_dict(fresh, sd if r == 0 else None)
    x, _ = synthetic_batch(64, 4, 16, step=5)
    with torch.no_grad():  # the loaded model computes with the loaded values
        same_logits = torch.equal(model(x), fresh(x))
    return {"sd": sd, "before": before, "after": full_state_dict(fresh), "logits": same_logits}


def _load_into_other_world(sd: dict) -> dict:
    model = _sharded(seed=2, buffers=True)
    load_full_state_dict(model, sd if rank() == 0 else None)
    return full_state_dict(model, rank0_only=False)


def test_full_round_trip_after_training_keeps_values_and_the_tie(cluster_of, tmp_path):
    results = cluster_of(2).run(_train_then_round_trip)
    sd, after = results[0]["sd"], results[0]["after"]
    assert not torch.equal(sd["blocks.0.attn.qkv.weight"], tiny_gpt().blocks[0].attn.qkv.weight)
    assert not torch.equal(results[0]["before"]["tok_emb.weight"], sd["tok_emb.weight"])
    assert _equal(after, sd)
    assert all(res["logits"] for res in results)

    torch.save(after, tmp_path / "full.pt")
    loaded = torch.load(tmp_path / "full.pt", weights_only=True)
    assert _equal(loaded, sd)
    assert loaded["tok_emb.weight"].data_ptr() == loaded["head.weight"].data_ptr()

    # A full state dict fits any world size: reshard 2 -> 3 ranks (padding changes), buffers too.
    with_buffer = {**sd, "scale": torch.arange(3.0)}
    for got in cluster_of(3).run(_load_into_other_world, with_buffer):
        assert _equal(got, with_buffer)  # "scratch" (not persistent) is never in a state dict


def _load_bad_full(kind: str, catch: bool) -> str:
    model = _sharded()
    sd = full_state_dict(model) or None  # every rank gathers; rank 0 keeps
    if sd is not None and kind == "missing":
        del sd["ln_f.bias"]
        sd["ln_f.gain"] = torch.ones(32)
    elif sd is not None:
        sd["head.weight"] = sd["head.weight"] + 1.0  # breaks the tie
    untouched = [u.flat.shard.detach().clone() for u in sharding_state(model).units]
    try:
        load_full_state_dict(model, sd)
    except ValueError as exc:
        if not catch:
            raise
        shards = [u.flat.shard for u in sharding_state(model).units]
        assert all(torch.equal(a, b) for a, b in zip(untouched, shards, strict=True))
        return str(exc)
    return "no error"


def test_load_full_state_dict_errors_reach_every_rank(cluster_of):
    cluster = cluster_of(3)
    for msg in cluster.run(_load_bad_full, "missing", True):
        assert "'ln_f.bias'" in msg and "'ln_f.gain'" in msg and "Fix:" in msg
    for msg in cluster.run(_load_bad_full, "tie", True):
        assert "'tok_emb.weight'" in msg and "'head.weight'" in msg and "tied" in msg
    # Uncaught: the cluster reports it, and no rank was left waiting in a collective.
    with pytest.raises(RankError, match="ln_f.bias") as info:
        cluster.run(_load_bad_full, "missing", False)
    assert "still usable" in str(info.value)
    assert cluster.run(world_size) == [3, 3, 3]


# -- sharded checkpoints ------------------------------------------------------------------------


def _sharded_round_trip(folder: str, strategy: str) -> dict:
    r, n = rank(), world_size()

    def adam(model):
        return torch.optim.Adam(model.parameters(), lr=1e-2)

    model = _sharded(strategy)
    opt = adam(model)
    train_steps(model, opt, 3, rank=r, world=n)
    save_sharded(model, folder, opt)
    train_steps(model, opt, 2, rank=r, world=n)  # data of steps 0, 1 again: so will the resume
    uninterrupted = full_state_dict(model, rank0_only=False)

    fresh = _sharded(strategy, seed=1)
    fresh_opt = adam(fresh)
    load_sharded(fresh, folder, fresh_opt)
    train_steps(fresh, fresh_opt, 2, rank=r, world=n)
    resumed = full_state_dict(fresh, rank0_only=False)

    # The same without the optimizer state: Adam restarts and the run diverges.
    forgetful = _sharded(strategy, seed=1)
    forgetful_opt = adam(forgetful)
    load_sharded(forgetful, folder)
    train_steps(forgetful, forgetful_opt, 2, rank=r, world=n)

    mine = torch.load(_rank_files(Path(folder))[r], weights_only=True)
    return {
        "resumed_equal": _equal(resumed, uninterrupted),
        "forgetful_equal": _equal(full_state_dict(forgetful, rank0_only=False), uninterrupted),
        "saved_numel": sum(t.numel() for t in mine["shards"].values()),
        "shard_numel": sum(u.flat.shard_numel for u in sharding_state(model).units),
        "full_numel": sum(t.numel() for t in tiny_gpt().parameters()),
        "adam_steps": [s["step"].item() for s in mine["optimizer"]["state"].values()],
    }


@pytest.mark.parametrize(("n", "strategy"), [(2, "full"), (3, "grad_op")])
def test_sharded_checkpoint_resumes_training_bitwise(cluster_of, tmp_path, n, strategy):
    results = cluster_of(n).run(_sharded_round_trip, str(tmp_path), strategy)
    for res in results:
        assert res["resumed_equal"]
        assert not res["forgetful_equal"]
        assert res["adam_steps"] == [3.0] * len(res["adam_steps"])
        # Each file holds this rank's slice only: about 1/n of the model (+ padding).
        assert res["saved_numel"] == res["shard_numel"]
        assert res["full_numel"] / n <= res["saved_numel"] < res["full_numel"] / n + 8
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["world_size"] == n and meta["strategy"] == strategy
    _assert_only_the_checkpoint(tmp_path, n)


def _rank_files(folder: Path) -> list[Path]:
    """The checkpoint's rank files in rank order, wherever under `folder` the layout puts them."""
    return sorted(folder.rglob("rank*.pt"), key=lambda p: p.name)


def _assert_only_the_checkpoint(folder: Path, n: int) -> None:
    """meta.json, journal.json and one version folder of n rank files: no temp file, no stale
    version."""
    entries = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))  # dotfiles too
    versions = [e for e in entries if (folder / e).is_dir()]
    assert len(versions) == 1, entries
    (version,) = versions
    expected = ["journal.json", "meta.json", version,
                *(f"{version}/rank{r:05d}.pt" for r in range(n))]  # fmt: skip
    assert entries == sorted(expected)


def _save(folder: str, seed: int | None = None) -> None:
    model = _sharded(seed=seed)
    save_sharded(model, folder)


def _load_values(folder: str) -> dict:
    model = _sharded(seed=5)
    load_sharded(model, folder)
    return full_state_dict(model, rank0_only=False)


def _load_error(folder: str) -> str:
    """What load_sharded raised on this rank, as "TypeName: message" ("no error" if nothing)."""
    try:
        load_sharded(_sharded(seed=5), folder)
    except Exception as exc:  # any type: a wrong one must show up in the assertion
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _load_catching(folder: str) -> str:
    try:
        load_sharded(_sharded(), folder)
    except (ValueError, FileNotFoundError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_load_sharded_refuses_another_world_or_a_missing_folder(cluster_of, tmp_path):
    cluster_of(2).run(_save, str(tmp_path / "ckpt"))
    for msg in cluster_of(3).run(_load_catching, str(tmp_path / "ckpt")):
        assert msg.startswith("ValueError") and "2 ranks" in msg and "has 3" in msg
        assert "full state dict" in msg  # the fix
    missing = tmp_path / "nowhere"
    for msg in cluster_of(2).run(_load_catching, str(missing)):
        assert msg.startswith("FileNotFoundError") and str(missing) in msg
    (tmp_path / "ckpt" / "meta.json").unlink()  # an interrupted save: no commit marker
    for msg in cluster_of(2).run(_load_catching, str(tmp_path / "ckpt")):
        assert msg.startswith("FileNotFoundError") and "meta.json" in msg


def _save_killed_on_rank1(folder: str) -> None:
    """save_sharded of other values, but rank 1's process dies halfway through its file."""
    model = _sharded(seed=3)
    if rank() == 1:
        real_save = state_dict_module.torch.save

        def half_then_die(obj, f, *args, **kwargs) -> None:
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            Path(folder).with_name("half-written").touch()
            os._exit(9)  # no cleanup, no exception handler: as a kill -9 or a lost node

        state_dict_module.torch.save = half_then_die  # this process dies: nothing to restore
    save_sharded(model, folder)


def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(cluster_of, tmp_path):
    folder = tmp_path / "ckpt"
    cluster_of(2).run(_save, str(folder))  # checkpoint A: tiny_gpt's values
    a = tiny_gpt().state_dict()

    # Its own cluster: a rank dies, which stops all of its ranks (the shared one stays whole).
    cluster = Cluster(2, backend="gloo", timeout=30, verbose=False)
    pids = cluster.pids
    try:
        with pytest.raises(RankError):
            cluster.run(_save_killed_on_rank1, str(folder))
    finally:
        cluster.close()
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == []
    # The kill really came mid-write; the surviving rank removed the save's files (its own,
    # the half one, its version folder): only checkpoint A is there.
    assert (tmp_path / "half-written").exists()
    _assert_only_the_checkpoint(folder, 2)

    for got in cluster_of(2).run(_load_values, str(folder)):
        assert _equal(got, a)

    # The next save completes: only its files remain (the crashed save's leftovers, A's files gone).
    cluster_of(2).run(_save, str(folder), 4)
    _assert_only_the_checkpoint(folder, 2)
    torch.manual_seed(4)
    b = TinyGPT().state_dict()
    assert not _equal(a, b)  # control: the two checkpoints really differ
    for got in cluster_of(2).run(_load_values, str(folder)):
        assert _equal(got, b)


def test_swapped_rank_files_are_refused_on_every_rank(cluster_of, tmp_path):
    cluster_of(2).run(_save, str(tmp_path))
    first, second = _rank_files(tmp_path)
    shards = [torch.load(p, weights_only=True)["shards"] for p in (first, second)]
    # Control: the two files hold different values, so a swap would load wrong tensors.
    assert not any(torch.equal(shards[0][u], shards[1][u]) for u in shards[0])

    first.rename(tmp_path / "swap")
    second.rename(first)
    (tmp_path / "swap").rename(second)
    for r, msg in enumerate(cluster_of(2).run(_load_error, str(tmp_path))):
        assert msg.startswith("CorruptCheckpointError"), msg
        assert f"rank{r:05d}.pt" in msg and f"rank {1 - r}'s shards" in msg and "Fix:" in msg

    first.rename(tmp_path / "swap")  # swapped back, the same files load
    second.rename(first)
    (tmp_path / "swap").rename(second)
    assert cluster_of(2).run(_load_error, str(tmp_path)) == ["no error", "no error"]


@pytest.mark.parametrize("damage", ["truncated", "one bit flipped"])
def test_a_damaged_rank_file_is_refused_on_every_rank(cluster_of, tmp_path, damage):
    cluster_of(2).run(_save, str(tmp_path))
    path = _rank_files(tmp_path)[1]
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
        detail = [f"{len(data)} bytes", f"{len(data) // 2}"]
    else:
        # One bit inside a tensor's bytes: the zip container stays valid (torch.load checks no
        # CRC), so the file loads without complaint; only the checksum can tell.
        shards = torch.load(path, weights_only=True)["shards"]
        unit = max(shards, key=lambda u: shards[u].numel())
        at = data.find(shards[unit].numpy().tobytes()) + 4 * (shards[unit].numel() // 2)
        assert at > 4 * (shards[unit].numel() // 2)  # found
        path.write_bytes(data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
        edited = torch.load(path, weights_only=True)["shards"]
        assert not torch.equal(edited[unit], shards[unit])  # control: it loads, and differs
        detail = ["sha256"]
    for msg in cluster_of(2).run(_load_error, str(tmp_path)):
        assert msg.startswith("CorruptCheckpointError"), msg
        assert str(path.relative_to(tmp_path)) in msg and "Fix:" in msg
        assert all(d in msg for d in detail), msg


def _rewrite_rank_file(folder: Path, rank: int, edit) -> None:
    """Edit one rank file's payload and record the new file in meta.json, as a save would: the
    checksums pass, so only a check of the contents against the model can tell."""
    import hashlib

    path = _rank_files(folder)[rank]
    payload = torch.load(path, weights_only=True)
    edit(payload)
    torch.save(payload, path)
    data = path.read_bytes()
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"][rank] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / "meta.json").write_text(json.dumps(meta))


def _load_then_compare(folder: str) -> dict:
    """What load_sharded raised here, and whether this rank's shards were left as they were."""
    model = _sharded(seed=5)
    before = [u.flat.shard.clone() for u in sharding_state(model).units]
    try:
        load_sharded(model, folder)
        error = "no error"
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    after = [u.flat.shard for u in sharding_state(model).units]
    return {"error": error, "untouched": all(map(torch.equal, before, after))}


def _shrink(payload):  # one element: copy_ would broadcast it over the whole shard
    unit = next(iter(payload["shards"]))
    payload["shards"][unit] = payload["shards"][unit][:1].clone()


def _to_double(payload):  # another dtype: copy_ would convert it silently
    unit = next(iter(payload["shards"]))
    payload["shards"][unit] = payload["shards"][unit].double()


def _drop_unit(payload):  # a unit missing: the copy used to stop halfway, on this rank only
    del payload["shards"][list(payload["shards"])[-1]]


@pytest.mark.parametrize("edit", [_shrink, _to_double, _drop_unit], ids=lambda f: f.__name__)
def test_shards_unlike_the_model_are_refused_on_every_rank_before_any_copy(
    cluster_of, tmp_path, edit
):
    cluster_of(2).run(_save, str(tmp_path))
    _rewrite_rank_file(tmp_path, 1, edit)
    for got in cluster_of(2).run(_load_then_compare, str(tmp_path)):
        assert got["error"].startswith("CorruptCheckpointError"), got["error"]
        assert "rank00001.pt" in got["error"] and "Fix:" in got["error"]
        assert got["untouched"]  # all ranks or none: nothing was copied on either rank


@pytest.mark.parametrize(
    "text",
    ["", "{not json", '{"world_size": 2}', "[1, 2]"],
    ids=["empty", "garbage", "keys", "list"],
)
def test_an_invalid_meta_json_is_named(cluster_of, tmp_path, text):
    cluster_of(2).run(_save, str(tmp_path))
    meta = tmp_path / "meta.json"
    meta.write_text(text)
    for msg in cluster_of(2).run(_load_error, str(tmp_path)):
        assert msg.startswith("CorruptCheckpointError"), msg
        assert "not a valid sharded-checkpoint metadata file" in msg
        assert str(meta) in msg and "Fix:" in msg


# -- clip_grad_norm_ ----------------------------------------------------------------------------


def _reference_clip(norm_type: float) -> tuple[float, float, dict]:
    """Single process, whole batch: (norm, max_norm, clipped gradients by every name)."""
    model = tiny_gpt()
    x, y = synthetic_batch(model.vocab_size, 12, 16, step=0)
    F.cross_entropy(model(x).reshape(-1, model.vocab_size), y.reshape(-1)).backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf, norm_type).item()
    max_norm = norm / 4  # so that clipping really scales
    clipped = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).item()
    assert clipped == norm
    grads = {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return norm, max_norm, grads


def _clip_sharded(strategy: str, max_norm: float, norm_type: float) -> dict:
    model = _sharded(strategy)
    norms = []

    def clip() -> None:  # between backward and the (lr=0) optimizer step
        norms.append(clip_grad_norm_(model, max_norm, norm_type))

    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    train_steps(model, opt, 1, rank=rank(), world=world_size(), clip=clip)
    state = sharding_state(model)
    grads = {}
    for unit in state.units:  # gather the clipped gradient back to full size
        g = unit.flat_shard_grad()
        full = torch.empty(unit.flat.padded_numel) if unit.flat.shard_size > 1 else g
        if unit.flat.shard_size > 1:
            dist.all_gather_into_tensor(full, g)
        for t, names in zip(unit.flat.unflatten(full).values(), unit.aliases, strict=True):
            grads.update(dict.fromkeys(names, t.clone()))
    return {"norm": norms[0].item(), "grads": grads}


@pytest.mark.parametrize(
    ("n", "strategy", "norm_type"),
    [
        (2, "full", 2.0),
        (3, "full", 2.0),
        (2, "none", 2.0),
        (3, "full", math.inf),
        (2, "none", math.inf),
    ],
)
def test_clip_grad_norm_matches_single_process(cluster_of, n, strategy, norm_type):
    norm, max_norm, expected = _reference_clip(norm_type)
    results = cluster_of(n).run(_clip_sharded, strategy, max_norm, norm_type)
    assert len({res["norm"] for res in results}) == 1  # one global norm, the same on every rank
    for res in results:
        assert res["norm"] == pytest.approx(norm, rel=1e-5)
        assert res["grads"].keys() == expected.keys()
        for name, g in expected.items():
            torch.testing.assert_close(res["grads"][name], g, rtol=1e-5, atol=1e-7)


# -- a save deletes only what it wrote (issue 51, class "outputs") ------------------------------


def _save_error(folder: str, seed: int) -> str:
    try:
        _save(folder, seed)
    except Exception as exc:  # any type: the message is what is checked
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def test_a_save_keeps_every_file_it_did_not_write(cluster_of, tmp_path):
    """Item 8: a folder named like a version and a rank file of someone else's were deleted."""
    (tmp_path / "v20250101").mkdir()
    (tmp_path / "v20250101" / "data.csv").write_text("a,b\n1,2\n")
    (tmp_path / "rank00007.pt").write_bytes(b"not ours")
    (tmp_path / "v00002").mkdir()  # own case: the name the next save would take
    (tmp_path / "v00002" / "notes.txt").write_text("mine")
    for seed in (None, 4, 5):
        assert cluster_of(2).run(_save_error, str(tmp_path), seed) == ["no error"] * 2
    assert (tmp_path / "v20250101" / "data.csv").read_text() == "a,b\n1,2\n"
    assert (tmp_path / "rank00007.pt").read_bytes() == b"not ours"
    assert (tmp_path / "v00002" / "notes.txt").read_text() == "mine"
    torch.manual_seed(5)
    last = TinyGPT().state_dict()
    for got in cluster_of(2).run(_load_values, str(tmp_path)):
        assert _equal(got, last)


def test_an_old_version_linked_from_another_disk_is_left_and_the_save_succeeds(cluster_of,
                                                                               tmp_path):  # fmt: skip
    """Item 8: every later save committed, then raised on every rank ("Cannot call rmtree on
    a symbolic link")."""
    folder, elsewhere = tmp_path / "ckpt", tmp_path / "other-disk"
    cluster_of(2).run(_save, str(folder))
    (version,) = [p for p in folder.iterdir() if p.is_dir()]
    elsewhere.mkdir()
    version.rename(elsewhere / version.name)
    version.symlink_to(elsewhere / version.name)
    assert cluster_of(2).run(_save_error, str(folder), 4) == ["no error"] * 2
    assert version.is_symlink() and (elsewhere / version.name / "rank00000.pt").exists()
    torch.manual_seed(4)
    last = TinyGPT().state_dict()
    for got in cluster_of(2).run(_load_values, str(folder)):
        assert _equal(got, last)


def test_a_meta_json_planted_as_a_link_is_replaced_not_written_through(cluster_of, tmp_path):
    victim = tmp_path / "gradebook.db"
    victim.write_text("precious")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "meta.json").symlink_to(victim)
    assert cluster_of(2).run(_save_error, str(tmp_path / "ckpt"), 4) == ["no error"] * 2
    assert victim.read_text() == "precious"
    assert not (tmp_path / "ckpt" / "meta.json").is_symlink()


def _mount_small_disk(disk: Path, size: int) -> bool:
    """A tmpfs of `size` bytes at `disk` (as root); False where it cannot be made."""
    import subprocess

    disk.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def _save_error_on(folder: str) -> str:
    return _save_error(folder, 2)


def test_a_full_disk_is_said_plainly_and_the_checkpoint_stays(cluster_of, tmp_path):
    """Item 8: a full disk surfaced as torch's "enforce fail ... unexpected pos"."""
    import subprocess

    cluster_of(2).run(_save, str(tmp_path / "probe"))
    one_save = sum(p.stat().st_size for p in (tmp_path / "probe").rglob("*") if p.is_file())
    disk = tmp_path / "disk"  # room for one checkpoint, not for a second beside it
    if not _mount_small_disk(disk, one_save * 3 // 2):
        pytest.skip("cannot mount a small filesystem here (needs root)")
    try:
        folder = disk / "ckpt"
        assert cluster_of(2).run(_save_error, str(folder), None) == ["no error"] * 2
        said = cluster_of(2).run(_save_error_on, str(folder))
        assert all("No space left on device" in s and "unchanged" in s for s in said), said
        assert not any("enforce fail" in s for s in said)
        left = sorted(p.name for p in folder.iterdir() if p.is_dir())
        assert len(left) == 1, left  # the failed save's folder went with it
        for got in cluster_of(2).run(_load_values, str(folder)):  # the first save, whole
            assert _equal(got, tiny_gpt().state_dict())
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def _save_with_its_folder_swapped(folder: str, victim: str) -> str:
    """save_sharded while another user swaps the new version folder for a link to `victim`
    right after it is made (rank 0 makes it)."""
    real = os.mkdir

    def mkdir(name, *args, dir_fd=None, **kwargs):
        real(name, *args, dir_fd=dir_fd, **kwargs)
        if str(name).startswith("v"):
            os.rename(name, f"{name}.moved", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            os.symlink(victim, name, dir_fd=dir_fd)

    if rank() == 0:
        os.mkdir = mkdir
    try:
        return _save_error(folder, 4)
    finally:
        os.mkdir = real


def test_a_version_folder_swapped_for_a_link_is_never_written_through(cluster_of, tmp_path):
    """A hostile review: in a folder others may write, the new version folder swapped for a
    link got the rank files written into the link's target."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "rank00000.pt").write_bytes(b"another checkpoint's")
    folder = tmp_path / "ckpt"
    cluster_of(2).run(_save, str(folder))
    said = cluster_of(2).run(_save_with_its_folder_swapped, str(folder), str(victim))
    assert all(s != "no error" for s in said), said
    assert sorted(p.name for p in victim.iterdir()) == ["rank00000.pt"]
    assert (victim / "rank00000.pt").read_bytes() == b"another checkpoint's"
    for got in cluster_of(2).run(_load_values, str(folder)):  # the first save, whole
        assert _equal(got, tiny_gpt().state_dict())


def test_a_journal_a_save_did_not_write_deletes_nothing(cluster_of, tmp_path):
    """A hostile review: a journal.json naming the user's own `v00050` made a save delete it.
    A journal names folders with the identity they had when made; another folder under that
    name (and a list of bare names, or a FIFO in the journal's place) is not one of them."""
    folder = tmp_path / "ckpt"
    (folder / "v00050").mkdir(parents=True)
    (folder / "v00050" / "rank00000.pt").write_text("USER DATA")
    other = tmp_path / "other"
    other.mkdir()
    stranger = [other.stat().st_dev, other.stat().st_ino]
    for journal in ('["v00050"]', json.dumps({"v00050": stranger})):
        (folder / "journal.json").write_text(journal)
        assert cluster_of(2).run(_save_error, str(folder), 4) == ["no error"] * 2
        assert (folder / "v00050" / "rank00000.pt").read_text() == "USER DATA"
    (folder / "journal.json").unlink()
    os.mkfifo(folder / "journal.json")  # read, it would hang the save
    assert cluster_of(2).run(_save_error, str(folder), 5) == ["no error"] * 2
    assert (folder / "v00050" / "rank00000.pt").read_text() == "USER DATA"
