#!/usr/bin/env bash
# The CUDA paths, on a machine with a GPU (CI has none: there these tests skip), in under 8
# minutes. From the repository root, with torch's CUDA build and pytest installed; the package
# is taken from the checkout (PYTHONPATH), not installed. Three parts run side by side (a GPU
# node has the cores), each under its own time limit, then the benchmark:
#   1. every lab on one rank over NCCL, and the other GPU tests (`pytest -m gpu`: the CUDA
#      memory tracker, CUDA dropout replay, point-to-point staged through host memory);
#   2. every lab with 2 ranks sharing the GPU (`--device cuda`, gloo on CUDA tensors): the
#      shard lab's parity with one process and fully_shard there, and each rank's CUDA memory
#      with the allocator's reserve and the CUDA context;
#   3. the same with 4 ranks;
#   4. benchmarks/bench_gpu.py: the 111M TinyGPT, bf16, ours (and with CPU offload) vs
#      fully_shard at 1, 2 and 4 ranks, vs the plain model at 1; at 1 rank operators per step,
#      offload's host<->device copy time and the profile of where ours' time over the plain
#      model goes; offload's device memory saved at every size.
# The shared mode caps each rank at its share of the GPU (a limit, not a reservation): parts 2
# and 3 and the NCCL part together use a few hundred MiB of it.
# Every log is also written under ${GPU_CHECK_OUT:-gpu_check_out}/.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
py=${PYTHON:-python3}
out=${GPU_CHECK_OUT:-gpu_check_out}
mkdir -p "$out"
started=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
$py -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
tests=(tests/test_devices.py tests/test_memory.py tests/test_checkpointing.py)
pytest=($py -m pytest -q -p no:cacheprovider -rs -s --durations=5 -m gpu)
timeout 300 "${pytest[@]}" "${tests[@]}" -k "not sharing" > "$out/nccl.log" 2>&1 &
one=$!
timeout 300 "${pytest[@]}" tests/test_devices.py -k "sharing and 2ranks" > "$out/shared2.log" 2>&1 &
two=$!
timeout 300 "${pytest[@]}" tests/test_devices.py -k "sharing and 4ranks" > "$out/shared4.log" 2>&1 &
four=$!
wait $one; rc_one=$?
wait $two; rc_two=$?
wait $four; rc_four=$?
for part in nccl shared2 shared4; do echo "=== $part"; cat "$out/$part.log"; done
echo "gpu_check: tests done at $(( $(date +%s) - started )) s"
timeout 170 $py benchmarks/bench_gpu.py --steps 5 --repeats 1 --profile \
    --json "$out/bench_gpu.json" 2>&1 | tee "$out/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: exit codes nccl $rc_one, shared2 $rc_two, shared4 $rc_four, bench_gpu $bench" \
    "(124: over its time limit); $(( $(date +%s) - started )) s in all"
[ "$rc_one$rc_two$rc_four$bench" = 0000 ]
