"""The GPUs a plan can be made for: vendor datasheet figures, and the share of peak a step reaches.

A `GPU` is the plan's assumptions about one device (memory, dense bf16 FLOPS, its share of the
node's links and of the network); `GPUS` the presets `fsdp-lab plan --gpu` takes. Figures that
cannot describe a device (NaN, infinite, not above zero; a utilisation outside (0, 1]) are
refused when the GPU is made, naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    """Vendor datasheet figures (SXM/PCIe as named): the plan's assumptions about a GPU."""

    name: str
    memory_gib: float
    bf16_tflops: float  # dense, no sparsity
    intra_gbytes_s: float  # one GPU's share of its node's links, per direction
    nic_gbit_s: float  # inter-node bandwidth per GPU (one NIC per GPU on such nodes)
    efficiency: float = 0.5  # the share of peak FLOPS a well-tuned step reaches (MFU)
    flops_kind: str = "dense bf16"  # what `bf16_tflops` counts (a measured CPU: fp32 matmul)

    def __post_init__(self) -> None:
        for field in ("memory_gib", "bf16_tflops", "intra_gbytes_s", "nic_gbit_s"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(f"GPU({field}={value!r}): expected a number")
            if not 0 < value < float("inf"):
                raise ValueError(f"GPU({field}={value!r}): expected a finite number > 0")
        if isinstance(self.efficiency, bool) or not isinstance(self.efficiency, int | float) or (
            not 0 < self.efficiency <= 1
        ):  # fmt: skip
            raise ValueError(
                f"GPU(efficiency={self.efficiency!r}): expected the share of peak FLOPS a step "
                "reaches, in (0, 1] (published runs: 0.38-0.57 on H100, 0.58-0.74 on A100)"
            )


# Utilisation (`efficiency`, of the FLOPs executed, recomputation included): A100 0.6 and H100
# 0.45 from published FSDP runs (0.58-0.74 and 0.38-0.57); the 500 W H100 0.35, its source's
# own 33-39 % MFU; B200, MI300X and L4 the uncalibrated 0.5 — set `mfu` from your own runs.
# Memory in GiB as the device reports it (nvidia-smi: H100 81,559 MiB, H200 143,771, L4 23,034,
# H100 NVL 95,830); elsewhere the datasheet's figure, taken as GiB. Links, per direction: a
# GPU's share of its node's (NVLink 4: 900 GB/s both ways, NVLink 3: 600, NVLink 5: 1,800,
# MI300X's Infinity Fabric 7 x 64 GB/s, PCIe 4 x16: 32); one 400 Gbit/s NIC per GPU on
# H100/H200/B200/MI300X nodes, 200 on A100's. Dense bf16 TFLOPS from the datasheets.
GPUS = {
    "h100": GPU("H100 SXM 80GB", 79.6, 989, 450, 400, efficiency=0.45),
    "h100-94gb": GPU("H100 NVL 94GB (PCIe, NVLink bridge)", 93.6, 835, 300, 400, efficiency=0.45),
    "h100-96gb": GPU("H100 96GB HBM2e at 500 W (torchtitan's)", 96, 989, 450, 400, efficiency=0.35),
    "h200": GPU("H200 SXM 141GB", 140.4, 989, 450, 400, efficiency=0.45),
    "b200": GPU("B200 SXM 180GB", 180, 2250, 900, 400),
    "mi300x": GPU("MI300X OAM 192GB", 192, 1307, 448, 400),
    "a100-80gb": GPU("A100 SXM 80GB", 80, 312, 300, 200, efficiency=0.6),
    "a100-40gb": GPU("A100 SXM 40GB", 40, 312, 300, 200, efficiency=0.6),
    "l4": GPU("L4 24GB (PCIe)", 22.5, 121, 32, 100),
}
