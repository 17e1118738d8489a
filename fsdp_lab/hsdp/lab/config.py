"""Lab 06 — hybrid sharding (HSDP): shard inside a node, replicate across nodes.

The lab's config: its fields are the command-line options (`fsdp_lab.labs.options`), its errors
are in Python terms and the CLI says them in flags. Torch-free, so ``fsdp-lab --help`` is fast.
"""

from __future__ import annotations

from dataclasses import dataclass

from fsdp_lab.config_checks import check_fields, is_int, knob
from fsdp_lab.emulate import parse_rate
from fsdp_lab.sharding.lab.config import (
    DEFAULT_MODEL,
    check_batch_divides,
    global_batch_knob,
    lr_knob,
)

SYSTEMS = ("full", "hybrid", "hybrid_zero2")  # ours, measured on the same ranks
NODES = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the network model's x axis


def default_mesh(world_size: int) -> tuple[int, int]:
    """(R, S) with the largest shard group short of the world: 4 -> (2, 2), 6 -> (2, 3)."""
    s = next((world_size // p for p in range(2, world_size + 1) if world_size % p == 0), 1)
    return world_size // s, s


def parse_mesh(mesh: object, world_size: int) -> tuple[int, int]:
    """ "R,S", "RxS" or (R, S) -> (R, S), checked against `world_size`."""
    fix = "mesh='{},{}'".format(*default_mesh(world_size))  # a string: Python and CLI alike
    parts: object = mesh
    if isinstance(mesh, str):
        parts = [p.strip() for p in mesh.replace("x", ",").split(",")]
        parts = [int(p) if p.lstrip("-").isdigit() else p for p in parts]
    if not (
        isinstance(parts, (tuple, list)) and len(parts) == 2 and all(is_int(d, 1) for d in parts)
    ):
        raise ValueError(
            f"mesh={mesh!r}: expected two positive ints R,S (R replicas of S-rank shard "
            f"groups). Fix: {fix}"
        )
    r, s = parts
    if r * s != world_size:
        raise ValueError(
            f"mesh={mesh!r} has {r}x{s}={r * s} ranks but world_size={world_size}: R·S must "
            f"equal the world size. Fix: {fix}, or world_size={r * s}"
        )
    return int(r), int(s)


@dataclass(frozen=True)
class HsdpConfig:
    """The HSDP lab's options, each with its help and its range on the field: the highs
    are what one host runs in a lab's time, the network model's inputs as sold."""

    world_size: int = knob(4, "ranks (R·S).", low=1)
    mesh: str | None = knob(
        None,
        '"R,S": R replicas of S-rank shard groups — S ranks stand for a node (default: the largest '
        "shard group short of the world, e.g. 2,2 on 4 ranks).",
        metavar="R,S",
    )
    steps: int = knob(3, "training steps of every run.", low=1, high=100_000)
    model: str = knob(
        DEFAULT_MODEL,
        '"module:factory" returning a token model (default: TinyGPT with a tied head).',
    )
    optimizer: str = knob(
        "adam", '"adam" (16 B/param of model state) or "sgd" (momentum).', choices=["adam", "sgd"]
    )
    lr: float = lr_knob()
    global_batch: int = global_batch_knob()
    compare_pytorch: bool = knob(
        True,
        "also train fully_shard on the same 2-D DeviceMesh and FSDP1's HYBRID_SHARD (and their "
        "ZeRO-2 twins); on by default.",
        flag="--no-pytorch",
    )
    params_b: float = knob(
        7.0,
        "the model of the capacity argument and the network model, billions of parameters.",
        low=0.001,
        high=100000.0,
    )
    vram_gb: float = knob(
        80.0, "one GPU's memory in the capacity argument (GB).", low=1.0, high=10000.0
    )
    gpus_per_node: int = knob(8, "GPUs per node in the network model.", low=1, high=1024)
    inter_node_gbit: float = knob(
        100.0,
        "the network model's bandwidth between nodes (Gbit/s per node).",
        low=0.001,
        high=100000.0,
    )
    overlap: float = knob(
        1.0,
        "the network model's fraction of compute that communication can hide behind.",
        low=0.0,
        high=1.0,
    )
    emulate_nodes: int = knob(
        0,
        "2 puts the ranks of each shard group in their own network namespace, the two joined by a "
        "veth pair shaped to `inter_node_bandwidth`, and times full FSDP and HSDP steps there "
        "(Linux, root); 0 skips it.",
    )
    inter_node_bandwidth: str = knob(
        "1gbit", 'the emulated link\'s rate, in tc\'s spelling ("1gbit", "200mbit").'
    )
    emulate_steps: int = knob(
        4,
        "training steps timed per system on the emulated nodes (the first, a warm-up, is not "
        "timed).",
        low=2,
        high=100_000,
    )
    backend: str = knob("auto", '"auto", "gloo" or "nccl".')

    def __post_init__(self) -> None:
        check_fields(self)
        mesh = self.mesh if self.mesh is not None else default_mesh(self.world_size)
        object.__setattr__(self, "mesh", parse_mesh(mesh, self.world_size))  # frozen: once
        if ":" not in self.model:
            raise ValueError(
                f"model={self.model!r}: expected 'module:factory'. Fix: model={DEFAULT_MODEL!r}"
            )
        check_batch_divides(self.global_batch, self.world_size)
        try:
            parse_rate(self.inter_node_bandwidth)
        except ValueError:
            raise ValueError(
                f"inter_node_bandwidth={self.inter_node_bandwidth!r}: expected a rate in tc's "
                "spelling, a number and kbit, mbit or gbit. Fix: inter_node_bandwidth='1gbit'"
            ) from None
        r = self.mesh[0]
        if self.emulate_nodes not in (0, 2) or (self.emulate_nodes and r != 2):
            raise ValueError(
                f"emulate_nodes={self.emulate_nodes!r} with mesh='{r},{self.mesh[1]}': two "
                "emulated nodes hold the two replicas of a mesh of R = 2. Fix: emulate_nodes=0, "
                f"or emulate_nodes=2 with mesh='2,{self.world_size // 2}'"
            )


CONFIG = HsdpConfig
TOUR = {"world_size": 4, "steps": 2, "compare_pytorch": False}  # the tour: ours only, fast
