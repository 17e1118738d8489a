"""Pipeline seeding: the seed checkpoint and RNG replay equal the unsplit init bitwise, on every
layout and with pipelines side by side (pp x dp); the same seed on every stage copies layers;
per-stage seeds give distinct weights that are not the unsplit init; messages are counted. The
four work on models this package did not write (tests/foreign_models.py), which then train like
one process; a model that cannot be seeded fails on every rank, none left waiting."""

from __future__ import annotations

from contextlib import nullcontext
from unittest import mock

import pytest
import torch
import torch.nn as nn
from foreign_models import FACTORIES, N_LAYERS, TitanLlama, reference_init, torch_sequential

import fsdp_lab
from fsdp_lab import Cluster, RankError, comm, reference
from fsdp_lab.models import Llama
from fsdp_lab.pipeline import plan_stages, train_pipeline
from fsdp_lab.pipeline.init_order import model_init
from fsdp_lab.pipeline.model import PipeGPT, PipeGPTConfig
from fsdp_lab.pipeline.rng import STRATEGIES, init_stage, record_init_order
from fsdp_lab.pipeline.stages import stage_info
from fsdp_lab.trace import MemoryTracker

CONFIG = PipeGPTConfig(vocab_size=64, dim=32, n_layers=6, n_heads=4, seq_len=16)
SEED = 1234


def _counted_init(*args, **kwargs) -> tuple[nn.Module, dict]:
    """`init_stage` under a CommLog and a MemoryTracker: the stage, the bytes this rank sent (a
    recv is the other end of a send), its messages (sends, recvs, broadcasts) and peak bytes."""
    with comm.CommLog() as log, MemoryTracker() as mem:
        model = init_stage(*args, **kwargs)
    by_op = log.bytes_by_op()
    sent = by_op.get("send", 0) + by_op.get("broadcast", 0)
    return model, {"bytes_moved": sent, "messages": len(log.records), "peak_bytes": mem.peak_bytes}


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
    model, report = _counted_init(
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
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), stages, CONFIG.n_layers)
    with torch.device("meta"):
        whole = _HeadFirst(CONFIG)  # any model may be given whole: its init_weights is replayed
    model, report = _counted_init("rng_replay", whole, info, SEED)
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"params": params, **report}


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


# -- any model ------------------------------------------------------------------------------------


def _seed_and_train(name: str, checkpoint_dir: str) -> dict:
    """Every strategy in turn: seed this rank's stage, keep its values, train 2 GPipe steps."""
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), 2, N_LAYERS[name])
    with torch.device("meta"):
        whole = FACTORIES[name]()  # the whole model, shapes only: the strategy initialises
    plan = plan_stages(whole, 2)  # made once (a meta probe costs ~0.1 s), checked at each use
    out = {}
    for strategy in STRATEGIES:
        torch.manual_seed(999 + fsdp_lab.rank())  # whatever a rank had before must not matter
        model, report = _counted_init(
            strategy, whole, info, SEED, checkpoint_dir=checkpoint_dir, stages=plan
        )
        initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = train_pipeline(model, info, optimizer, STEPS, 1, 8, 16)  # M=1: bit for bit
        final = {k: v.detach().clone() for k, v in model.state_dict().items()}
        out[strategy] = {"initial": initial, "final": final, "losses": losses, **report}
    return out


STEPS = 2


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_every_strategy_seeds_any_model_which_then_trains_like_one_process(
    cluster_of, tmp_path, name
):
    expected = reference_init(name, SEED).state_dict()
    state_bytes = torch.get_rng_state().numel()
    per_rank = cluster_of(2).run(_seed_and_train, name, str(tmp_path))
    for strategy in STRATEGIES:
        ranks = [r[strategy] for r in per_rank]
        initial = {**ranks[0]["initial"], **ranks[1]["initial"]}
        assert initial.keys() == expected.keys()  # together the stages hold the model, once
        same = [{k: torch.equal(v, expected[k]) for k, v in r["initial"].items()} for r in ranks]
        if strategy in ("seed_checkpoint", "rng_replay"):  # the unsplit init, bit for bit
            assert all(all(s.values()) for s in same), strategy
        elif strategy == "same_seed":  # stage 0 reads the stream as the unsplit init did...
            assert all(same[0].values()) and not all(same[1].values())  # ...stage 1 does not
        else:
            assert not all(same[0].values()) and not all(same[1].values())
        if strategy == "rng_replay":  # one change of owner, stage 0 -> stage 1
            assert sum(r["bytes_moved"] for r in ranks) == state_bytes
        # Whatever the init, the pipeline trains it as one process trains the same weights.
        single = FACTORIES[name]()
        single.load_state_dict(initial)
        single.vocab_size = 32  # reference.train_steps reads it
        optimizer = torch.optim.SGD(single.parameters(), lr=0.1, momentum=0.9)
        losses = reference.train_steps(single, optimizer, STEPS, global_batch=8, seq_len=16)
        assert ranks[1]["losses"] == losses, strategy
        final = {**ranks[0]["final"], **ranks[1]["final"]}
        for k, v in single.state_dict().items():
            assert torch.equal(final[k], v), (strategy, k)
        assert any(not torch.equal(final[k], v) for k, v in initial.items())  # it trained


