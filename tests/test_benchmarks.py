"""The benchmarks run end to end with tiny settings and print the table they promise."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "MPLBACKEND": "Agg", "PYTHONUNBUFFERED": "1"}
SYSTEMS = (
    "ours:full",
    "ours:grad_op",
    "ours:optimizer",
    "ours:none",
    "fully_shard",
    "fsdp1",
    "ddp",
)


# A benchmark's smoke run is a whole run (`pytest -m e2e`, run by CI after the suite).
E2E = pytest.mark.e2e


def _run_benchmark(script: str, *args: str) -> subprocess.CompletedProcess:
    """Run benchmarks/<script> with tiny arguments; it must exit 0."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=ROOT,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@E2E
def test_bench_shard_prints_one_row_per_system_and_world_size(tmp_path):
    out = tmp_path / "bench.json"
    tiny = "--steps 2 --repeats 1 --dim 16 --layers 1 --heads 2 --vocab 32 --seq 8 --batch 2"
    proc = _run_benchmark(
        "bench_shard.py", "--world-sizes", "1", "2", *tiny.split(), "--json", str(out)
    )
    text = proc.stdout
    # The main table of each world size: "| system | ms (spread) | ratio (spread) x2 | MiB |
    # ratio |", every strategy of ours beside PyTorch's three.
    spread = r"[\d.]+ \([\d.-]+\)"
    for n in (1, 2):
        section = text.split(f"world size {n} (gloo)")[1].split("counted three ways")[0]
        rows = re.findall(
            rf"^\| ([\w:]+) \| {spread} \| {spread} \| {spread} \| [\d.]+ \| [\d.]+ \|$",
            section,
            re.M,
        )
        assert rows == list(SYSTEMS), section
    assert re.search(rf"ours:none / ddp step time ≤ 1.00: N=1: {spread} (met|not met), N=2: ", text)
    assert re.search(
        rf"ours:full / fully_shard step time ≤ 0.85: N=1: {spread} (met|not met)", text
    )
    assert re.search(r"ours:full / fully_shard peak memory ≤ 1.00: N=1: [\d.]+ (met|not met)", text)
    # ZeRO-3 against DDP, beside the bytes that explain it (ZeRO-3 sends more: ratio > 1).
    bytes_ratio = re.search(r"ours:full / ddp .*N=2: step time [\d.]+, bytes ([\d.]+)", text)
    assert bytes_ratio and float(bytes_ratio[1]) > 1.0, text
    assert text.count("load average") >= 2 + 2  # the start, the end, and each repeat

    data = json.loads(out.read_text())
    for n in ("1", "2"):
        res = data["results"][n]
        assert set(res) == set(SYSTEMS)
        assert res["fully_shard"]["peak_bytes"] > 0 and res["ours:full"]["step_time_s"] > 0
        # Same model, same data, same optimizer: every system ends at the same loss.
        losses = [res[s]["final_loss"] for s in SYSTEMS]
        assert max(losses) - min(losses) < 1e-4, losses


@pytest.fixture(scope="module")
def meta_init_run() -> dict:
    """One tiny run of bench_meta_init.py --json (a fresh process per way and build: the costly
    part); the text test prints the same result the way the script does without --json."""
    proc = _run_benchmark(
        "bench_meta_init.py",
        "--repeats",
        "1",
        "--real-gib",
        "0",
        "--init-elements",
        "4096",
        "--json",
    )
    return json.loads(proc.stdout)  # exactly one JSON object, nothing else on stdout


@E2E
def test_bench_meta_init_prints_one_json_object_with_every_way(meta_init_run):
    data = meta_init_run
    meta = data["llama_70b_on_meta"]
    assert meta["parameters"] == 70_553_706_496 and meta["fp32_bytes"] == 4 * meta["parameters"]
    has_accelerate = importlib.util.find_spec("accelerate") is not None
    ways = (
        {"plain", "ours", "accelerate"} if meta["accelerate_skipped"] is None else {"plain", "ours"}
    )
    assert set(meta["ways"]) == set(meta["ratio_to_ours"]) == ways
    if not has_accelerate:  # skipped, saying how to install it
        assert (
            "accelerate" in meta["accelerate_skipped"]
            and "pip install" in meta["accelerate_skipped"]
        )
    for way, entry in meta["ways"].items():
        assert entry["parameter_devices"] == ["meta"], way
        for build in ("first", "second"):
            b = entry[build]
            assert len(b["seconds_per_repeat"]) == 1 and b["median_seconds"] > 0
            assert b["median_rss_growth_bytes"] < 200 * 10**6  # memory, not time
            assert b["median_gc_seconds"] >= 0
    assert meta["ratio_to_ours"]["ours"] == {"first": 1.0, "second": 1.0}
    # Behaviour, not time: the plain first build imports torch._dynamo, ours imports nothing.
    assert meta["ways"]["plain"]["first"]["median_modules_imported"] > 100
    assert meta["ways"]["ours"]["first"]["median_modules_imported"] <= 5
    assert meta["ways"]["ours"]["second"]["median_modules_imported"] == 0
    assert set(data["meets_targets"]) == {"seconds", "rss_growth"}
    assert data["ordinary_build"] is None
    for by_case in data["init_elements_per_second"].values():
        assert set(by_case) == {
            "deterministic_uniform",
            "deterministic_normal",
            "torch_uniform_",
            "torch_normal_",
        }
        assert all(v > 0 for v in by_case.values())


