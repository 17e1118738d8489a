"""`fsdp-lab tying` as a user runs it: the sizes given on the command line reach every section
of the JSON (each section says what it ran on, read off the model it built), and the sentences
of the summary follow that run's numbers."""

from __future__ import annotations

import json

import pytest

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.tying.lab import report
from fsdp_lab.tying.lab.config import LAB_MODEL, SPIKE_SYSTEMS, WRAPPINGS
from fsdp_lab.tying.lab.report import SECTIONS

SIZES = {"vocab": 768, "dim": 48, "layers": 3, "heads": 2, "seq_len": 12, "batch": 3}
# The command test_cli also checks (its JSON keys, its diagrams in --out): one run for both.
# A whole run from the command line (13 s here): the lab's sections are tested in process by
# test_tying_lab.py and test_tying_analysis.py; CI makes this run after the suite (-m e2e).
pytestmark = pytest.mark.e2e
ARGS = (
    *("tying", "--world-size", "2", *(f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items())),
    *("--steps", "2", "--spike-steps", "1", "--json", "--out", "{out}"),
)


@pytest.fixture(scope="module")
def result(fsdp_lab_cli) -> dict:
    proc, _ = fsdp_lab_cli(*ARGS)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_section_ran_on_the_sizes_given(result):
    assert set(result["sections"]) == set(SECTIONS)
    for key, s in result["sections"].items():
        assert s["model"] == LAB_MODEL, key
        assert (s["vocab"], s["dim"], s["layers"]) == (
            SIZES["vocab"],
            SIZES["dim"],
            SIZES["layers"],
        ), key
        assert s["tied_bytes"] == SIZES["vocab"] * SIZES["dim"] * 4, key
        if key != "plans":  # the plans are judged, not trained
            assert (s["batch_per_rank"], s["seq_len"]) == (SIZES["batch"], SIZES["seq_len"]), key
    params = {s["parameters"] for s in result["sections"].values()}
    assert len(params) == 1  # one model, the same in every section
    (tie,) = result["ties"][LAB_MODEL]
    assert tie["shape"] == [SIZES["vocab"], SIZES["dim"]]
    # The verification trained that model: its units are the config's blocks.
    units = result["verification"]["root_unit"]["units"]
    assert units == ["root", *(f"blocks.{i}" for i in range(SIZES["layers"]))]


def test_the_summary_says_what_this_run_measured(result):
    text = report.summary(LabResult.from_dict(result))
    shape = f"{SIZES['vocab']} × {SIZES['dim']} | {SIZES['layers']} |"
    assert f"| 6 · root-unit spike | {LAB_MODEL} | {shape}" in text
    spike = result["spike"]
    for system in SPIKE_SYSTEMS:
        root, joint = (spike[system][w]["peak_bytes"][0] for w in WRAPPINGS)
        if root == joint:
            assert f"The peaks are equal ({report.format_bytes(root)})" in text
        else:
            higher = "root" if root > joint else "joint"
            diff = report.format_bytes(abs(root - joint))
            assert f"the {higher} unit's is higher by {diff}" in text
    rows = {row["system"]: row for row in result["audit"]}
    silent = [s for s, r in rows.items() if r["accepted"] and r["still_tied"] is False]
    if silent:
        assert "the claim holds only for " + silent[0] in text or "holds for every" in text
    else:
        assert "the claim holds for none of them" in text
