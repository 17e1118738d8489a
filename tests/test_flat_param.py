"""FlatParameter on its own, no ranks: layout, padding, shards, views, free/refill, meta fill.

Every rank's shard is built here in one process (shard_rank = 0..N-1 over the same
parameters), so the tests can put the shards side by side the way an all-gather would.
"""

from __future__ import annotations

import pytest
import torch

from fsdp_lab.sharding.flat_param import FILL_CHUNK, FlatParameter


def _params() -> tuple[list[str], list[torch.Tensor]]:
    torch.manual_seed(0)
    return ["w1", "b1", "w2"], [torch.randn(4, 3), torch.randn(4), torch.randn(2, 4)]


def _flat(rank: int, n: int, **kwargs) -> FlatParameter:
    names, params = _params()
    return FlatParameter(names=names, params=params, shard_rank=rank, shard_size=n, **kwargs)


def test_layout_offsets_and_padding():
    flat = _flat(0, 5)  # 12 + 4 + 8 = 24 elements, padded to 25
    assert [(s.name, s.offset, tuple(s.shape)) for s in flat.segments] == [
        ("w1", 0, (4, 3)),
        ("b1", 12, (4,)),
        ("w2", 16, (2, 4)),
    ]
    assert (flat.numel, flat.padded_numel, flat.shard_numel, flat.padding) == (24, 25, 5, 1)
    assert _flat(0, 4).padding == 0  # 24 divides by 4: no padding


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7])
def test_the_shards_side_by_side_are_the_parameters_then_zeros(n):
    names, params = _params()
    shards = [_flat(r, n).shard.detach() for r in range(n)]
    gathered = torch.cat(shards)  # what all_gather_into_tensor would give
    expected = torch.cat([p.reshape(-1) for p in params])
    assert torch.equal(gathered[:24], expected)
    assert torch.count_nonzero(gathered[24:]) == 0  # the padding
    assert all(s.numel() == shards[0].numel() for s in shards)  # equal shards, always


def test_local_range_says_which_part_of_a_parameter_this_rank_holds():
    flats = [_flat(r, 3) for r in range(3)]  # shards of 8: [0,8) [8,16) [16,24)
    held = [[f.local_range(seg) for f in flats] for seg in flats[0].segments]
    # w1: offset 0, 12 elements: rank 0 all of its shard, rank 1 the first 4 places
    assert held[0][:2] == [(0, 8), (0, 4)] and held[0][2][0] == held[0][2][1]
    # b1: offset 12, 4 elements, all on rank 1, places [4, 8); empty elsewhere
    assert held[1][1] == (4, 8) and all(a == b for a, b in (held[1][0], held[1][2]))
    # w2: offset 16, 8 elements: exactly rank 2's shard
    assert held[2][2] == (0, 8) and all(a == b for a, b in held[2][:2])


def test_views_alias_the_unsharded_buffer_and_survive_free_and_refill():
    names, params = _params()
    flat = _flat(0, 2)
    assert not flat.is_allocated  # nothing gathered yet
    flat.alloc_unsharded()
    with torch.no_grad():
        flat.unsharded[: flat.numel].copy_(torch.cat([p.reshape(-1) for p in params]))
    views = flat.views()
    assert [tuple(v.shape) for v in views] == [(4, 3), (4,), (2, 4)]
    assert all(torch.equal(v, p) for v, p in zip(views, params, strict=True))
    assert all(v.untyped_storage().data_ptr() == flat.unsharded.data_ptr() for v in views)
    flat.free_unsharded()
    assert not flat.is_allocated and flat.unsharded.untyped_storage().nbytes() == 0
    flat.alloc_unsharded()  # the same storage refilled: old views see the new values
    with torch.no_grad():
        flat.unsharded.fill_(2.0)
    assert all(bool((v == 2.0).all()) for v in views)


def test_gradients_through_the_views_land_in_the_unsharded_buffer_flat():
    flat = _flat(0, 2)
    flat.alloc_unsharded()
    with torch.no_grad():
        flat.unsharded.zero_()
    w1, b1, w2 = flat.views()
    (w1.sum() * 1 + b1.sum() * 2 + w2.sum() * 3).backward()
    grad = flat.unsharded.grad
    assert grad.shape == (flat.padded_numel,)
    assert torch.equal(grad[:12], torch.full((12,), 1.0))
    assert torch.equal(grad[12:16], torch.full((4,), 2.0))
    assert torch.equal(grad[16:24], torch.full((8,), 3.0))


def test_flatten_and_unflatten_are_inverse():
    names, params = _params()
    flat = _flat(1, 3)
    full = flat.flatten(dict(zip(names, params, strict=True)))
    assert full.shape == (flat.padded_numel,)
    back = flat.unflatten(full)
    assert all(torch.equal(back[k], p) for k, p in zip(names, params, strict=True))
    assert torch.equal(flat.shard_of(full), flat.shard.detach())  # rank 1's part


def test_a_replicated_fp32_unit_is_its_own_unsharded_buffer_and_mixed_precision_is_not():
    plain = _flat(0, 1)
    assert plain.aliased and plain.unsharded is plain.shard  # DDP: nothing to gather
    cast = _flat(0, 1, compute_dtype=torch.bfloat16)
    assert not cast.aliased and cast.unsharded.dtype == torch.bfloat16
    assert cast.shard.dtype == torch.float32  # the master copy stays fp32


def test_meta_parameters_are_filled_from_a_slice_initialiser_chunk_by_chunk():
    with torch.device("meta"):
        big = torch.nn.Parameter(torch.empty(FILL_CHUNK + 10))
    asked = []

    def values(name, shape, start, end):
        asked.append((start, end))
        return torch.arange(start, end, dtype=torch.float32)

    flats = [
        FlatParameter(
            names=["big"],
            params=[big],
            shard_rank=r,
            shard_size=2,
            values=values,
            device=torch.device("cpu"),
        )
        for r in range(2)
    ]
    gathered = torch.cat([f.shard.detach() for f in flats])[: big.numel()]
    assert torch.equal(gathered, torch.arange(big.numel(), dtype=torch.float32))
    assert max(b - a for a, b in asked) <= FILL_CHUNK  # never one huge temporary
    with pytest.raises(ValueError, match="needs a real `device`"):
        FlatParameter(names=["big"], params=[big], shard_rank=0, shard_size=2, values=values)
    with pytest.raises(ValueError, match="meta parameters have no values"):
        FlatParameter(
            names=["big"], params=[big], shard_rank=0, shard_size=2, device=torch.device("cpu")
        )


def test_a_wrong_slice_from_the_initialiser_is_a_clear_error():
    with torch.device("meta"):
        p = torch.nn.Parameter(torch.empty(6))
    with pytest.raises(ValueError, match=r"returned shape \(2,\) for elements \[0, 3\)"):
        FlatParameter(
            names=["p"],
            params=[p],
            shard_rank=0,
            shard_size=2,
            values=lambda name, shape, a, b: torch.zeros(2),
            device=torch.device("cpu"),
        )
