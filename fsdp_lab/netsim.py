"""A network model of FSDP and HSDP steps: alpha-beta ring collectives on two kinds of link.

Bytes come from `fsdp_lab.theory` — the same formulas the HSDP lab measures exactly on real
ranks — and time from the textbook alpha-beta cost of a ring: a ring collective over n ranks
takes k·(n−1) hops of latency α (k = 1 for all-gather and reduce-scatter, 2 for all-reduce)
plus the bytes one link carries divided by that link's bandwidth β. What the model adds is
*which* link: a ring inside a node runs on NVLink; a ring spanning nodes is as fast as the
slowest edge, the inter-node one, and every GPU of a node pushes its share through the node's
NICs.

    full FSDP (ZeRO-3) over N = nodes·G GPUs, per step:
        2 all-gathers + 1 reduce-scatter of Ψb over N    -> inter-node as soon as N > G
    HSDP, shard groups of S ≤ G GPUs inside a node, R = N/S replicas:
        2 all-gathers + 1 reduce-scatter of Ψb over S    -> NVLink
        1 all-reduce of each rank's gradient shard Ψb/S over R  -> inter-node; a node's NICs
          carry it for all its G GPUs: G/S · 2(R−1)/R · Ψb

Step time with compute t_c and overlap fraction f (the share of compute time communication
can hide behind): t = t_c + max(0, t_comm − f·t_c). Per-GPU throughput = 6·Ψ·tokens / t.

A model, not a measurement: no congestion, no NCCL protocol choice, no tree algorithms; the
lab sets it beside a measured step on an emulated slow link, and says where they differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fsdp_lab import theory

GBIT = 1e9 / 8  # bytes per second in one Gbit/s


@dataclass(frozen=True)
class Network:
    """Links and node shape. Defaults: 8 GPUs per node on NVLink-class links, one 100 Gbit/s
    Ethernet NIC per node between nodes.

    Args:
        gpus_per_node: G.
        intra_bandwidth: bytes/s one GPU sends over its node's links (NVLink: ~450 GB/s).
        intra_latency: seconds per ring hop inside a node.
        inter_bandwidth: bytes/s of one NIC (100 Gbit/s Ethernet: 12.5 GB/s).
        inter_latency: seconds per ring hop between nodes.
        nics_per_node: NICs a node's traffic is spread over.
    """

    gpus_per_node: int = 8
    intra_bandwidth: float = 450e9
    intra_latency: float = 3e-6
    inter_bandwidth: float = 100 * GBIT
    inter_latency: float = 20e-6
    nics_per_node: int = 1

    def __post_init__(self) -> None:
        for name in ("gpus_per_node", "nics_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: expected an int >= 1. Fix: {name}=1")
        for name in ("intra_bandwidth", "inter_bandwidth"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected bytes/s > 0")
        for name in ("intra_latency", "inter_latency"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected seconds >= 0")


@dataclass(frozen=True)
class Workload:
    """One training step of one model on every GPU.

    Args:
        parameters: Ψ.
        bytes_per_parameter: b of the gathered parameters and reduced gradients (bf16: 2).
        tokens_per_gpu: tokens each GPU processes per step (6·Ψ FLOPs each, forward+backward).
        tflops: what one GPU achieves computing alone (sets the compute time).
        overlap: fraction of the compute time communication can hide behind (0..1).
        units: wrap units (e.g. transformer blocks): each runs its own collectives.
    """

    parameters: float = 7e9
    bytes_per_parameter: int = 2
    tokens_per_gpu: int = 8192
    tflops: float = 180.0
    overlap: float = 1.0
    units: int = 32

    def __post_init__(self) -> None:
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap={self.overlap!r}: expected a fraction in 0..1")
        if not (self.parameters > 0 and self.tokens_per_gpu > 0 and self.tflops > 0):
            raise ValueError("parameters, tokens_per_gpu and tflops must be > 0")
        if isinstance(self.units, bool) or not isinstance(self.units, int) or self.units < 1:
            raise ValueError(f"units={self.units!r}: expected an int >= 1. Fix: units=32")

    @property
    def flops_per_gpu(self) -> float:
        return 6 * self.parameters * self.tokens_per_gpu

    @property
    def compute_s(self) -> float:
        return self.flops_per_gpu / (self.tflops * 1e12)


HOPS = {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 2}


def step_bytes(units: list[dict[str, Any]], mesh: tuple[int, int], strategy: str) -> dict:
    """Bytes per rank and step, by group ("shard", "replicate") and op — `theory`'s formulas,
    which the HSDP lab's measurement equals exactly. ``strategy="full"`` on (1, N) is FSDP."""
    r, s = mesh
    if strategy == "full":
        return {"shard": theory.sharding_step("full", units, s)["comm_bytes"], "replicate": {}}
    return theory.hybrid_step(strategy, units, mesh)["comm_bytes"]


def _links(mesh: tuple[int, int], gpus_per_node: int) -> dict[str, tuple[int, int, bool]]:
    """Per group: (ranks in it, rings through a node, whether those rings cross nodes). A ring
    leaves each node once, so a node's NICs carry one ring edge per ring: 1 ring for the shard
    group (spanning nodes only when S > G), S rings — one per shard index — across replicas."""
    r, s = mesh
    g = gpus_per_node
    return {"shard": (s, 1, s > g), "replicate": (r, s, r * s > g)}


