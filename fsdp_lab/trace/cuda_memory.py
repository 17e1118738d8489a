"""One process's GPU memory as CUDA sees it: what the allocator holds, and what the context costs.

`MemoryTracker` on CUDA reports `torch.cuda.memory_allocated` — the bytes live tensors use.
A process holds more than that on its GPU: the caching allocator keeps freed blocks *reserved*
for reuse (`torch.cuda.memory_reserved`), and the CUDA context itself (kernels, cuBLAS/NCCL
workspaces, the driver's own state) takes a few hundred MiB that no tensor accounts for. With
N ranks sharing one GPU, every rank pays its own context: N contexts, not one. So each rank
states all three, and the context is measured, not assumed: the driver's count of this
process's memory (NVML, `nvidia-ml-py`) minus what the allocator reserved.

Without NVML (the package is optional) the context is reported as not measured, with why.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch


def process_gpu_bytes(device: torch.device) -> tuple[int | None, str]:
    """This process's memory on `device` as the driver counts it, or (None, why not)."""
    try:
        import pynvml  # from nvidia-ml-py: optional, torch's CUDA wheels do not require it
    except ImportError:
        return None, "not measured: NVML's Python bindings are missing (pip install nvidia-ml-py)"
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda._get_nvml_device_index(device))
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory), "NVML"
        return None, "not measured: NVML does not list this process (a container hides pids?)"
    except pynvml.NVMLError as exc:
        return None, f"not measured: NVML said {exc}"


def cuda_process_memory(
    device: torch.device,
    *,
    allocator: Callable[[torch.device], tuple[int, int, int]] | None = None,
    driver: Callable[[torch.device], tuple[int | None, str]] = process_gpu_bytes,
) -> dict[str, Any]:
    """Allocated, reserved (and their peaks) and the CUDA context of this process on `device`.

    ``context_bytes`` = the driver's count of this process − the allocator's reserved bytes
    (None when the driver's count cannot be read: ``context_source`` says why). `allocator`
    and `driver` default to CUDA's own readers; tests pass stand-ins.
    """
    allocated, reserved, peak_reserved = (allocator or _allocator_bytes)(device)
    process, source = driver(device)
    return {
        "allocated_bytes": allocated,
        "reserved_bytes": reserved,
        "peak_reserved_bytes": peak_reserved,
        "process_bytes": process,
        "context_bytes": None if process is None else max(0, process - reserved),
        "context_source": source,
    }


def _allocator_bytes(device: torch.device) -> tuple[int, int, int]:
    return (
        torch.cuda.memory_allocated(device),
        torch.cuda.memory_reserved(device),
        torch.cuda.max_memory_reserved(device),
    )
