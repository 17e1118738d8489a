"""fsdp_lab.pipeline: stages own exactly their modules, and GPipe over S ranks trains exactly
like one process — same losses, same parameters — with 2 (S-1) M activation-sized messages;
for PipeGPT and for models this package did not write (tests/foreign_models.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from foreign_models import FACTORIES, N_LAYERS, TitanLlama, reference_init, torch_sequential

import fsdp_lab
from fsdp_lab import comm, reference
from fsdp_lab.models import Llama, MLPStack
from fsdp_lab.pipeline import (
    PipeGPT,
    PipeGPTConfig,
    SequentialStage,
    gpipe_step,
    partition,
    plan_stages,
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
            elif kind == "unsplit":  # the whole model of someone else, never split
                info = stage_info(r, n, n, 4)
                gpipe_step(TitanLlama(), info, None, None, 1, batch_shape=(8, 16))
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
        ("unsplit", ["TitanLlama is not a pipeline stage", "split_model(model, "]),
    ],
)
def test_bad_input_is_refused_before_any_message(cluster_of, kind, fragments):
    for message in cluster_of(2).run(_refused, kind):
        for fragment in fragments:
            assert fragment in message, message


# -- any model: split by module names, a default split, GPipe like one process ------------------


def _keys(model: nn.Module) -> set[str]:
    return set(model.state_dict())


@pytest.mark.parametrize(
    "factory, stages",
    [
        (  # torchtitan's shape: the children before `layers` on stage 0, after it on the last
            TitanLlama,
            [
                ["tok_embeddings", "layers.0", "layers.1"],
                ["layers.2", "layers.3", "norm", "output"],
            ],
        ),
        (torch_sequential, [["0", "1", "2", "3"], ["4", "5", "6"]]),  # an nn.Sequential itself
        (MLPStack, [["emb", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]),
    ],
)
def test_any_model_splits_by_module_names_with_a_default_for_its_layers(factory, stages):
    torch.manual_seed(0)
    plan = plan_stages(factory(), 2)
    assert [list(names) for names in plan.names] == stages
    assert plan.forward == "sequence" and plan.vocab_size == (64 if factory is MLPStack else 32)
    full = _keys(factory())
    for given in (2, stages):  # the default split, and the same names given explicitly
        seen: set[str] = set()
        for stage in range(2):
            model = factory()
            part = split_model(model, stage, given)
            assert isinstance(part, SequentialStage) and part.stage_spec.index == stage
            # The stage keeps the full model's names: checkpoints and optimizers line up.
            keys = _keys(part)
            assert keys == {k for k in full if any(k.startswith(n + ".") for n in stages[stage])}
            assert not keys & seen
            seen |= keys
            assert _keys(model) == full  # "sequence" leaves the model whole
        assert seen == full


def test_the_stages_run_one_after_another_compute_the_model():
    torch.manual_seed(0)
    model, x = TitanLlama(), torch.randint(0, 32, (3, 5))
    stages = [split_model(model, s, 2) for s in range(2)]
    assert torch.equal(stages[1](stages[0](x)), model(x))
    assert stages[0](x).shape == (3, 5, 16)  # what flows: (B, T, dim), probed at the split
    assert stages[0].stage_spec.sends() == ((16,), torch.float32)


def test_uneven_explicit_and_pipegpt_splits():
    model = TitanLlama()
    assert plan_stages(model, 2, [1, 3]).names[0] == ("tok_embeddings", "layers.0")
    three = [
        ["tok_embeddings", "layers.0"],
        ["layers.1", "layers.2"],
        ["layers.3", "norm", "output"],
    ]
    assert [list(n) for n in plan_stages(model, three).names] == three
    # PipeGPT stays what it was: its own forward, the other stages' modules removed in place.
    plan = plan_stages(PipeGPT(CFG), 2, [1, 5])
    assert plan.forward == "model" and plan.names[0] == ("tok_emb", "pos_emb", "layers.0")
    assert plan.activations == (((CFG.dim,), torch.float32),) and plan.vocab_size == CFG.vocab_size
    part = split_model(PipeGPT(CFG), 1, [list(n) for n in plan.names])
    assert (
        isinstance(part, PipeGPT) and part.tok_emb is None and sorted(part.layers) == list("12345")
    )


class _Scaled(MLPStack):
    """A forward that is not the chain of its children: the embedding is scaled in between."""

    def forward(self, idx):
        x = self.emb(idx) * 2.0
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class _LogitsInADict(nn.Module):
    """A head that returns an output object (a dict here), as many libraries' models do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)

    def forward(self, x):
        return {"logits": self.proj(x)}