def inter_node_share(ranks: Sequence[int], gpus_per_node: int) -> float:
    """The share of a ring's edges over `ranks` (in ring order) that cross nodes: what one GPU
    of the group sends over the network on average, per byte it sends in the ring. A ring over
    64 GPUs on 8 nodes leaves each node once: 8 of its 64 edges cross, 1/8 per GPU; a ring across
    replicas, one GPU per node, crosses on every edge."""
    n = len(ranks)
    crossing = sum(
        ranks[i] // gpus_per_node != ranks[(i + 1) % n] // gpus_per_node for i in range(n)
    )
    return crossing / n if n > 1 else 0.0


def bytes_by_link(
    sent: Iterable[tuple[Sequence[int], float]], gpus_per_node: int
) -> dict[str, float]:
    """One GPU's bytes inside its node and between nodes, from (a group's ranks in ring order,
    the bytes this GPU sends in that group's rings) pairs, as each ring routes them."""
    by_link = {"intra_node": 0.0, "inter_node": 0.0}
    for ranks, moved in sent:
        share = inter_node_share(ranks, gpus_per_node)
        by_link["inter_node"] += share * moved
        by_link["intra_node"] += (1 - share) * moved
    return by_link


def node_nic_bytes(
    moved: dict[str, dict[str, float]], mesh: tuple[int, int], gpus_per_node: int
) -> float:
    """Bytes per step through one node's NICs, from one rank's bytes by group (`step_bytes`'s
    shape; full FSDP is mesh (1, N) with everything in "shard")."""
    links = _links(mesh, gpus_per_node)
    return sum(
        links[group][1] * b for group, ops in moved.items() if links[group][2] for b in ops.values()
    )


def _units(workload: Workload) -> list[dict[str, Any]]:
    """The whole model as one unit, unpadded (padding is a rounding at these sizes)."""
    psi = int(workload.parameters)
    return [{"numel": psi, "padded_numel": psi, "element_size": workload.bytes_per_parameter}]


def comm_seconds(
    moved: dict[str, dict[str, float]], mesh: tuple[int, int], network: Network, units: int
) -> float:
    """Seconds one rank spends communicating per step: for each group ("shard", "replicate")
    and op, the ring's latency hops (once per unit: each unit runs its own rings) plus its bytes
    over the link it runs on — NVLink inside a node; across nodes the node's NICs, shared by
    the rings passing through it (`_links`)."""
    nic = network.nics_per_node * network.inter_bandwidth
    seconds = 0.0
    for group, (n, rings, crosses) in _links(mesh, network.gpus_per_node).items():
        for op, per_rank in moved.get(group, {}).items():
            hops = HOPS[op] * (n - 1) * units
            if crosses:
                seconds += hops * network.inter_latency + rings * per_rank / nic
            else:
                seconds += hops * network.intra_latency + per_rank / network.intra_bandwidth
    return seconds


def predict(
    system: str, gpus: int, workload: Workload, network: Network, shard: int | None = None
) -> dict[str, Any]:
    """One step of "fsdp" (ZeRO-3 over all `gpus`) or "hsdp" (shard groups of `shard` GPUs
    inside a node, default the whole node) on `gpus` GPUs: bytes per rank and per node NIC,
    communication time, step time and TFLOPS per GPU.

    A ring leaves each node once: a node's NICs carry one ring edge's bytes per ring passing
    through it — 1 ring for FSDP's collectives over the world, S rings (one per shard index)
    for HSDP's all-reduce across replicas. Each of the workload's `units` runs its own rings:
    the latency terms count once per unit.
    """
    g = network.gpus_per_node
    if system not in ("fsdp", "hsdp"):
        raise ValueError(f"system={system!r}: expected 'fsdp' or 'hsdp'")
    if gpus < 1 or (gpus > g and gpus % g):
        raise ValueError(f"gpus={gpus}: expected 1..{g} or a multiple of gpus_per_node={g}")
    s = gpus if system == "fsdp" else min(gpus, shard or g)
    if system == "hsdp" and (s < 1 or g % s or gpus % s):
        raise ValueError(f"shard={shard}: expected a divisor of gpus_per_node={g} and gpus={gpus}")
    r = gpus // s
    moved = step_bytes(_units(workload), (r, s), "full" if system == "fsdp" else "hybrid")
    comm_s = comm_seconds(moved, (r, s), network, workload.units)
    t_c = workload.compute_s
    step = t_c + max(0.0, comm_s - workload.overlap * t_c)
    return {
        "system": system,
        "gpus": gpus,
        "nodes": max(1, gpus // g),
        "mesh": [r, s],
        "bytes_per_rank": moved,
        "node_nic_bytes": node_nic_bytes(moved, (r, s), g),
        "comm_s": comm_s,
        "compute_s": t_c,
        "step_s": step,
        "tflops_per_gpu": workload.flops_per_gpu / step / 1e12,
    }


def scaling(
    workload: Workload, network: Network, nodes: list[int], shard: int | None = None
) -> dict[str, list[dict[str, Any]]]:
    """`predict` for both systems at each node count."""
    g = network.gpus_per_node
    return {
        system: [predict(system, n * g, workload, network, shard) for n in nodes]
        for system in ("fsdp", "hsdp")
    }


def with_bandwidth(network: Network, inter_gbit: float) -> Network:
    """`network` with another inter-node bandwidth, in Gbit/s (the unit NICs are sold in)."""
    return replace(network, inter_bandwidth=inter_gbit * GBIT)
