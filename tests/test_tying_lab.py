"""Lab 03: ties found, plans judged, the tie verified on the ranks after training, the live
audit, to_empty untying (and shard refusing until retie), and the measured root-unit spike.

The lab runs with ``model=`` a tied Llama: its verification and audit are on that model (issue
12, observation 9), the rest on TinyGPT."""

from __future__ import annotations

import json
import re

import pytest
import torch
from matplotlib.figure import Figure

from fsdp_lab.diagrams import Diagram
from fsdp_lab.models import tied_llama, tiny_gpt
from fsdp_lab.tying import lab
from fsdp_lab.tying.lab import report
from fsdp_lab.tying.lab.audit import SYSTEMS as AUDIT_SYSTEMS
from fsdp_lab.tying.lab.config import LAB_MODEL, SPIKE_SYSTEMS, WRAPPINGS
from fsdp_lab.tying.lab.measure import preflight
from fsdp_lab.tying.lab.plans import tie_plans

MODEL = "fsdp_lab.models:tied_llama"
CONFIG = lab.TyingConfig(
    world_size=2,
    steps=3,
    model=MODEL,
    vocab=2048,
    dim=64,
    layers=2,
    heads=2,
    seq_len=16,
    batch=2,
    spike_steps=2,
)
TIED_BYTES = CONFIG.vocab * CONFIG.dim * 4  # the fp32 V x d matrix
TOLERANCE = 8 * 1024  # bytes: small next to the 512 KiB matrix


@pytest.fixture(scope="module")
def result(cluster_of, one_thread_per_rank):
    with one_thread_per_rank(cluster_of(2)) as cluster:
        return lab.run(CONFIG, cluster=cluster)


def test_result_is_json_with_the_issue_keys(result):
    data = json.loads(result.to_json())
    for key in ("audit", "spike", "ties", "verification", "to_empty", "plans"):
        assert key in data, key
    spike = data["spike"]
    for key in ("peak_bytes_root_unit", "peak_bytes_joint_unit"):
        assert len(spike[key]) == 2 and len(spike[f"fsdp2_{key}"]) == 2


def test_ties_of_the_lab_model_and_of_a_given_model(result):
    (tie,) = result["ties"][LAB_MODEL]  # TinyGPT at the config's sizes
    assert tie["names"] == ["tok_emb.weight", "head.weight"]
    assert tie["modules"] == ["tok_emb", "head"]
    assert tie["module_types"] == ["Embedding", "Linear"]
    assert tie["kind"] == "identity" and tie["shape"] == [CONFIG.vocab, CONFIG.dim]
    assert tie["bytes"] == TIED_BYTES
    (tie,) = result["ties"][MODEL]
    assert tie["names"] == ["tok_embeddings.weight", "output.weight"]
    assert tie["modules"] == ["tok_embeddings", "output"] and tie["kind"] == "identity"


def test_the_plans_of_a_given_model_come_from_its_tie_and_its_blocks(result):
    layers = [f"layers.{i}" for i in range(4)]
    assert result["tie_plans"] == {
        "root_unit": layers,
        "joint_unit": [*layers, ["tok_embeddings", "output"]],
        "split_tie": ["output"],
    }
    assert result["model"] == MODEL and result["vocab_size"] == 64
    # On TinyGPT: its blocks, and its embedding and head.
    blocks = [f"blocks.{i}" for i in range(len(tiny_gpt().blocks))]
    assert tie_plans(tiny_gpt()) == {
        "root_unit": blocks,
        "joint_unit": [*blocks, ["tok_emb", "head"]],
        "split_tie": ["head"],
    }
    assert tie_plans(tied_llama()) == result["tie_plans"]


