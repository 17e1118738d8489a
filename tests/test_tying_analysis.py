"""Lab 03 without a cluster: the spike's phases read off a made-up trace, the ranks' results
regrouped, and the summary, table and figures built from them — each number checked against
the one it must come from."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.tying.lab import TyingConfig, report
from fsdp_lab.tying.lab.analysis import PHASES, analyse, phase_at, phase_bytes, spike
from fsdp_lab.tying.lab.figures import figures, short_units, spike_bars
from fsdp_lab.tying.lab.report import audit_table, summary, verdict

CONFIG = TyingConfig(world_size=2, vocab=512, dim=64, layers=2, heads=2, spike_steps=2)
# Two training steps; each marker (time, label, live bytes). Step 1 is the one measured.
MARKERS = [
    (0.0, "wrapped", 100),
    (1.0, "embedding done", 200),
    (2.0, "head start", 300),
    (3.0, "step 0 forward done", 400),
    (3.5, "step 0 backward done", 160),
    (4.0, "step 0 optimizer step", 150),
    (5.0, "embedding done", 210),
    (6.0, "head start", 320),
    (7.0, "step 1 forward done", 430),
    (7.5, "step 1 backward done", 120),
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


MATRIX = 512 * 64 * 4  # CONFIG's tied matrix, fp32
BUILT = {  # `plans.model_sizes` of CONFIG's TinyGPT
    "model": "fsdp_lab.models:tiny_gpt",
    "vocab": 512,
    "dim": 64,
    "layers": 2,
    "parameters": 133_504,
    "block_bytes": 2 * 49_920 * 4,
    "tied_bytes": MATRIX,
}
TIE = ["tok_emb.weight", "head.weight"]
ROOT_KEPT = {"blocks.0": True, "blocks.1": True, "root": False}  # freed after forward?


def run(trace: dict, freed: dict | None = ROOT_KEPT) -> dict:
    """A `spike_worker` result around a trace."""
    return {"trace": trace, "model": BUILT, "freed_after_forward": freed}


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
    spike = {
        "root_unit": [run(make_trace(r, extra=MATRIX)) for r in range(2)],
        "joint_unit": [run(make_trace(r)) for r in range(2)],
    }
    return {
        "world_size": 2,
        "backend": "gloo",
        "model": "fsdp_lab.models:tiny_gpt",
        "vocab_size": 64,
        "tie_plans": {"root_unit": [], "joint_unit": [], "split_tie": ["head"]},
        "ties": {"fsdp_lab.models:tiny_gpt": [{"names": TIE, "kind": "identity"}]},
        "sections": {
            key: {**BUILT, "batch_per_rank": 2, "seq_len": 16, "steps": 2}
            for key in ("plans", "verification", "audit", "to_empty", "spike")
        },
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
    extra = {"blocks_min_bytes", "peak_between", "peak_phase", "freed_after_forward", "traces"}
    assert set(root) == {*PHASES, *extra} and len(root["traces"]) == 2
    assert root["freed_after_forward"] == ROOT_KEPT
    assert spike["block_bytes"] == BUILT["block_bytes"] and spike["layers"] == 2
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
    assert "max |ours − single process| = 3e-08" in text
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


# -- where the peak falls, and section 6's sentences built from the spike ------------------------


def test_phase_at_reads_the_step_and_phase_from_the_next_step_marker():
    markers = make_trace()["markers"]
    assert phase_at(markers, 0.5) == {"step": 0, "phase": "forward"}
    assert phase_at(markers, 3.2) == {"step": 0, "phase": "backward"}
    assert phase_at(markers, 3.7) == {"step": 0, "phase": "optimizer step"}
    assert phase_at(markers, 7.0) == {"step": 1, "phase": "forward"}  # at the marker: its phase
    assert phase_at(markers, 7.2) == {"step": 1, "phase": "backward"}
    assert phase_at(markers, 9.0) == {"step": None, "phase": "after training"}
    peak = phase_bytes(make_trace(spikes={7.2: 9000}), step=1)
    assert peak["peak_phase"] == {"step": 1, "phase": "backward"}
    assert peak["peak_between"] == ["step 1 forward done", "step 1 backward done"]


PEAK = 10 * MATRIX  # a peak above everything else in the made-up traces


def _spike(root: dict, joint: dict, freed: tuple = (ROOT_KEPT, ROOT_KEPT)) -> dict:
    """`analysis.spike` of one system (ours) on one rank."""
    runs = {"fsdp_lab": {"root_unit": [run(root, freed[0])], "joint_unit": [run(joint, freed[1])]}}
    return spike(CONFIG, runs)


def test_default_sizes_shape_peaks_equal_in_backward_and_the_matrix_held_as_a_plateau():
    # The root unit holds the matrix at every sample; both peaks in step 1's backward, equal.
    s = _spike(make_trace(extra=MATRIX, spikes={7.2: PEAK}), make_trace(spikes={7.2: PEAK}))
    text = report.spike_paragraph(s, "fsdp_lab")
    assert "The root unit held the tied matrix from the embedding to the end of forward" in text
    assert "128.00 KiB more than the joint unit at the lowest point while the blocks ran" in text
    assert "A plateau, not a spike at the embedding's gather and another at the head's." in text
    assert "- Both peaks fell in step 1's backward." in text
    assert "- The peaks are equal (1.25 MiB): at these sizes the joint unit does not lower" in text
    assert "differ" not in text


def test_v4096_shape_peaks_differ_and_fall_in_different_phases():
    # As measured at V=4096: the root unit's peak in backward is higher than the joint unit's,
    # which falls in forward.
    root = make_trace(extra=MATRIX, spikes={7.2: PEAK + 3 * 1024})
    joint = make_trace(spikes={6.5: PEAK})
    text = report.spike_paragraph(_spike(root, joint), "fsdp_lab")
    assert (
        "The root unit's peak fell in step 1's backward, the joint unit's in step 1's forward"
        in text
    )
    assert (
        "- The peaks differ: the root unit's is higher by 3.00 KiB (2% of the tied matrix;" in text
    )
    assert "equal" not in text and "plateau" in text
    # ... and the other way round.
    joint = make_trace(spikes={7.2: PEAK + 5 * 1024})
    text = report.spike_paragraph(
        _spike(make_trace(extra=MATRIX, spikes={7.2: PEAK}), joint), "fsdp_lab"
    )
    assert "the joint unit's is higher by 5.00 KiB" in text


def test_a_joint_unit_that_holds_through_the_blocks_is_said_so_and_no_plateau_is_claimed():
    # FSDP2's group: held from the embedding to the head, freed only after it.
    root = make_trace(extra=MATRIX, spikes={7.2: PEAK})
    joint = make_trace(spikes={5.0: 210 + MATRIX, 6.0: 320 + MATRIX, 7.2: PEAK})
    text = report.spike_paragraph(_spike(root, joint), "fsdp_lab")
    assert "While the blocks ran the joint unit held as much as the root unit" in text
    assert "The root unit held 128.00 KiB more only at the end of forward." in text
    assert "plateau" not in text
    # Neither difference reaches the matrix: the numbers, and no story.
    same = report.spike_paragraph(_spike(make_trace(), make_trace()), "fsdp_lab")
    assert "less than the tied matrix both times" in same and "plateau" not in same


@pytest.mark.parametrize(
    "freed, said",
    [
        (
            (ROOT_KEPT, ROOT_KEPT),
            "with both plans: after forward it freed every unit but the root unit, which "
            "stayed gathered for the backward.",
        ),
        (
            ({"blocks.0": True, "root": True},) * 2,
            "with both plans: after forward it freed every unit, the root unit included.",
        ),
        (
            (ROOT_KEPT, {"blocks.0": False, "root": False}),
            "in this run: after forward, with the root unit plan it freed every unit but the "
            "root unit, which stayed gathered for the backward; with the joint unit plan it "
            "freed no unit, kept blocks.0 and root.",
        ),
        ((None, ROOT_KEPT), "which units it freed after forward could not be read on this torch"),
    ],
)
def test_which_units_were_freed_after_forward_is_read_from_the_run(freed, said):
    s = _spike(make_trace(), make_trace(), freed)
    assert said in report.freed_sentence(s, "fsdp_lab")


def _row(system: str, accepted: bool, stage=None, error=None, tied=None, equal=None) -> dict:
    return {"system": system, "accepted": accepted, "stage": stage, "error": error} | {
        "still_tied": tied,
        "equal_values": equal,
    }


def test_audit_paragraph_on_what_torch_2_13_did():
    rows = [
        _row("fsdp1 use_orig_params=False", True, tied=False, equal=False),
        _row("fsdp1 use_orig_params=True", False, "forward", "RuntimeError: 'weight' must be 2-D"),
        _row(
            "fsdp2 fully_shard", False, "forward", "ValueError: Parameter 'head.weight' is shared"
        ),
        _row("fsdp_lab shard", False, "wrap", "PlanError: parameter 'tok_emb.weight' is shared"),
    ]
    text = report.audit_paragraph(rows, TIE, "2.13.0+cpu")
    assert "Measured on torch 2.13.0+cpu" in text
    assert (
        "- **accepted the plan and broke the tie without an error**: **fsdp1 "
        "use_orig_params=False** (two tensors after one step; their values already differ)."
    ) in text
    assert "- **refused, naming the tie**: **fsdp2 fully_shard** in the first forward:" in text
    assert "- **refused, naming the tie**: **fsdp_lab shard** when wrapping:" in text
    assert (
        "- **failed with an error that does not name the tie**: **fsdp1 use_orig_params=True** "
        "in the first forward: `RuntimeError: 'weight' must be 2-D`"
    ) in text
    assert text.endswith(
        "So on this torch the claim holds only for fsdp1 use_orig_params=False; not for fsdp1 "
        "use_orig_params=True, fsdp2 fully_shard and fsdp_lab shard."
    )


def test_audit_paragraph_follows_a_torch_that_answers_otherwise():
    refuse = [_row(f"s{i}", False, "wrap", "ValueError: tied parameter split") for i in range(2)]
    text = report.audit_paragraph(refuse, TIE, "9.0")
    assert text.endswith("the claim holds for none of them: no system broke the tie silently.")
    assert "broke the tie without an error" not in text
    silent = [_row(f"s{i}", True, tied=False, equal=i == 0) for i in range(2)]
    text = report.audit_paragraph(silent, TIE, "9.0")
    assert "their values are still equal" in text and "their values already differ" in text
    assert text.endswith("So on this torch the claim holds for every system audited.")
    kept = [_row("a", True, tied=True, equal=True), _row("b", True, error="tie check failed: x")]
    text = report.audit_paragraph(kept, TIE, "9.0")
    assert "- **accepted it and kept one tensor for both modules**: **a**." in text
    assert "- **accepted it; the tie could not be inspected**: **b** (tie check failed: x)." in text


# -- tables and docs/labs.md's spike table --------------------------------------------------------


def test_tables_show_every_dict_as_rows():
    result = LabResult("tying", analyse(CONFIG, _measured()))
    sections = report.sections_table(result).splitlines()
    assert sections[0].startswith("| section | model | tied V × d | blocks | parameters |")
    assert len(sections) == 2 + len(report.SECTIONS)
    assert sections[3] == (
        "| 3 · shard, train, verify | fsdp_lab.models:tiny_gpt | 512 × 64 | 2 | 133,504 | "
        "2 × 16 | 2 |"
    )
    to_empty = report.to_empty_table(result["to_empty"], "to_empty").splitlines()
    assert to_empty[0] == "| on torch 2.99 | rank 0 | rank 1 |"
    assert "| tied after to_empty | False | rank 1's |" in to_empty
    assert "| tie problems after a step | 0 | 0 |" in report.to_empty_table(
        result["to_empty"], "retie"
    )
    with pytest.raises(ValueError, match="stage='later': expected one of"):
        report.to_empty_table(result["to_empty"], "later")
    config = report.config_table(CONFIG)
    assert (
        "| vocab | 512 | rows of the tied embedding/head matrix (TinyGPT, every section). |"
        in config
    )
    verification = report.verification_table(result).splitlines()
    assert verification[2].startswith("| root_unit | blocks.0, blocks.1,  | 0 | 1 | True | 3e-08 |")
    ties = [{"names": TIE, "modules": ["tok_emb", "head"], "module_types": ["Embedding", "Linear"]}]
    ties[0].update(kind="identity", shape=[512, 64], bytes=MATRIX)
    assert report.ties_table(ties).splitlines()[2] == (
        "| tok_emb.weight = head.weight | tok_emb (Embedding), head (Linear) | identity | "
        "512 × 64 | 128.00 KiB |"
    )
    assert "| split_tie | ['head'] | refused |" in report.plans_table(result["plans"])


def test_readme_spike_table_has_a_row_per_run_and_rank_0s_bytes():
    result = LabResult("tying", analyse(CONFIG, _measured()))
    lines = report.spike_table(result).splitlines()
    assert (
        lines[0]
        == "|  | peak | when the blocks start | most while the blocks run | end of forward |"
    )
    root = result["spike"]["fsdp_lab"]["root_unit"]
    assert (
        lines[2]
        == "| ours, tied pair in the root unit | "
        + " | ".join(report.format_bytes(root[k][0]) for k in PHASES)
        + " |"
    )
    assert [line.split(" | ")[0] for line in lines[2:]] == [
        "| ours, tied pair in the root unit",
        '| ours, joint unit `("tok_emb", "head")`',
        "| FSDP2, root unit",
        "| FSDP2, `fully_shard([tok_emb, head])`",
    ]
    assert len(report.spike_table(LabResult("tying", analyse(CONFIG, _measured(False))))) < len(
        "\n".join(lines)
    )
    caption = report.spike_caption(result)
    assert caption.startswith("the root-unit spike, TinyGPT with V=512, d=64 (tied matrix 128.00")
    assert "2 blocks, batch 2 × 64 tokens per rank, last of 2 SGD steps" in caption
    assert caption.endswith("(both ranks alike):")


def test_short_units_shortens_runs_of_numbered_siblings():
    blocks = [f"blocks.{i}" for i in range(12)]
    assert short_units([*blocks, ["tok_emb", "head"]]) == (
        "'blocks.0', …, 'blocks.11', ['tok_emb', 'head']"
    )
    assert short_units(blocks[:3]) == "'blocks.0', 'blocks.1', 'blocks.2'"
    assert short_units(["head"]) == "'head'"


def test_verification_and_to_empty_sentences_follow_the_result():
    result = LabResult("tying", analyse(CONFIG, _measured()))
    text = report.verification_sentence(result)  # rank 1 found a drifted head in both plans
    assert text.startswith("The tie did not hold: root_unit (1 problems) and joint_unit (1 ")
    assert text.endswith(
        "differ by at most 3e-08: float rounding (the ranks sum their gradients in another order)."
    )
    clean = _measured()
    for v in clean["verification"].values():
        v["per_rank"] = [{**r, "after_steps": []} for r in v["per_rank"]]
        v["max_abs_diff_vs_single_process"] = 0.02
    text = report.verification_sentence(LabResult("tying", analyse(CONFIG, clean)))
    assert text.startswith("The tie held with both plans: no problem on any rank right after")
    assert text.endswith("at most 0.02: more than float rounding (above 1e-05).")
    te = result["to_empty"]
    assert report.to_empty_sentence(te) == (
        "On torch 2.99, `to_empty` untied the model: `tok_emb.weight` and `head.weight` are now "
        "two Parameters. `shard`, given the ties recorded on meta, refused it (rank 0)."
    )
    kept = {**te, "tied_after_to_empty": True, "per_rank": [{"shard_refused": False}]}
    assert report.to_empty_sentence(kept) == (
        "On torch 2.99, `to_empty` kept the tie: `tok_emb.weight` and `head.weight` are one "
        "Parameter. `shard`, given the ties recorded on meta, accepted it (rank 0)."
    )


def test_matrix_sentence_compares_the_tied_matrix_with_the_blocks():
    s = analyse(CONFIG, _measured())["spike"]
    assert report.matrix_sentence(s) == (
        "Here V = 512, d = 64: the tied matrix is 128.00 KiB, less than the 2 blocks together "
        "(390.00 KiB)."
    )
    assert "more than the 2 blocks" in report.matrix_sentence({**s, "block_bytes": 1024})
