"""Pipeline seeding: the seed checkpoint and RNG replay equal the unsplit init bitwise, on every
layout and with pipelines side by side (pp x dp); the same seed on every stage copies layers;
per-stage seeds give distinct weights that are not the unsplit init; messages are counted."""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig
from fsdp_lab.pipeline.rng import STRATEGIES, init_stage, record_init_order
from fsdp_lab.pipeline.stages import stage_info

CONFIG = PipeGPTConfig(vocab_size=64, dim=32, n_layers=6, n_heads=4, seq_len=16)
SEED = 1234


def _reference(config: PipeGPTConfig = CONFIG, cls: type = PipeGPT) -> dict[str, torch.Tensor]:
    model = cls(config)
    torch.manual_seed(SEED)
    model.init_weights()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _init_on_rank(strategy, stages, layers_per_stage, checkpoint_dir, config=CONFIG):
    info = stage_info(
        fsdp_lab.rank(), fsdp_lab.world_size(), stages, config.n_layers, layers_per_stage
    )
    torch.manual_seed(999 + fsdp_lab.rank())  # whatever each rank had before must not matter
    model, report = init_stage(
        strategy, config, info, SEED, layers_per_stage, checkpoint_dir=checkpoint_dir
    )
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"stage": info.stage, "dp": info.dp_rank, "params": params, **report}


LAYOUTS = [(2, [1, 5]), (3, [2, 1, 3]), (4, [1, 2, 2, 1])]


@pytest.mark.parametrize(("stages", "layers"), LAYOUTS)
def test_checkpoint_and_replay_equal_the_unsplit_init_bitwise(cluster_of, tmp_path, stages, layers):
    expected = _reference()
    cluster = cluster_of(stages)
    for strategy in ("seed_checkpoint", "rng_replay"):
        ranks = cluster.run(_init_on_rank, strategy, stages, layers, str(tmp_path))
        seen = set()
        for res in ranks:
            for k, v in res["params"].items():
                assert torch.equal(v, expected[k]), (strategy, k)
            seen |= set(res["params"])
        assert seen == set(expected)  # together the stages hold the whole model, once
        if strategy == "rng_replay":
            # One generator state per change of owner: S-1 handoffs along the pipeline.
            state_bytes = torch.get_rng_state().numel()
            assert sum(r["bytes_moved"] for r in ranks) == (stages - 1) * state_bytes
        else:  # rank 0 held the whole model once; the others only their stage
            full = sum(v.numel() * 4 for v in expected.values())
            assert ranks[0]["peak_bytes"] >= full
            assert all(r["peak_bytes"] < full for r in ranks[1:])


def test_same_seed_copies_layers_and_per_stage_seeds_do_not(cluster_of):
    expected = _reference()
    same = cluster_of(3).run(_init_on_rank, "same_seed", 3, [2, 2, 2], None)
    # Stages 1 and 2 own the same kind of modules and read the stream from its start: their
    # first layers are identical, parameter by parameter.
    for suffix in ("attn.qkv.weight", "attn.proj.weight", "mlp.fc.weight", "mlp.proj.weight"):
        a, b = same[1]["params"][f"layers.2.{suffix}"], same[2]["params"][f"layers.4.{suffix}"]
        assert torch.equal(a, b), suffix
    # Stage 0 drew the embeddings first; stage 1's first draws repeat those very numbers.
    emb = same[0]["params"]["tok_emb.weight"].flatten()
    qkv = same[1]["params"]["layers.2.attn.qkv.weight"].flatten()
    assert torch.equal(qkv[: emb.numel()], emb)
    assert torch.equal(
        same[0]["params"]["layers.0.attn.qkv.weight"], expected["layers.0.attn.qkv.weight"]
    )  # stage 0 alone is right

    per = cluster_of(3).run(_init_on_rank, "per_stage_seed", 3, [2, 2, 2], None)
    a = per[1]["params"]["layers.2.attn.qkv.weight"]
    b = per[2]["params"]["layers.4.attn.qkv.weight"]
    assert not torch.equal(a, b)
    assert torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs() < 0.1
    assert not torch.equal(a, expected["layers.2.attn.qkv.weight"])
    assert per[0]["bytes_moved"] == 3 * 8  # three int64 seeds, broadcast by rank 0


def test_replay_on_a_2d_mesh_gives_replicas_equal_weights(cluster_of, tmp_path):
    expected = _reference()
    for strategy in STRATEGIES:
        ranks = cluster_of(4).run(_init_on_rank, strategy, 2, None, str(tmp_path))
        by_stage: dict[int, list[dict]] = {}
        for r in ranks:
            by_stage.setdefault(r["stage"], []).append(r["params"])
        for replicas in by_stage.values():  # the two pipelines' copies of one stage agree
            for k in replicas[0]:
                assert torch.equal(replicas[0][k], replicas[1][k]), (strategy, k)
        first = {0: "layers.0.attn.qkv.weight", 1: "layers.3.attn.qkv.weight"}
        stage0, stage1 = (by_stage[s][0][first[s]] for s in (0, 1))
        assert not torch.equal(stage0, stage1)  # the stages hold different weights
        if strategy in ("seed_checkpoint", "rng_replay"):
            for params in (p for reps in by_stage.values() for p in reps):
                assert all(torch.equal(v, expected[k]) for k, v in params.items())


class _HeadFirst(PipeGPT):
    """init_weights walks the head before everything else: the order is not the layout's."""

    def init_modules(self):
        mods = super().init_modules()
        return [m for m in mods if m[0] == "head"] + [m for m in mods if m[0] != "head"]


def _replay_head_first(stages):
    import fsdp_lab.pipeline.rng as rng

    original = rng.PipeGPT
    rng.PipeGPT = _HeadFirst  # the stage model and the recording both use the subclass
    try:
        return _init_on_rank("rng_replay", stages, None, None)
    finally:
        rng.PipeGPT = original


def test_replay_follows_the_recorded_order_not_the_layout(cluster_of):
    with torch.device("meta"):
        order = record_init_order(_HeadFirst(CONFIG))
    assert order[0] == "head" and order[1] == "tok_emb"
    expected = _reference(cls=_HeadFirst)
    ranks = cluster_of(2).run(_replay_head_first, 2)
    for res in ranks:
        for k, v in res["params"].items():
            assert torch.equal(v, expected[k]), k
    # head (stage 1) -> tok_emb (stage 0) -> ... -> norm (stage 1): two handoffs, not one.
    assert sum(r["messages"] for r in ranks) == 2 * 2  # each handoff: one send + one recv


def test_bad_strategy_is_named():
    info = stage_info(0, 1, 1, CONFIG.n_layers)
    with pytest.raises(ValueError, match=r"strategy='replay' is unknown: allowed \['seed_ch"):
        init_stage("replay", CONFIG, info, SEED)
