"""The command line: one JSON object with --json, figures with --out, the tour, torchrun."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_shard_lab import KEYS as SHARD_KEYS

ENV = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}


def fsdp_lab(
    *args: str, cwd: Path | None = None, timeout: int = 300
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fsdp_lab", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=cwd,
        timeout=timeout,
    )


def test_json_prints_exactly_one_object_with_measured_bytes():
    proc = fsdp_lab("collectives", "--world-size", "3", "--numel", "999", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # fails if anything else was printed on stdout
    assert result["lab"] == "collectives" and result["world_size"] == 3
    shard = 999 * 4
    assert (
        result["comm_bytes_per_rank"]
        == [
            {
                "broadcast": shard,
                "all_gather_into_tensor": 2 * shard,
                "reduce_scatter_tensor": 2 * shard,
                "all_reduce": 2 * 2 / 3 * shard,
            }
        ]
        * 3
    )
    assert result["matches_theory"] is True
    assert "rank(s) up on gloo" in proc.stderr  # progress went to stderr, not stdout


def test_out_writes_png_figures_and_the_json(tmp_path):
    proc = fsdp_lab("collectives", "--world-size", "2", "--numel", "256", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert "measured equals theory on every rank: True" in proc.stdout
    pngs = sorted(p.name for p in tmp_path.glob("*.png"))
    assert {"bytes_vs_theory.png", "memory_trace.png", "timeline.png"} <= set(pngs)
    for png in tmp_path.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "collectives.json").read_text())["world_size"] == 2


def test_tour_runs_every_lab_with_progress_and_summary(tmp_path):
    proc = fsdp_lab("tour", "--world-size", "2", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    from fsdp_lab.cli import LABS

    for i, lab in enumerate(LABS, 1):
        assert f"[{i}/{len(LABS)}] {lab} done in" in proc.stderr
        assert any((tmp_path / lab).glob("*.png"))
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary) == set(LABS)
    assert summary["collectives"]["result"]["matches_theory"] is True
    assert "| all_reduce |" in (tmp_path / "summary.md").read_text()


@pytest.mark.parametrize(
    "args, message",
    [
        (["collectives", "--world-size", "0"], "0 is not >= 1"),
        (["collectives", "--world-size", "two"], "'two' is not an integer"),
        (["collectives", "--backend", "mpi"], "invalid choice: 'mpi'"),
        (["collectives", "--numel", "0"], "numel=0: expected an int >= 1"),
        (["collectives", "--model", "m:f"], "--model is not used by this lab"),
        (["tying", "--vocab", "0"], "vocab=0 is out of range: allowed an int >= 1"),
        (["tying", "--dim", "30", "--heads", "4"], "dim=30 is not divisible by heads=4"),
        (["tying", "--model", "fsdp_lab.models:nope"], "cannot load 'nope'"),
        (["meta-init", "--model-mb", "4"], "model_mb=4 is out of range: allowed an int in 8.."),
        (["meta-init", "--sizes-mb", "16", "0"], "sizes_mb=(16, 0) is out of range"),
        (["meta-init", "--model", "m:f"], "--model is not used by this lab"),
        (["pp-seed", "--stages", "5", "--layers", "4"], "stages=5 is out of range for layers=4"),
        (["pp-seed", "--stages", "2", "--world-size", "3"], "2 does not divide world_size=3"),
        (["pp-seed", "--strategies", "replay"], "strategy 'replay' is unknown: allowed"),
        (["pp-seed", "--model", "m:f"], "--model is not used by this lab"),
        (["nonsense"], "invalid choice: 'nonsense'"),
    ],
)
def test_bad_input_is_a_clear_error(args, message):
    proc = fsdp_lab(*args, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun not on PATH")
def test_the_same_lab_runs_under_torchrun():
    proc = subprocess.run(
        ["torchrun", "--standalone", "--nproc-per-node", "2", "-m", "fsdp_lab", "collectives"]
        + ["--numel", "64", "--json"],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # only rank 0 prints the result
    result = json.loads(lines[0])
    assert result["world_size"] == 2 and result["matches_theory"] is True
    assert result["contents"]["all_gather_into_tensor"]["after"] == [[1.0, 1.0, 2.0, 2.0]] * 2


def test_shard_json_has_the_issue_keys_and_exact_bytes():
    proc = fsdp_lab(
        "shard",
        "--world-size",
        "2",
        "--strategy",
        "grad_op",
        "--steps",
        "2",
        "--json",
        "--model",
        "fsdp_lab.models:tiny_gpt",
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    for key in SHARD_KEYS:  # the keys issue 3 asks for, listed once in test_shard_lab
        assert key in result, key
    assert result["strategy"] == "grad_op" and result["world_size"] == 2
    assert result["comm_bytes_per_rank"][0] == pytest.approx(result["theory_comm_bytes"], rel=1e-12)


def test_shard_with_a_bad_model_spec_is_a_clear_error():
    proc = fsdp_lab("shard", "--world-size", "1", "--model", "fsdp_lab.models:nope", "--json")
    assert proc.returncode != 0
    assert "cannot load 'nope'" in proc.stderr


def test_checkpoint_json_has_per_schedule_figures():
    proc = fsdp_lab("checkpoint", "--layers", "8", "--every", "2", "--world-size", "2", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    per_schedule = result["schedules"]["8"]
    assert {"store_all", "full_recompute", "every(2)", "segments(3)", "optimal(4)"} == set(
        per_schedule
    )
    for row in per_schedule.values():
        assert set(row) == {"peak_activation_bytes", "forward_calls", "time_s", "max_abs_grad_diff"}
        assert row["max_abs_grad_diff"] == 0.0
    assert per_schedule["every(2)"]["forward_calls"] == 8 - 4 + 2 * (4 * 5 // 2)


def test_checkpoint_with_an_out_of_range_argument_is_a_clear_error():
    proc = fsdp_lab("checkpoint", "--layers", "8", "--every", "9", "--json")
    assert proc.returncode != 0
    assert "every=9 is out of range: allowed 1..8" in proc.stderr


def test_tying_json_has_the_issue_keys_and_out_writes_diagrams(tmp_path):
    proc = fsdp_lab(
        "tying",
        *("--world-size", "2", "--vocab", "512", "--dim", "32", "--layers", "2", "--heads", "2"),
        *("--seq-len", "8", "--steps", "2", "--spike-steps", "1", "--json", "--out", str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # exactly one object on stdout
    for key in ("audit", "spike", "ties", "verification", "to_empty"):
        assert key in result, key
    assert [row["system"] for row in result["audit"]][-1] == "fsdp_lab shard"
    spike = result["spike"]
    for key in ("peak_bytes_root_unit", "peak_bytes_joint_unit"):
        assert len(spike[key]) == 2 and len(spike[f"fsdp2_{key}"]) == 2
    assert spike["model"]["vocab_size"] == 512 and spike["steps"] == 1
    # Diagrams beside the PNGs: SVG with graphviz's `dot`, its DOT source without.
    suffix = ".svg" if shutil.which("dot") else ".dot"
    for stem in ("wrap_root_unit", "wrap_joint_unit", "wrap_split_tie"):
        assert (tmp_path / f"{stem}{suffix}").exists(), stem
    for stem in ("spike_fsdp_lab", "spike_fsdp2", "spike_bytes"):
        assert (tmp_path / f"{stem}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "tying.json").read_text())["world_size"] == 2


def test_meta_init_json_has_the_issue_keys_and_measured_figures():
    proc = fsdp_lab(
        "meta-init",
        *("--world-size", "2", "--model-mb", "32", "--sizes-mb", "8", "16", "--json"),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # exactly one object on stdout
    for key in ("build_time_s_70b", "rss_growth_bytes_70b", "peak_bytes_per_rank"):
        assert key in result, key
    assert 68e9 <= result["parameters_70b"] <= 71e9
    assert 0 < result["rss_growth_bytes_70b"] < 200 * 10**6
    assert len(result["peak_bytes_per_rank"]) == 2
    assert max(result["peak_bytes_per_rank"]) < result["full_model_bytes"]
    approaches = result["approaches"]
    assert set(approaches) == {"sync_module_states", "deterministic"}
    for approach in approaches.values():
        assert approach["bitwise_equal_to_reference"] is True and approach["time_s"] > 0
    row = result["agreement"]["rows"][-1]  # the approaches' figures are the largest size's
    assert approaches["sync_module_states"]["bytes_moved"] == (
        row["parameter_bytes"] + row["buffer_bytes"]
    )
    assert approaches["deterministic"]["bytes_moved"] == 0


def test_pp_seed_json_has_the_issue_keys_per_strategy(tmp_path):
    import torch

    proc = fsdp_lab(
        "pp-seed",
        *("--stages", "2", "--layers", "2", "--steps", "3", "--grow-dims", "--json"),
        *("--out", str(tmp_path)),
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)  # exactly one object on stdout
    assert result["world_size"] == 2 and result["stages"] == 2 and result["growth"] == []
    rows = result["strategies"]
    assert list(rows) == ["seed_checkpoint", "same_seed", "per_stage_seed", "rng_replay"]
    for row in rows.values():
        for key in ("bitwise_equal", "max_abs_diff", "init_time_s", "bytes_moved", "final_loss"):
            assert key in row, key
        assert len(row["peak_bytes_per_rank"]) == 2
    assert [rows[s]["bitwise_equal"] for s in rows] == [True, False, False, True]
    assert rows["rng_replay"]["max_abs_diff"] == 0.0
    assert rows["rng_replay"]["bytes_moved"] == torch.get_rng_state().numel()  # S - 1 = 1 state
    suffix = ".svg" if shutil.which("dot") else ".dot"
    assert (tmp_path / f"pipeline_rng_replay{suffix}").exists()
    assert (tmp_path / "loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
