"""fsdp_lab.pipeline: stages own exactly their modules, and GPipe over S ranks trains exactly
like one process — same losses, same parameters — with 2 (S-1) M activation-sized messages."""

from __future__ import annotations

import pytest
import torch

import fsdp_lab
from fsdp_lab import comm, reference
from fsdp_lab.pipeline import (
    PipeGPT,
    PipeGPTConfig,
    gpipe_step,
    partition,
    split_model,
    stage_info,
    stage_module_names,
    train_pipeline,
)
from fsdp_lab.trace import Timeline

CFG = PipeGPTConfig()  # L=6 layers, dim 32
STEPS, BATCH, SEQ, SEED = 5, 8, 16, 0
SPLITS = {2: [1, 5], 3: [2, 1, 3], 4: [1, 2, 2, 1]}  # uneven on purpose


def _full_model() -> PipeGPT:
    """The reference init: build, seed, init_weights. Every rank builds the same whole model."""
    model = PipeGPT(CFG)
    torch.manual_seed(SEED)
    model.init_weights()
    return model


def _sgd(params):
    # SGD with momentum, not Adam: Adam's 1/sqrt(v) amplifies last-bit differences (see
    # test_sharding.py), and micro-batching reorders the gradient sums.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


# -- partition, split, StageInfo ---------------------------------------------------------------