def test_each_section_says_which_model_it_ran_on(result):
    # The given model's own sizes where it ran (a factory takes no sizes), the config's
    # TinyGPT everywhere else; read off the models the sections built.
    llama = tied_llama()
    sections = result["sections"]
    for key in ("verification", "audit"):
        s = sections[key]
        assert s["model"] == MODEL
        assert [s["vocab"], s["dim"]] == list(llama.tok_embeddings.weight.shape)
        assert s["layers"] == len(llama.layers)
        assert s["parameters"] == sum(p.numel() for p in llama.parameters())
        assert (s["batch_per_rank"], s["seq_len"]) == (2, 16)
    assert sections["verification"]["steps"] == CONFIG.steps
    for key in ("plans", "to_empty", "spike"):
        s = sections[key]
        assert s["model"] == LAB_MODEL
        assert (s["vocab"], s["dim"], s["layers"]) == (CONFIG.vocab, CONFIG.dim, CONFIG.layers)
        assert s["tied_bytes"] == TIED_BYTES
    assert (sections["spike"]["batch_per_rank"], sections["spike"]["seq_len"]) == (2, 16)
    assert sections["spike"]["steps"] == CONFIG.spike_steps


def test_the_spike_sentences_follow_this_runs_numbers(result):
    spike = result["spike"]
    for system in SPIKE_SYSTEMS:
        root, joint = (spike[system][w]["peak_bytes"][0] for w in WRAPPINGS)
        text = report.spike_paragraph(spike, system)
        if root == joint:
            assert "The peaks are equal" in text and "differ" not in text
        else:
            higher = "root" if root > joint else "joint"
            assert f"The peaks differ: the {higher} unit's is higher by" in text
        # Our shard, told to: every unit but the root freed after forward; FSDP2 decides so at
        # its first forward (read from its private param groups: a new torch may move them).
        said = report.freed_sentence(spike, system)
        if spike[system]["root_unit"]["freed_after_forward"] is None:
            assert system == "fsdp2" and "could not be read on this torch" in said
        else:
            assert "after forward it freed every unit but the root unit" in said, said
    ours = report.spike_paragraph(spike, "fsdp_lab")
    assert "A plateau, not a spike" in ours  # measured: the root unit holds it throughout
    assert spike["fsdp_lab"]["root_unit"]["freed_after_forward"] == {
        **{f"blocks.{i}": True for i in range(CONFIG.layers)},
        "root": False,
    }


def test_a_model_without_a_tie_is_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="the MLPStack has no tied parameters") as err:
        preflight(lab.TyingConfig(model="fsdp_lab.models:MLPStack"))
    assert str(err.value).startswith("--model 'fsdp_lab.models:MLPStack': ")
    assert "Fix: a model whose head shares the embedding's Parameter" in str(err.value)


def test_plans_valid_and_invalid(result):
    plans = result["plans"]
    assert plans["root_unit"]["valid"] and plans["joint_unit"]["valid"]
    assert "tok_emb+head" in plans["joint_unit"]["plan"]
    split = plans["split_tie"]
    assert not split["valid"] and "'tok_emb.weight'" in split["error"]
    assert split["conflicts"] == [
        {"param": "tok_emb.weight", "owners": ["tok_emb", "head"], "units": ["", "head"]}
    ]


def test_audit_has_every_system_and_ours_refuses_at_wrap(result):
    rows = {row["system"]: row for row in result["audit"]}
    assert list(rows) == list(AUDIT_SYSTEMS)
    ours = rows["fsdp_lab shard"]
    assert ours["accepted"] is False and ours["stage"] == "wrap"
    # The given model's tie was split: its output head in a unit, its embedding in the root.
    assert "'tok_embeddings.weight'" in ours["error"] and "'output'" in ours["error"]


def test_tie_holds_after_shard_and_training_and_matches_one_process(result):
    for name in WRAPPINGS:
        v = result["verification"][name]
        assert v["right_after_shard"] == [[], []]
        assert v["after_steps"] == [[], []]
        assert v["head_equals_embedding"] is True
        assert v["max_abs_diff_vs_single_process"] < 1e-5  # SGD, as in test_shard_lab
    # On the given model: its joint unit is its embedding and output head.
    assert "tok_embeddings+output" in result["verification"]["joint_unit"]["units"]
    assert "tok_embeddings+output" not in result["verification"]["root_unit"]["units"]


