"""shard() on a meta-device model: each unit materialised (or each shard generated) on the
rank, initialised, re-tied, and sharded — equal bitwise to a single-process reference built the
same way, for N in 1..4; rank 0's values broadcast under sync_module_states; buffers made real;
a rank never holds more than its shards plus one unit; bad init functions named."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_lab
from fsdp_lab import comm, reference
from fsdp_lab.models import Block, tiny_gpt
from fsdp_lab.sharding import shard
from fsdp_lab.sharding.materialize import materialize
from fsdp_lab.sharding.ties import verify_weight_tying
from fsdp_lab.trace import MemoryTracker


def _meta_gpt(**kw: int) -> nn.Module:
    with torch.device("meta"):
        return tiny_gpt(**kw)


def _reference(seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    model = materialize(_meta_gpt(), {Block})
    return {k: v.detach().clone() for k, v in model.named_parameters(remove_duplicate=False)}


def _sharded_params(seed: int, sync: bool) -> dict:
    # Every rank seeds differently: only the broadcast (sync) can make them agree.
    torch.manual_seed(seed + (0 if sync else 0) + 1000 * fsdp_lab.rank() * int(sync))
    if not sync:
        torch.manual_seed(seed)
    with comm.CommLog() as log:
        model = shard(_meta_gpt(), units={Block}, sync_module_states=sync)
    problems = verify_weight_tying(model)
    return {
        "params": reference.full_parameters(model),
        "broadcast_bytes": log.bytes_by_op().get("broadcast", 0),
        "problems": problems,
    }


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_meta_model_sharded_equals_single_process_materialisation(cluster_of, n):
    expected = _reference(seed=7)
    numel = sum(p.numel() for p in tiny_gpt().parameters())
    for sync in (False, True):
        for r, res in enumerate(cluster_of(n).run(_sharded_params, 7, sync)):
            assert res["problems"] == []
            assert set(res["params"]) == set(expected)
            for k, v in expected.items():
                assert torch.equal(res["params"][k], v), (k, r, sync)
            # sync: rank 0 sent every parameter once (a tie once); the bytes are counted.
            assert res["broadcast_bytes"] == (numel * 4 if sync and n > 1 else 0) or not sync
    # The reference initialised something (not all zeros) and kept the tie.
    assert expected["blocks.0.attn.qkv.weight"].abs().sum() > 0
    assert torch.equal(expected["tok_emb.weight"], expected["head.weight"])


class _Slices:
    """A tiny counter-style slice initialiser: element i of `name` is a function of (name, i)."""

    def values(self, name, shape, start, end, dtype=torch.float32, device="cpu"):
        idx = torch.arange(start, end, dtype=dtype, device=device)
        return idx.mul_(0.37).add_(len(name)).sin_().mul_(0.1)  # in place: one slice of memory


def _slice_sharded(units) -> dict:
    model = shard(_meta_gpt(), units=units, shard_init=_Slices())
    return {"params": reference.full_parameters(model), "problems": verify_weight_tying(model)}


@pytest.mark.parametrize("n", [2, 3])
def test_shard_init_fills_each_slice_and_agrees_with_the_full_generation(cluster_of, n):
    model = _meta_gpt()
    init = _Slices()
    expected = {
        k: init.values(k, tuple(p.shape), 0, p.numel()).view(p.shape)
        for k, p in model.named_parameters()
    }
    for res in cluster_of(n).run(_slice_sharded, {Block}):
        assert res["problems"] == []
        for k, v in expected.items():
            assert torch.equal(res["params"][k], v), k
        assert torch.equal(res["params"]["head.weight"], res["params"]["tok_emb.weight"])


def _peak_during_shard(vocab: int, dim: int, mode: str) -> dict:
    with torch.device("meta"):
        model = tiny_gpt(vocab_size=vocab, dim=dim, n_layers=4, n_heads=4)
    with MemoryTracker() as mem:
        if mode == "slices":
            shard(model, units={Block}, shard_init=_Slices())
        else:
            shard(model, units={Block})
        after = mem.current_bytes
    return {"peak": mem.peak_bytes, "after": after}


def test_no_rank_ever_holds_the_whole_model(cluster_of):
    vocab, dim, n = 4096, 64, 4
    full = tiny_gpt(vocab_size=vocab, dim=dim)
    model_bytes = sum(p.numel() for p in full.parameters()) * 4
    unit_bytes = [
        sum(p.numel() for p in full.blocks[0].parameters()) * 4,
        model_bytes - 4 * sum(p.numel() for p in full.blocks[0].parameters()) * 4,
    ]
    largest_param = max(p.numel() for p in full.parameters()) * 4
    for mode in ("init_fn", "slices"):
        for res in cluster_of(n).run(_peak_during_shard, vocab, dim, mode):
            shards = res["after"]
            assert shards <= model_bytes / n + 4 * 64  # its shards (+ padding), nothing else
            if mode == "slices":  # no unit is ever materialised
                # At most one slice of initialiser temporaries, far below the largest unit.
                assert res["peak"] <= shards + max(unit_bytes) / n + 16 * 1024
            else:  # the shards + the parameter being initialised, never the model
                # In build order each parameter goes into its shard right after its module's
                # init; the largest (the tied embedding) is whole once more at the end, when the
                # head's reset_parameters() runs on it whole (WholeView) beside every shard.
                assert res["peak"] <= shards + largest_param + 16 * 1024
                assert res["peak"] >= largest_param  # it did hold the embedding, whole
                assert res["peak"] <= shards + max(unit_bytes) + 16 * 1024  # the old bound
            assert res["peak"] < model_bytes * (0.75 if mode == "slices" else 0.85)


class _WithBuffers(nn.Module):
    """A unit with BatchNorm statistics and a parameter-free module with a computed cache."""

    class Cache(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("table", torch.empty(8), persistent=False)
            self.reset_parameters()

        def reset_parameters(self) -> None:
            self.table = torch.arange(8, dtype=torch.float32, device=self.table.device) * 0.5

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.cache = self.Cache()


def _buffers_on_rank() -> dict:
    with torch.device("meta"):
        model = _WithBuffers()
    shard(model, units=["fc"])
    return {n: b.clone() for n, b in model.named_buffers()}


def test_buffers_are_materialised_and_initialised(cluster_of):
    for res in cluster_of(2).run(_buffers_on_rank):
        assert torch.equal(res["cache.table"], torch.arange(8.0) * 0.5)
        assert torch.equal(res["bn.running_mean"], torch.zeros(8))
        assert torch.equal(res["bn.running_var"], torch.ones(8))
        assert res["bn.num_batches_tracked"].item() == 0


def _bad_init(kind: str) -> str:
    def leave_on_meta(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.empty(m.weight.shape, device="meta"))

    def reshape(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            m.weight = nn.Parameter(torch.zeros(3, 3))

    fn = {"meta": leave_on_meta, "shape": reshape}[kind]
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    try:
        shard(model, param_init_fn=fn)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def test_bad_init_functions_and_mixed_devices_are_named():
    with pytest.raises(ValueError, match=r"'0\.weight' on the meta device"):
        raise ValueError(_bad_init("meta"))
    with pytest.raises(ValueError, match=r"changed the shape of '0\.weight' from \(4, 4\)"):
        raise ValueError(_bad_init("shape"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with torch.device("meta"):
        model[1] = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"several devices.*'1\.weight'"):
        shard(model)
    with pytest.raises(ValueError, match="param_init_fn initialises a model built on the meta"):
        shard(nn.Linear(2, 2), param_init_fn=lambda m: None)


def test_a_meta_model_where_values_are_needed_is_named():
    with pytest.raises(ValueError, match=r"'tok_emb\.weight' .* meta device.*materialise"):
        reference.train_steps(_meta_gpt(), torch.optim.SGD([torch.zeros(1)], lr=0.1), 1)
    with pytest.raises(ValueError, match=r"'tok_emb\.weight' .* meta device"):
        reference.full_parameters(_meta_gpt())
