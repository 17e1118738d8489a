#!/usr/bin/env bash
# The CUDA/NCCL paths, on a machine with a GPU (CI has none: there these tests skip). Runs the
# tests that need a GPU — every lab on one rank over NCCL (`Cluster(1, backend="nccl")`), every
# lab with two ranks sharing one GPU (`--device cuda`), point-to-point staged through host
# memory, the CUDA memory tracker, CUDA dropout replay; then benchmarks/bench_gpu.py. From the
# repository root with torch's CUDA build
# and pytest installed. The package is taken from the checkout (PYTHONPATH), not installed.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py=${PYTHON:-python3}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
$py -m pytest -q -p no:cacheprovider -rs -s --durations=10 "$@" \
    tests/test_devices.py tests/test_placement.py tests/test_memory.py tests/test_checkpointing.py \
    tests/test_cluster.py
tests=$?
# Ours beside fully_shard and the plain model: 111M TinyGPT, bf16, 1 rank (NCCL) and 2 and 4
# ranks sharing the GPU; the profile says where ours spends its time over the plain model.
timeout 240 $py benchmarks/bench_gpu.py --steps 6 --repeats 2 --profile
echo "gpu_check: tests exit $tests, benchmark exit $?"
exit $tests