@E2E
def test_bench_meta_init_text_prints_the_side_by_side_table(meta_init_run, capsys):
    # Without --json the script hands its result to print_text(): the same call, on the run
    # above, instead of measuring every way again.
    spec = importlib.util.spec_from_file_location(
        "bench_meta_init", ROOT / "benchmarks" / "bench_meta_init.py"
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    script.print_text(meta_init_run)
    text = capsys.readouterr().out
    row = r"^\| {}: .+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+ \| [\d.]+ \| [\d., ]+ \|$"
    for way in ("plain", "ours"):
        assert re.search(row.format(way), text, re.M), text
    if importlib.util.find_spec("accelerate") is None:
        assert re.search(r"^accelerate: skipped — .*pip install", text, re.M), text
    assert re.search(r"targets \(ours, first build\): < 0\.5 s: (yes|no), < 200 MB: (yes|no)", text)


@E2E
def test_bench_cluster_prints_cold_warm_restart_and_call_medians():
    proc = _run_benchmark("bench_cluster.py", "--world-size", "2", "--starts", "1", "--calls", "3")
    text = proc.stdout
    assert re.search(r"cold start, Cluster\(2\) after the import: median [\d.]+ s", text)
    assert re.search(r"fresh process to ranks up \(torch imported\): median [\d.]+ s", text)
    for line in ("warm start   median", "restart      median", "warm run()   median"):
        assert line in text, text


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (["--steps", "0"], "argument --steps: 0 is not >= 1"),
        (["--world-sizes", "5"], "--world-sizes 5: NestedWrappedModule's global batch 12 does not"),
        (["--out", "/nonexistent/p.json"], "--out /nonexistent/p.json: cannot write into"),
    ],
)
def test_parity_refuses_what_it_cannot_measure_before_any_rank_starts(args, error):
    """A hostile review: 0 steps printed '48 of 48 rows within' for models nobody trained, 5
    ranks ran to a table of n/a and exit 0, a bad --out lost a finished run."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "parity.py"), *args],
        capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and error in proc.stderr, proc.stderr


@E2E
def test_parity_table_rows_and_every_diff_within_fp32_tolerance(tmp_path):
    """benchmarks/parity.py on a tiny subset: one row per model x strategy, every figure ours
    vs single process within tolerance, and every PyTorch counterpart within it too unless the
    table marks (and the JSON shows) that PyTorch itself left single-process training."""
    from parity_runs import FP32_TOLERANCE

    out = tmp_path / "parity.json"
    models, strategies = ["NonUniformReqGradNWM"], ["none", "optimizer", "grad_op", "full"]
    proc = _run_benchmark(
        "parity.py",
        *("--world-sizes", "2", "--steps", "2", "--out", str(out)),
        *("--models", *models, "--strategies", *strategies),
    )
    runs = re.findall(
        r"^\[parity\] N=2 \w+ ((?:ours|fsdp1|fully_shard|ddp)\S*): [\d.]+ s$", proc.stderr, re.M
    )
    assert len(runs) == 4 + 8, proc.stderr  # a line per run: ours x4, PyTorch's x8
    table = re.findall(r"^\| (\w+) \| (sgd|adamw) \| 2 \| (\w+) \| (.*) \|$", proc.stdout, re.M)
    assert [(m, s) for m, _, s, _ in table] == [(m, s) for m in models for s in strategies]
    number = r"(0|\d\.\de-\d\d)"
    for *_, cells in table:
        single, *theirs = cells.split(" | ")
        assert re.fullmatch(number, single), cells
        for cell in theirs:
            assert re.fullmatch(rf"—|{number}( †\d+)?|n/a ‡\d+", cell), cells
    assert re.search(r"Ours vs single process: 4 of 4 rows within \(worst \S+\)", proc.stdout)

    data = json.loads(out.read_text())
    assert data["tolerance"] == FP32_TOLERANCE and len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["vs_single"]["max_abs_diff"] <= FP32_TOLERANCE, row
        for column, cell in row["vs"].items():
            if cell is None:  # PyTorch has no such configuration (FSDP1 and ZeRO-1, ...)
                continue
            if cell["max_abs_diff"] is None:  # PyTorch's run could not be compared: said why
                assert cell["note"], row
            elif cell["max_abs_diff"] > FP32_TOLERANCE:  # only where PyTorch itself departs
                assert cell["system_vs_single"] > FP32_TOLERANCE, (column, row)


@E2E
def test_bench_grade_prints_seconds_per_file_and_the_points_given():
    proc = _run_benchmark(
        "bench_grade.py", "--files", "1", "--repeats", "1", "--lab", "collectives"
    )
    assert "points given per run: [4]" in proc.stdout, proc.stdout  # both exercises passed
    assert re.search(r"^\| this checkout \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", proc.stdout, re.M)
    assert "load average at start" in proc.stdout and "load average at the end" in proc.stdout


@E2E
def test_bench_gpu_runs_on_cpu_ranks_and_prints_ours_beside_plain_and_fully_shard(tmp_path):
    # On a GPU machine scripts/gpu_check.sh runs it at full size; here the same code, tiny.
    out = tmp_path / "gpu.json"
    tiny = "--steps 5 --repeats 1 --dim 16 --layers 1 --heads 2 --vocab 32 --seq 8 --batch 2"
    proc = _run_benchmark(
        "bench_gpu.py", "--device", "cpu", "--world-sizes", "1", "2", *tiny.split(),
        "--profile", "--json", str(out),
    )  # fmt: skip
    one, two = proc.stdout.split("1 rank(s): median")[1].split("2 rank(s): median")
    row = r"^\| {} \| [\d.]+ \| {} \| [\d.]+ \| - \| {} \|$"
    for system in ("plain", "ours", r"ours\+offload", "fully_shard"):
        assert re.search(row.format(system, r"[\d.]+", r"\d+"), one, re.M), one
    assert re.search(row.format("ours", "-", "-"), two, re.M) and "| plain |" not in two, two
    assert "profile, ours+offload, 1 rank, 3 steps; copies per step: HtoD" in one
    assert (
        "ours / plain at 1 rank ≤ 1.10:" in two and "ours / fully_shard ≤ 1.00 by ranks: 1:" in two
    )
    saved = json.loads(out.read_text())["results"]
    assert saved["1"]["step_s"]["plain"] > 0
    assert set(saved["2"]["step_s"]) == {"ours", "ours+offload", "fully_shard"}


@E2E
def test_bench_ops_counts_and_times_ours_beside_plain_and_fully_shard(tmp_path):
    out = tmp_path / "ops.json"
    tiny = "--steps 3 --repeats 1 --dim 16 --layers 1 --heads 2 --vocab 32 --seq 8 --batch 2"
    proc = _run_benchmark(
        "bench_ops.py", "--world-sizes", "1", "2", *tiny.split(), "--json", str(out)
    )
    ratio = r"[\d.]+ \([\d.]+-[\d.]+\)"
    for n in (1, 2):
        section = proc.stdout.split(f"\n{n} rank(s), gloo on the CPU")[1]
        for precision in ("fp32", "bf16"):
            for system in ("plain", "ours", "fully_shard"):
                line = rf"^\| {precision} \| {system} \| \d+ \| [\d.]+ \| [\d.]+ \| {ratio} \| {ratio} \| {ratio} \|$"
                assert re.search(line, section, re.M), (n, precision, system, section)
    assert "ours - plain, bf16, by operator:" in proc.stdout
    saved = json.loads(out.read_text())["results"]
    assert saved["1"]["fp32"]["ours"]["ops"]["total"] > 0


@E2E
def test_bench_plan_prints_a_verified_row(tmp_path):
    # At full size it verifies 8B/70B/405B on 8/64/512 fake ranks; here one twin row.
    out = tmp_path / "plan.json"
    proc = _run_benchmark(
        "bench_plan.py", "--models", "llama3-8b-twin", "--gpus", "8", "--strategies", "zero3",
        "--seq", "64", "--json", str(out),
    )  # fmt: skip
    row = (
        r"^\| llama3-8b-twin \| 8 \| zero3 \| blocks \| 64 \| yes \| [\d.,]+ \| [\d.,]+ \| "
        r"[+-][\d.]+% \| [\d.,]+ = fake \|"
    )
    assert re.search(row, proc.stdout, re.M), proc.stdout
    (plan,) = json.loads(out.read_text())
    assert set(plan["verified"]["comm_bytes_rel_diff"].values()) == {0.0}


@E2E
def test_bench_plan_published_prints_every_published_run_planned_or_why_not():
    spec = importlib.util.spec_from_file_location(
        "published_runs", ROOT / "benchmarks" / "published_runs.py"
    )
    published_runs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(published_runs)
    RUNS = published_runs.RUNS
    proc = _run_benchmark("bench_plan.py", "--published")
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| TT")]
    assert len(rows) == len(RUNS), proc.stdout
    for run, row in zip(RUNS, rows, strict=True):
        assert row.startswith(f"| {run['source']} |"), row
        if run.get("not_expressible"):
            assert "not expressible: " in row, row
        else:  # planned tokens/s, published, and their ratio (no bound: a benchmark reports)
            planned, published, ratio = (float(x.replace(",", "")) for x in row.split("|")[5:8])
            assert published == run["tokens_per_s"] and ratio == pytest.approx(
                planned / published, abs=0.006
            ), row
