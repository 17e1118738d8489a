"""Lab 06 on an emulated two-node cluster (`fsdp_lab.emulate`): the ranks of each "node" in
their own network namespace, the nodes joined by a veth pair shaped to the inter-node rate.

On those ranks: the link measured first (an 8 MiB all-reduce and a 4-byte one between two
ranks, inside a node and across), then full FSDP and HSDP steps of a 4.2M-parameter TinyGPT
timed, and one rank's compute alone (the same steps on its slice, no sharding). `analysis`
sets the measured steps beside `fsdp_lab.netsim`'s prediction for the measured link.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from fsdp_lab.hsdp.lab.config import HsdpConfig

# Big enough that the bytes, not the per-message costs, set the time on a 1 Gbit/s link.
EMULATED_GPT = {"vocab_size": 4096, "dim": 256, "n_layers": 4, "n_heads": 4, "seq_len": 64}
PROBE_BYTES = 8 * 2**20
SYSTEMS = ("full", "hybrid")


def _median_time(fn: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _probe(rank: int, pair: list[int]) -> dict[str, float] | None:
    """On the two ranks of `pair`: bytes/s of an all-reduce of PROBE_BYTES (each rank sends
    that many bytes, 2(n−1)/n of it), and the latency of one hop (a 4-byte all-reduce is 2)."""
    import torch
    import torch.distributed as dist

    group = dist.new_group(pair)  # every rank takes part in making a group
    if rank not in pair:
        return None
    big, small = torch.ones(PROBE_BYTES // 4), torch.ones(1)
    dist.all_reduce(big, group=group)  # connections and buffers made
    seconds = _median_time(lambda: dist.all_reduce(big, group=group), 3)
    hop = _median_time(lambda: dist.all_reduce(small, group=group), 20) / 2
    return {"bandwidth": PROBE_BYTES / seconds, "latency": hop}


def job(rank: int, world: int, mesh: tuple[int, int], steps: int) -> dict[str, Any]:
    """On every emulated rank: the link probes, the timed steps of each system, the compute."""
    import torch
    import torch.distributed as dist

    from fsdp_lab import comm, reference
    from fsdp_lab.models import Block, tiny_gpt
    from fsdp_lab.sharding import shard, sharding_state

    s = mesh[1]
    out: dict[str, Any] = {"intra": _probe(rank, [0, 1]), "inter": _probe(rank, [0, s])}
    batch = 4 * world  # 4 sequences per rank

    def timed(model: torch.nn.Module, n: int, of: int) -> list[float]:
        stamps = [time.perf_counter()]
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        reference.train_steps(model, opt, steps, global_batch=batch, seq_len=64, rank=n,
                              world=of, on_step=lambda _: stamps.append(time.perf_counter()))  # fmt: skip
        return [b - a for a, b in zip(stamps, stamps[1:], strict=False)][1:]  # first: warm-up

    for system in SYSTEMS:
        model = tiny_gpt(**EMULATED_GPT)
        shard(model, units={Block}, strategy=system, mesh=mesh if system != "full" else None)
        dist.barrier()
        with comm.CommLog() as log:
            step_s = timed(model, rank, world)
        units = sharding_state(model).units
        out[system] = {
            "step_s": step_s,
            "bytes_per_step": sum(r.bytes for r in log.records) / steps,
            "units": len(units),
            "parameters": sum(u.flat.numel for u in units),
        }
    dist.barrier()
    out["compute_s"] = timed(tiny_gpt(**EMULATED_GPT), rank, world)  # this rank's slice, alone
    return out


def measure_emulated(config: HsdpConfig) -> dict[str, Any]:
    """Two emulated nodes of S ranks each at `config.inter_node_bandwidth`, or why not."""
    from fsdp_lab import emulate

    if config.emulate_nodes == 0:
        return {"skipped": "not asked for (--emulate-nodes 2 runs it, as root on Linux)"}
    reason = emulate.unavailable()
    if reason:
        return {"skipped": f"this machine cannot: {reason}"}
    r, s = config.mesh
    with emulate.emulated_nodes(config.emulate_nodes, rate=config.inter_node_bandwidth) as nodes:
        ranks = emulate.run_ranks(nodes, s, job, (r, s), config.emulate_steps)
    return {
        "rate": config.inter_node_bandwidth,
        "netem": nodes.netem,
        "probe_bytes": PROBE_BYTES,
        "ranks": ranks,
        "model": dict(EMULATED_GPT),
    }