def test_partition_is_balanced_with_extras_first_and_takes_uneven_splits():
    assert partition(6, 4) == [[0, 1], [2, 3], [4], [5]]
    assert partition(7, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert partition(6, 1) == [list(range(6))]
    assert partition(6, 3, [1, 3, 2]) == [[0], [1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    "args, fragments",
    [
        ((4, 5), ["S=5 stages for L=4 layers", "allowed 1..4"]),
        ((4, 0), ["S=0", "allowed 1..4"]),
        ((6, 3, [1, 0, 5]), ["[1, 0, 5]", "stage 1", "allowed 1..4"]),
        ((6, 3, [1, 2]), ["2 entries for S=3"]),
        ((6, 2, [2, 2]), ["sums to 4", "L=6", "must sum to 6"]),
    ],
)
def test_partition_errors_name_the_value_and_the_allowed_range(args, fragments):
    with pytest.raises(ValueError) as err:
        partition(*args)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def test_stage_info_lays_out_pipelines_as_blocks_of_consecutive_ranks():
    one = [stage_info(r, 3, 3, 6, [2, 1, 3]) for r in range(3)]
    assert [(i.stage, i.prev_rank, i.next_rank, i.layers) for i in one] == [
        (0, None, 1, (0, 1)),
        (1, 0, 2, (2,)),
        (2, 1, None, (3, 4, 5)),
    ]
    assert all(i.dp_size == 1 and i.dp_rank == 0 for i in one)
    # 2 stages x 2 pipelines: rank = dp_rank * S + stage.
    info = stage_info(3, 4, 2, 6)
    assert (info.stage, info.dp_rank, info.dp_size, info.prev_rank, info.next_rank) == (
        1,
        1,
        2,
        2,
        None,
    )
    assert info.dp_ranks == [1, 3]
    with pytest.raises(
        ValueError, match=r"S=3 does not divide world_size=4: allowed S in \[1, 2, 4\]"
    ):
        stage_info(0, 4, 3, 6)
    with pytest.raises(ValueError, match=r"S=8 stages for L=6 layers: allowed 1\.\.6"):
        stage_info(0, 8, 8, 6)
    with pytest.raises(ValueError, match=r"rank=4: allowed 0\.\.3"):
        stage_info(4, 4, 2, 6)


def test_config_refuses_bad_values():
    with pytest.raises(ValueError, match="n_layers=0"):
        PipeGPTConfig(n_layers=0)
    with pytest.raises(ValueError, match="dim=32 is not divisible by n_heads=5"):
        PipeGPTConfig(n_heads=5)


def _owner(name: str) -> str:
    """The top-level name owning module `name`: "layers.3.attn.qkv" -> "layers.3"."""
    return ".".join(name.split(".")[:2]) if name.startswith("layers.") else name


def _param_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_split_model_keeps_exactly_the_owned_names(stages, device):
    lps = SPLITS.get(stages)
    with torch.device(device):
        full = _param_names(PipeGPT(CFG))
    seen: set[str] = set()
    for stage in range(stages):
        with torch.device(device):
            model = split_model(PipeGPT(CFG), stage, stages, lps)
        owned = stage_module_names(CFG, stage, stages, lps)
        names = _param_names(model)
        assert names == {n for n in full if any(n.startswith(o + ".") for o in owned)}
        assert not names & seen  # no parameter on two stages
        seen |= names
        # Survivors keep their full-model names: "layers.4" is not renumbered "layers.0".
        assert sorted(model.layers.keys(), key=int) == [o.split(".")[1] for o in owned if "." in o]
        model.init_weights()  # absent modules are skipped, not a crash (meta: a no-op)
        full_order = PipeGPT(CFG).init_order()
        assert model.init_order() == [n for n in full_order if _owner(n) in owned]
    assert seen == full  # together the stages hold the whole model


def test_split_model_refuses_a_model_split_already_and_a_bad_stage():
    model = split_model(PipeGPT(CFG), 0, 2)
    with pytest.raises(ValueError, match="split already"):
        split_model(model, 1, 2)
    with pytest.raises(ValueError, match=r"stage=2: allowed 0\.\.1"):
        split_model(PipeGPT(CFG), 2, 2)


def test_construction_leaves_the_global_rng_alone():
    torch.manual_seed(7)
    before = torch.get_rng_state()
    PipeGPT(CFG)
    assert torch.equal(torch.get_rng_state(), before)


def test_a_split_stage_seeded_like_the_full_model_gets_other_values():
    """The problem the pp-seed lab solves: init order decides which numbers a module draws."""
    full = dict(_full_model().named_parameters())
    stages = split_model(PipeGPT(CFG), 0, 3, SPLITS[3]), split_model(PipeGPT(CFG), 1, 3, SPLITS[3])
    for stage in stages:
        torch.manual_seed(SEED)
        stage.init_weights()
    # Stage 0's modules come first in init order: it draws what the full model drew.
    for name, p in stages[0].named_parameters():
        assert torch.equal(p, full[name]), name
    # Stage 1 starts drawing at the stream's beginning, where the full model drew tok_emb.
    w = stages[1].layers["2"].attn.qkv.weight
    assert not torch.allclose(w, full["layers.2.attn.qkv.weight"])
    # LayerNorms draw nothing, so they agree anyway.
    assert torch.equal(stages[1].layers["2"].ln1.weight, full["layers.2.ln1.weight"])


# -- GPipe on real ranks -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def single_process() -> dict:
    model = _full_model()
    losses = reference.train_steps(
        model, _sgd(model.parameters()), STEPS, global_batch=BATCH, seq_len=SEQ
    )
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    return {"losses": losses, "params": params}


def _pipeline_run(stages: int, lps: list[int] | None, microbatches: int) -> dict:
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), stages, CFG.n_layers, lps)
    model = split_model(_full_model(), info.stage, stages, lps)  # every stage starts equal
    with comm.CommLog() as log, Timeline() as tl:
        losses = train_pipeline(
            model, info, _sgd(model.parameters()), STEPS, microbatches, BATCH, SEQ
        )
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        "bytes": log.bytes_by_op(),
        "calls": log.calls_by_op(),
        "compute": [s.name for s in tl.spans if s.kind == "compute"],
    }