def _dict_output():
    model = TitanLlama()
    model.output = _LogitsInADict()
    return model


class _NoContainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.mid, self.out = nn.Embedding(8, 4), nn.Linear(4, 4), nn.Linear(4, 8)

    def forward(self, x):
        return self.out(self.mid(self.emb(x)))


def _tied_llama():
    model = TitanLlama()
    model.output.weight = model.tok_embeddings.weight
    return model


TITAN_HALVES = [
    ["tok_embeddings", "layers.0", "layers.1"],
    ["layers.2", "layers.3", "norm", "output"],
]


@pytest.mark.parametrize(
    "make, stages, kwargs, fragments",
    [
        (
            _NoContainer,
            2,
            {},
            ["no child named layers / blocks / h", "stages=[['emb'], ['mid', 'out']]"],
        ),
        (
            TitanLlama,
            [["tok_embeddings", "layers.9"], ["norm"]],
            {},
            ["'layers.9'", "not a module"],
        ),
        (TitanLlama, [["tok_embeddings", "layers"], ["layers.0"]], {}, ["'layers' and 'layers.0'"]),
        (TitanLlama, [TITAN_HALVES[0], TITAN_HALVES[1][:-1]], {}, ["'output.weight'", "no stage"]),
        (_tied_llama, 2, {}, ["'tok_embeddings.weight' (stage 0)", "(stage 1) are one tied"]),
        (Llama, 2, {}, ["not a plain sequence", "extra arguments", "forward='model'"]),
        (_Scaled, 2, {}, ["not the plain sequence", "differ from model(x)", "forward='model'"]),
        (TitanLlama, 2, {"forward": "model"}, ["inside ModuleList 'layers'", "ModuleDict"]),
        (
            TitanLlama,
            [TITAN_HALVES[1], TITAN_HALVES[0]],
            {},
            ["stage 0 of 2 cannot run", "not in the order"],
        ),
        (_dict_output, 2, {}, ["stage 1 of 2", "returns a dict", "logits (B, T, vocab)"]),
        (TitanLlama, 2, {"forward": "pipe"}, ["forward='pipe'", "'sequence', 'model'"]),
        (TitanLlama, "layers", {}, ["stages='layers'", "e.g. stages=[["]),
        (
            TitanLlama,
            [["tok_embeddings"], ["layers.0"]],
            {"layers_per_stage": [1, 1]},
            ["with stages given as module names"],
        ),
    ],
)
def test_split_errors_name_the_value_and_the_fix(make, stages, kwargs, fragments):
    with pytest.raises(ValueError) as err:
        plan_stages(make(), stages, **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)


def _train_any(name: str, microbatches: int) -> dict:
    info = stage_info(fsdp_lab.rank(), fsdp_lab.world_size(), 2, N_LAYERS[name])
    model = split_model(reference_init(name, SEED), info.stage, 2)
    losses = train_pipeline(model, info, _sgd(model.parameters()), 3, microbatches, BATCH, SEQ)
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.named_parameters()},
    }


@pytest.mark.parametrize("name", sorted(FACTORIES))
def test_gpipe_trains_any_model_like_one_process(cluster_of, name):
    model = reference_init(name, SEED)
    model.vocab_size = 32  # reference.train_steps reads it; the pipeline read it off the logits
    losses = reference.train_steps(
        model, _sgd(model.parameters()), 3, global_batch=BATCH, seq_len=SEQ
    )
    for m in (1, 2):
        runs = cluster_of(2).run(_train_any, name, m)
        params = {**runs[0]["params"], **runs[1]["params"]}
        assert params.keys() == dict(model.named_parameters()).keys()
        if m == 1:  # the same kernels on the same tensors in the same order: bit for bit
            assert runs[1]["losses"] == losses
            assert all(torch.equal(params[k], v) for k, v in model.named_parameters())
        else:  # micro-batching sums the gradient in another order: float rounding only
            torch.testing.assert_close(runs[1]["losses"], losses, rtol=1e-5, atol=0)
            for k, v in model.named_parameters():
                torch.testing.assert_close(params[k], v, rtol=1e-5, atol=1e-6, msg=k)
    moved = max(
        (v - reference_init(name, SEED).state_dict()[k]).abs().max()
        for k, v in model.state_dict().items()
    )
    assert moved > 1e-3  # training moved the weights: equal untouched models would prove nothing