def test_to_empty_result_is_what_torch_does_and_shard_follows_it(result):
    te = result["to_empty"]
    assert te["ties"] == [["tok_emb.weight", "head.weight"]] and te["tied_on_meta"] is True
    with torch.device("meta"):
        model = tiny_gpt()
    model.to_empty(device="cpu")
    tied = model.head.weight is model.tok_emb.weight
    assert te["tied_after_to_empty"] is tied and te["tied_after_retie"] is True
    for r in te["per_rank"]:
        assert r["tied_after_to_empty"] is tied
        assert r["shard_refused"] is (not tied)
        if not tied:  # the measured refusal names the broken tie and the fix
            assert "'head.weight'" in r["shard_error"] and "retie" in r["shard_error"]
            assert r["problems_after_to_empty"]
        assert r["tied_after_retie"] and r["shard_accepted_after_retie"]
        assert r["problems_after_retie_and_a_step"] == []


def test_root_unit_holds_the_tied_matrix_where_the_joint_unit_frees_it(result):
    ours = result["spike"]["fsdp_lab"]
    root, joint = ours["root_unit"], ours["joint_unit"]
    for r in range(2):
        # The joint unit is freed after the embedding: absent when the blocks start ...
        assert root["blocks_start_bytes"][r] - joint["blocks_start_bytes"][r] >= (
            TIED_BYTES - TOLERANCE
        )
        # ... and after the head; the root unit keeps it until the end of backward.
        assert root["end_of_forward_bytes"][r] - joint["end_of_forward_bytes"][r] >= (
            TIED_BYTES - TOLERANCE
        )
        # Both gather the full matrix for the head and hold its gradient in backward.
        assert root["peak_bytes"][r] >= TIED_BYTES and joint["peak_bytes"][r] >= TIED_BYTES


def test_every_trace_peak_is_the_max_of_its_samples(result):
    spike = result["spike"]
    for system in SPIKE_SYSTEMS:
        for w in WRAPPINGS:
            run = spike[system][w]
            for r, trace in enumerate(run["traces"]):
                assert trace["peak_bytes"] == max(trace["total"]) == run["peak_bytes"][r]
                assert run["blocks_max_bytes"][r] >= run["blocks_start_bytes"][r]
                labels = {m["label"] for m in trace["markers"]}
                assert set(run["peak_between"][r]) <= labels | {"start", "end"}
            prefix = "" if system == "fsdp_lab" else "fsdp2_"
            assert spike[f"{prefix}peak_bytes_{w}"] == run["peak_bytes"]


def test_figures_are_plots_and_wrap_diagrams(result):
    figs = lab.figures(result)
    assert {"wrap_root_unit", "wrap_joint_unit", "wrap_split_tie"} <= set(figs)
    for name, fig in figs.items():
        assert isinstance(fig, Diagram if name.startswith("wrap_") else Figure), name
    assert "INVALID" in figs["wrap_split_tie"].source
    assert "INVALID" not in figs["wrap_joint_unit"].source
    text = lab.summary(result)
    assert "| fsdp_lab shard | False | wrap |" in text
    assert f"### Live audit of {MODEL}: output in its own unit" in text
    assert "fsdp_lab shard, end of forward (rank 0): root unit higher by" in text


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"world_size": 0}, "world_size=0 is out of range: allowed an int >= 1 (ranks)"),
        (
            {"vocab": 0},
            "vocab=0 is out of range: allowed an int from 2 to 1,048,576 (rows of the tied",
        ),
        ({"vocab": 0}, "Fix: vocab=32768"),  # in Python terms; the CLI says --vocab 32768
        ({"spike_steps": True}, "spike_steps=True: expected an int"),
        ({"steps": -1}, "steps=-1 is out of range"),
        ({"dim": 30, "heads": 4}, "dim=30 is not divisible by heads=4"),
        ({"lr": 0.0}, "lr=0.0 is out of range: allowed a number from 1e-08 to 10"),
        ({"model": "nocolon"}, "expected 'module:factory'"),
    ],
)
def test_bad_config_names_the_value_the_range_and_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)) as err:
        lab.TyingConfig(**kwargs)
    assert "Fix:" in str(err.value)
