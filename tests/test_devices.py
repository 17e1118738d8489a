"""Where the model lives: devices compared as tensors report them, CPU parameters refused under
NCCL with the fix, and every lab run on one GPU over NCCL (skipped without one: CI has no GPU;
`scripts/gpu_check.sh` runs these on a GPU machine).

The first run on an H100 found two bugs no CPU run could: `materialize(device="cuda")`
refused its own parameters ("on cuda:0 ..., expected cuda") and the checkpoint lab sharded a
CPU model under NCCL, failing inside backward with "No backend type associated with device
type cpu"."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

from fsdp_lab.labs.registry import LABS
from fsdp_lab.sharding.apply import check_model
from fsdp_lab.sharding.materialize import concrete_device, materialize


def test_materialize_accepts_a_device_named_without_its_canonical_index():
    # "cpu:0" is the CPU named with an index; a tensor made there reports "cpu" — the CPU twin
    # of "cuda" vs "cuda:0", which refused every parameter on the GPU.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    materialize(model, device="cpu:0")
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert concrete_device("cpu:0") == torch.device("cpu")
    with pytest.raises(ValueError, match="device='meta': shards need real memory"):
        concrete_device("meta")


def test_cpu_parameters_under_nccl_are_refused_before_any_collective():
    model = nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"on the CPU \(e.g. 'weight'\) but the process group is "
                       r"NCCL.*Fix: model.to\(fsdp_lab.cluster.device\(\)\)"):  # fmt: skip
        check_model(model, backend="nccl")
    check_model(model, backend="gloo")  # control: gloo moves CPU memory
    with torch.device("meta"):
        check_model(nn.Linear(2, 2), backend="nccl")  # meta: shards land on the GPU


_no_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def needs_gpu(test):  # (`pytest -m gpu`: what scripts/gpu_check.sh runs)
    return pytest.mark.gpu(_no_gpu(test))


def _lab_on_the_gpu(lab: str, tmp_path, *options: str) -> tuple[dict, str]:
    """`fsdp-lab <lab> <options> --json` in a fresh process: exit 0, exactly one JSON object on
    stdout; the result and stderr (its start line)."""
    proc = subprocess.run(
        [sys.executable, "-m", "fsdp_lab", lab, *options, "--json", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


@needs_gpu
@pytest.mark.parametrize("lab", list(LABS))
def test_every_lab_runs_on_one_gpu_over_nccl(lab, tmp_path):
    """`Cluster(1, backend="nccl")` through the CLI: exit 0, one JSON object, ranks up on NCCL."""
    result, stderr = _lab_on_the_gpu(lab, tmp_path, "--world-size", "1", "--backend", "nccl")
    assert "1 rank(s) up on nccl" in stderr
    assert result.get("backend", "nccl") == "nccl" and result.get("world_size", 1) == 1
    if lab == "shard":  # the same training as one process and as fully_shard, on the GPU
        print({k: v for k, v in result.items() if "diff" in k})


@needs_gpu
@pytest.mark.parametrize("world", [pytest.param(n, id=f"{n}ranks") for n in (2, 4)])
@pytest.mark.parametrize("lab", list(LABS))
def test_every_lab_runs_with_ranks_sharing_one_gpu(lab, world, tmp_path):
    """The shared-GPU mode (issue 29): `--device cuda` with more ranks than GPUs puts them all
    on cuda:0, gloo carrying CUDA tensors. The shard lab there trains as one process and as
    fully_shard do, and states each rank's allocator reserve and CUDA context."""
    options = ("--world-size", str(world), "--device", "cuda")
    result, stderr = _lab_on_the_gpu(lab, tmp_path, *options)
    if torch.cuda.device_count() == 1:
        assert f"{world} ranks sharing cuda:0 (gloo on CUDA tensors)" in stderr
    print(lab, world, {k: v for k, v in result.items() if "diff" in k or "matches" in k})
    if lab == "shard":
        assert result["max_abs_diff_vs_single_process"] < 1e-4
        assert result["max_abs_diff_vs_fsdp2"] < 1e-4
        traces = result["memory_traces"]
        assert len(traces) == world and all(t["device"].startswith("cuda") for t in traces)
        for rank, trace in enumerate(traces):
            cuda = trace["cuda"]  # the allocator's reserve and the rank's own CUDA context
            assert cuda["peak_reserved_bytes"] >= trace["peak_bytes"] > 0, rank
            print(f"rank {rank}: reserved {cuda['reserved_bytes']}, context "
                  f"{cuda['context_bytes']} ({cuda['context_source']})")  # fmt: skip


def _staged_ring() -> list[float]:
    import torch.distributed as dist

    from fsdp_lab import comm
    from fsdp_lab.cluster import device

    r, n = dist.get_rank(), dist.get_world_size()
    got = torch.full((3,), -1.0, device=device())
    sent = comm.send(torch.full((3,), float(r), device=device()), dst=(r + 1) % n, async_op=True)
    received = comm.recv(got, src=(r - 1) % n, async_op=True)
    sent.wait()
    received.wait()
    dist.barrier()  # the group is whole after point-to-point (raw gloo on CUDA breaks it)
    return got.tolist()


@needs_gpu
@pytest.mark.parametrize("world", [2, 4])
def test_point_to_point_on_a_shared_gpu_goes_through_host_memory(world):
    from fsdp_lab import Cluster

    with Cluster(world, device="cuda", verbose=False) as cluster:
        assert cluster.run(_staged_ring) == [[float((r - 1) % world)] * 3 for r in range(world)]
