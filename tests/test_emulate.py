"""fsdp_lab.emulate: ranks in network namespaces joined by a tc-shaped veth pair — made, used by
real gloo collectives, and removed again, also when a rank fails. Runs as root on Linux with
`ip`/`tc` (CI's machine); elsewhere the cluster tests skip, saying why. Times are reported by
the lab, never asserted here: what is asserted is bytes, structure and clean-up."""

from __future__ import annotations

import subprocess

import pytest

from fsdp_lab import emulate

REASON = emulate.unavailable()
needs_netns = pytest.mark.skipif(REASON is not None, reason=f"no emulated nodes: {REASON}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


@pytest.mark.parametrize(
    ("rate", "bytes_per_s"), [("1gbit", 1.25e8), ("200mbit", 2.5e7), ("500kbit", 62500.0)]
)
def test_rates_in_tc_spelling(rate, bytes_per_s):
    assert emulate.parse_rate(rate) == bytes_per_s


@pytest.mark.parametrize("rate", ["1 gigabit", "0mbit", "-5mbit", "fast"])
def test_a_bad_rate_names_the_value_and_the_fix(rate):
    with pytest.raises(ValueError, match=r"rate=.*Fix: rate='1gbit'"):
        emulate.parse_rate(rate)


def _fails_on_rank_1(rank: int, world: int) -> int:
    if rank == 1:
        raise KeyError("planted")
    return rank


def _across(rank: int, world: int) -> dict:
    import torch
    import torch.distributed as dist

    x = torch.full((1000,), float(rank))
    dist.all_reduce(x)
    return {"sum": x[0].item(), "world": world}


@needs_netns
def test_ranks_talk_across_the_shaped_link_and_the_namespaces_are_removed():
    before = _namespaces()
    with emulate.emulated_nodes(2, rate="200mbit") as nodes:
        assert set(nodes.namespaces) <= _namespaces()
        qdisc = subprocess.run(
            ["ip", "netns", "exec", nodes.namespaces[0], "tc", "qdisc", "show", "dev",
             nodes.interfaces[0]], capture_output=True, text=True,
        ).stdout  # fmt: skip
        assert "tbf" in qdisc and "200Mbit" in qdisc
        results = emulate.run_ranks(nodes, 2, _across)
    assert results == [{"sum": 0 + 1 + 2 + 3, "world": 4}] * 4
    assert _namespaces() == before  # the veth pair and its addresses went with them


@needs_netns
def test_a_failing_rank_is_named_and_nothing_is_left_behind():
    before = _namespaces()
    with (
        pytest.raises(RuntimeError, match="emulated rank 1 failed(.|\n)*planted"),
        emulate.emulated_nodes(2, rate="1gbit") as nodes,
    ):
        emulate.run_ranks(nodes, 1, _fails_on_rank_1, timeout=120)
    assert _namespaces() == before
