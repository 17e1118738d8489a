"""Lab 03 without a cluster: the spike's phases read off a made-up trace, the ranks' results
regrouped, and the summary, table and figures built from them — each number checked against
the one it must come from."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.labs.tying import TyingConfig
from fsdp_lab.labs.tying.analysis import PHASES, analyse, phase_bytes
from fsdp_lab.labs.tying.report import audit_table, figures, spike_bars, summary, verdict

CONFIG = TyingConfig(world_size=2, vocab=512, dim=64, layers=2, heads=2, spike_steps=2)
# Two training steps; each marker (time, label, live bytes). Step 1 is the one measured.
MARKERS = [
    (0.0, "wrapped", 100),
    (1.0, "embedding done", 200),
    (2.0, "head start", 300),
    (3.0, "step 0 forward done", 400),
    (4.0, "step 0 optimizer step", 150),
    (5.0, "embedding done", 210),
    (6.0, "head start", 320),
    (7.0, "step 1 forward done", 430),
    (8.0, "step 1 optimizer step", 110),
]


def make_trace(rank: int = 0, extra: int = 0, spikes: dict[float, int] | None = None) -> dict:
    """A MemoryTracker-shaped trace: a sample at every marker, plus `spikes` {t: bytes}."""
    samples = {t: total + extra for t, _, total in MARKERS} | (spikes or {})
    t = sorted(samples)
    total = [samples[x] for x in t]
    return {
        "rank": rank,
        "device": "cpu",
        "source": "storages",
        "categories": ["params"],
        "t": t,
        "bytes": {"params": total},
        "total": total,
        "markers": [{"t": t, "label": label, "total": b + extra} for t, label, b in MARKERS],
        "peak_bytes": max(total),
        "peak_by_category": {"params": max(total)},
    }


def test_phases_come_from_the_measured_step_not_the_first():
    trace = make_trace(spikes={1.5: 5000, 5.5: 900})  # a high sample in each step's blocks
    p = phase_bytes(trace, step=1)
    assert p["blocks_start_bytes"] == 210  # step 1's "embedding done", not step 0's 200
    assert p["blocks_max_bytes"] == 900  # between step 1's embedding end and head start
    assert p["end_of_forward_bytes"] == 430
    assert p["peak_bytes"] == 5000  # the whole trace's peak, in step 0 here ...
    assert p["peak_between"] == ["embedding done", "head start"]  # ... and where it was
    first = phase_bytes(trace, step=0)
    assert (first["blocks_start_bytes"], first["blocks_max_bytes"]) == (200, 5000)
    assert first["end_of_forward_bytes"] == 400


def test_a_peak_after_the_last_marker_is_between_it_and_the_end():
    assert phase_bytes(make_trace(spikes={9.0: 7000}), 1)["peak_between"] == [
        "step 1 optimizer step",
        "end",
    ]


def _measured(fsdp2: bool = True) -> dict:
    ranks = [{"units": ["blocks.0", "blocks.1", ""], "right_after_shard": [], "after_steps": []}]
    ranks.append({**ranks[0], "units": ["other"], "after_steps": ["'head.weight' drifted"]})
    to_empty = {
        "torch": "2.99",
        "ties": [["tok_emb.weight", "head.weight"]],
        "tied_on_meta": True,
        "tied_after_to_empty": False,
        "problems_after_to_empty": ["no longer share storage"],
        "shard_refused": True,
        "shard_error": "broken",
        "tied_after_retie": True,
        "shard_accepted_after_retie": True,
        "problems_after_retie_and_a_step": [],
    }
    # The root unit holds the 128 KiB matrix (512 x 64 fp32) where the joint unit freed it.
    matrix = 512 * 64 * 4
    spike = {
        "root_unit": [make_trace(r, extra=matrix) for r in range(2)],
        "joint_unit": [make_trace(r) for r in range(2)],
    }
    return {
        "world_size": 2,
        "backend": "gloo",
        "model": "fsdp_lab.models:tiny_gpt",
        "vocab_size": 64,
        "tie_plans": {"root_unit": [], "joint_unit": [], "split_tie": ["head"]},
        "ties": {"fsdp_lab.models:tiny_gpt": []},
        "plans": {
            name: {"units": units, "valid": name != "split_tie"}
            for name, units in (
                ("root_unit", ["blocks.0", "blocks.1"]),
                ("joint_unit", ["blocks.0", "blocks.1", ["tok_emb", "head"]]),
                ("split_tie", ["head"]),
            )
        },
        "verification": {
            w: {
                "per_rank": ranks,
                "max_abs_diff_vs_single_process": 3e-8,
                "head_equals_embedding": True,
            }
            for w in ("root_unit", "joint_unit")
        },
        "audit": [
            {"system": "fsdp_lab shard", "accepted": False, "stage": "wrap", "error": "a|b"}
            | {"still_tied": None, "equal_values": None}
        ],
        "to_empty": [to_empty, {**to_empty, "tied_after_to_empty": "rank 1's"}],
        "spike": {"fsdp_lab": spike, **({"fsdp2": spike} if fsdp2 else {})},
    }


def test_analyse_regroups_per_rank_and_states_shared_facts_once():
    result = analyse(CONFIG, _measured())
    v = result["verification"]["root_unit"]
    assert v["units"] == ["blocks.0", "blocks.1", ""]  # rank 0's
    assert v["steps"] == CONFIG.steps
    assert v["right_after_shard"] == [[], []]
    assert v["after_steps"] == [[], ["'head.weight' drifted"]]  # rank order kept
    te = result["to_empty"]
    assert te["torch"] == "2.99" and te["tied_on_meta"] is True
    assert te["tied_after_to_empty"] is False  # rank 0's, not rank 1's
    assert len(te["per_rank"]) == 2 and "torch" not in te["per_rank"][0]
    assert te["per_rank"][1]["tied_after_to_empty"] == "rank 1's"
    assert result["config"]["world_size"] == 2 and result["config"]["vocab"] == 512


def test_spike_phases_per_rank_and_the_peaks_at_the_top():
    spike = analyse(CONFIG, _measured())["spike"]
    matrix = 512 * 64 * 4
    assert spike["tied_matrix_bytes"] == matrix
    assert spike["model"]["vocab_size"] == 512 and spike["steps"] == 2
    root, joint = spike["fsdp_lab"]["root_unit"], spike["fsdp_lab"]["joint_unit"]
    assert root["blocks_start_bytes"] == [210 + matrix] * 2
    assert joint["end_of_forward_bytes"] == [430, 430]
    assert set(root) == {*PHASES, "peak_between", "traces"} and len(root["traces"]) == 2
    assert spike["peak_bytes_root_unit"] == root["peak_bytes"]
    assert spike["fsdp2_peak_bytes_joint_unit"] == spike["fsdp2"]["joint_unit"]["peak_bytes"]
    assert "fsdp2" not in analyse(CONFIG, _measured(fsdp2=False))["spike"]


def test_verdict_names_the_higher_wrapping_and_the_difference():
    assert verdict(3072, 3072) == "equal (3.00 KiB)"
    assert verdict(3072, 1024) == "root unit higher by 2.00 KiB (root 3.00 KiB, joint 1.00 KiB)"
    assert verdict(1024, 3072).startswith("joint unit higher by 2.00 KiB")


def test_audit_table_escapes_pipes_and_dashes_missing_values():
    rows = [{"system": "s", "accepted": True, "stage": None, "still_tied": False}]
    rows[0].update(equal_values=False, error="x | y")
    header, rule, line = audit_table(rows).splitlines()
    assert header == "| system | accepted | stage | still_tied | equal_values | error |"
    assert line == "| s | True | — | False | False | x \\| y |"


def test_summary_says_what_the_result_holds():
    text = summary(LabResult("tying", analyse(CONFIG, _measured())))
    assert (
        "- shard fsdp_lab.models:tiny_gpt with root_unit: 1 tie problems after shard and " in text
    )
    assert "max |ours - single process| = 3e-08" in text
    assert "- plan split_tie: refused" in text
    assert "### Live audit of fsdp_lab.models:tiny_gpt: head in its own unit" in text
    assert "| fsdp_lab shard | False | wrap | — | — | a\\|b |" in text
    assert "### Root-unit spike (tied matrix 128.00 KiB)" in text
    assert (
        "- fsdp_lab shard, when the blocks start (rank 0): root unit higher by 128.00 KiB" in text
    )
    assert "- FSDP2 fully_shard, end of forward (rank 0): root unit higher by 128.00 KiB" in text


@pytest.mark.parametrize("fsdp2", [True, False])
def test_figures_by_stem_with_bars_from_rank_0(fsdp2):
    result = LabResult("tying", analyse(CONFIG, _measured(fsdp2)))
    figs = figures(result)
    stems = {"wrap_root_unit", "wrap_joint_unit", "wrap_split_tie", "spike_fsdp_lab", "spike_bytes"}
    assert set(figs) == stems | ({"spike_fsdp2"} if fsdp2 else set())
    assert "INVALID" in figs["wrap_split_tie"].source
    assert "INVALID" not in figs["wrap_joint_unit"].source
    bars = spike_bars(result["spike"])
    assert isinstance(bars, Figure) and len(bars.axes) == (2 if fsdp2 else 1)
    heights = [p.get_height() for p in bars.axes[0].patches]  # root's 4 phases, then joint's
    root = result["spike"]["fsdp_lab"]["root_unit"]
    assert heights[:4] == pytest.approx([root[k][0] / 2**20 for k in PHASES])