def test_a_models_init_is_its_own_or_what_its_construction_did():
    # PyTorch's layers: reset_parameters() in module order is what construction drew.
    torch.manual_seed(5)
    built = torch_sequential()
    again = torch_sequential()
    torch.manual_seed(5)
    model_init(again)(again)
    assert all(
        torch.equal(a, b) for a, b in zip(built.parameters(), again.parameters(), strict=True)
    )
    with torch.device("meta"):  # torchtitan's convention: init_weights(), in its order
        order = record_init_order(TitanLlama())
    assert order[0] == "tok_embeddings" and order[-2:] == ["norm", "output"]

    class NoInit(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(4))  # on the root, no reset_parameters()

    with pytest.raises(
        ValueError, match=r"no init_weights\(\), and \['<root> \(NoInit\)'\].*init="
    ):
        model_init(NoInit())


def test_an_init_that_leaves_a_parameter_alone_is_refused():
    with torch.device("meta"):
        whole = TitanLlama()

    def forgetful(model):  # torchtitan's init without its last line
        nn.init.normal_(model.tok_embeddings.weight)
        for layer in model.layers:
            layer.init_weights()
        model.norm.reset_parameters()

    info = stage_info(0, 1, 1)
    with pytest.raises(ValueError, match=r"never touches \['output.weight'\].*init="):
        init_stage("same_seed", whole, info, SEED, init=forgetful)


def _seed_checkpoint_of(kind: str, folder: str) -> str:
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), 2, 4)  # both models: 4 layers
    with torch.device("meta"):
        whole = Llama() if kind == "unsplittable" else TitanLlama()
    full_disk = OSError(28, "No space left on device")
    failing = kind == "save_fails" and fsdp_lab.rank() == 0
    try:
        with mock.patch("torch.save", side_effect=full_disk) if failing else nullcontext():
            init_stage("seed_checkpoint", whole, info, SEED, checkpoint_dir=folder)
    except Exception as exc:  # what this rank says, returned: every rank must get here
        return f"{type(exc).__name__}: {exc}"
    return "initialised"


def test_seed_checkpoint_never_leaves_a_rank_waiting(tmp_path):
    """Observed: rank 0 failed building the whole model while rank 1 waited in the broadcast
    until the cluster's timeout. Now a model that cannot be split fails on every rank before
    any message, and a failure only rank 0 meets is broadcast to the others."""
    with Cluster(2, backend="gloo", timeout=30, verbose=False) as cluster:
        try:
            said = cluster.run(_seed_checkpoint_of, "unsplittable", str(tmp_path))
            assert all("Llama's forward is not a plain sequence" in s for s in said), said
            said = cluster.run(_seed_checkpoint_of, "save_fails", str(tmp_path))
            assert said[0] == "OSError: [Errno 28] No space left on device"
            assert said[1].startswith("RuntimeError: rank 0 could not write the seed checkpoint")
            assert cluster.run(_seed_checkpoint_of, "fine", str(tmp_path)) == ["initialised"] * 2
        except RankError as err:  # what main did: a rank stuck until the timeout
            pytest.fail(f"a rank was left waiting: {err}")


def _init_in_group(strategy: str, members: list[int], checkpoint_dir: str) -> dict | None:
    """One pipeline of len(members) stages on the ranks `members` (their own process group):
    the other ranks take no part. Returns the stage's values and what it sent, or None."""
    import torch.distributed as dist

    group = dist.new_group(members)  # every rank creates it, members or not
    try:
        if fsdp_lab.rank() not in members:
            return None
        place = members.index(fsdp_lab.rank())
        info = stage_info(place, len(members), len(members), CONFIG.n_layers)
        torch.manual_seed(999 + fsdp_lab.rank())
        model, report = _counted_init(
            strategy, CONFIG, info, SEED, checkpoint_dir=checkpoint_dir, group=group
        )
        return {"params": model.state_dict(), **report}
    finally:
        comm.all_reduce(torch.zeros(1))  # members and onlookers leave together
        dist.destroy_process_group(group)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_pipeline_on_some_of_the_ranks_seeds_within_its_group(cluster_of, tmp_path, strategy):
    # Ranks 1 and 3 of 4 run a 2-stage pipeline; 0 and 2 only watch. The group's rank 0 (world
    # rank 1) writes the checkpoint / draws the seeds / seeds the stream, and sends to world 3.
    out = cluster_of(4).run(_init_in_group, strategy, [1, 3], str(tmp_path))
    assert out[0] is None and out[2] is None
    stages = [out[1], out[3]]
    ref = _reference()
    joined = stages[0]["params"] | stages[1]["params"]
    assert set(joined) == set(ref)
    exact = all(torch.equal(joined[k], ref[k]) for k in ref)
    assert exact is (strategy in ("seed_checkpoint", "rng_replay")), strategy
    state = torch.get_rng_state().numel()
    sent = {"seed_checkpoint": [8, 8], "same_seed": [0, 0], "per_stage_seed": [16, 16]}
    sent["rng_replay"] = [state, 0]
    assert [s["bytes_moved"] for s in stages] == sent[strategy]