@pytest.mark.parametrize("stages", [2, 3, 4])
def test_gpipe_trains_exactly_like_one_process(cluster_of, single_process, stages):
    lps = SPLITS[stages]
    for m in (1, 2, 4):
        runs = cluster_of(stages).run(_pipeline_run, stages, lps, m)
        assert all(r["losses"] is None for r in runs[:-1])
        torch.testing.assert_close(
            runs[-1]["losses"], single_process["losses"], rtol=1e-5, atol=0, msg=f"M={m}"
        )
        params = {}
        for stage, r in enumerate(runs):
            params.update(r["params"])
            # Per stage: activations forward unless last, their gradients back unless first.
            mb_bytes = BATCH // m * SEQ * CFG.dim * 4
            sends = STEPS * m * ((stage < stages - 1) + (stage > 0))
            assert r["calls"] == {op: sends for op in ("send", "recv")}, (m, stage)
            assert r["bytes"] == {"send": sends * mb_bytes, "recv": sends * mb_bytes}
            # GPipe order: all forwards, then all backwards in reverse, then the step.
            order = [f"forward mb {i}" for i in range(m)]
            order += [f"backward mb {i}" for i in reversed(range(m))] + ["optimizer step"]
            assert r["compute"] == order * STEPS
        per_step = sum(r["bytes"]["send"] for r in runs) / STEPS
        assert per_step == 2 * (stages - 1) * m * (BATCH // m * SEQ * CFG.dim * 4)
        assert params.keys() == single_process["params"].keys()
        for name, expected in single_process["params"].items():
            torch.testing.assert_close(
                params[name], expected, rtol=1e-5, atol=1e-6, msg=f"S={stages} M={m} {name}"
            )
    # Training moved the weights: equal untouched models would prove nothing.
    moved = single_process["params"]["layers.3.mlp.fc.weight"]
    assert (moved - _full_model().layers["3"].mlp.fc.weight).abs().max() > 1e-3


def test_two_pipelines_side_by_side_train_like_one_process(cluster_of, single_process):
    runs = cluster_of(4).run(_pipeline_run, 2, [2, 4], 2)  # pp=2 x dp=2
    losses = [runs[1]["losses"], runs[3]["losses"]]  # each pipeline's half of the batch
    mean = [(a + b) / 2 for a, b in zip(*losses, strict=True)]
    torch.testing.assert_close(mean, single_process["losses"], rtol=1e-5, atol=0)
    for r in runs:
        assert r["calls"]["all_reduce"] == STEPS * len(r["params"])  # one per gradient
        for name, value in r["params"].items():
            torch.testing.assert_close(value, single_process["params"][name], rtol=1e-5, atol=1e-6)


def _refused(kind: str) -> str:
    r, n = fsdp_lab.rank(), fsdp_lab.world_size()
    with comm.CommLog() as log:
        try:
            if kind == "world":  # a StageInfo for 3 stages on 2 ranks
                info = stage_info(r, 3, 3, CFG.n_layers)
                gpipe_step(
                    split_model(_full_model(), r, 3), info, None, None, 1, batch_shape=(8, 16)
                )
            elif kind == "microbatches":
                info = stage_info(r, n, n, CFG.n_layers)
                model = split_model(_full_model(), r, n)
                x = torch.zeros(12, SEQ, dtype=torch.long)
                gpipe_step(model, info, x, x, 5)
            elif kind == "split":  # split [3, 3] but the StageInfo says [1, 5]
                info = stage_info(r, n, n, CFG.n_layers, [1, 5])
                gpipe_step(
                    split_model(_full_model(), r, n), info, None, None, 1, batch_shape=(8, 16)
                )
        except ValueError as exc:
            assert log.records == []  # refused before any message was sent
            return str(exc)
    return "accepted"


@pytest.mark.parametrize(
    "kind, fragments",
    [
        ("world", ["S=3 stages", "world_size=2", "allowed S in [1, 2]"]),
        ("microbatches", ["B=12", "microbatches=5", "allowed M in [1, 2, 3, 4, 6, 12]"]),
        ("split", ["holds layers", "owns layers", "split_model"]),
    ],
)
def test_bad_input_is_refused_before_any_message(cluster_of, kind, fragments):
    for message in cluster_of(2).run(_refused, kind):
        for fragment in fragments:
            assert fragment in message, message
