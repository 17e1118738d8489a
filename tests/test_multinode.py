"""Every lab under multi-node torchrun: two emulated nodes (network namespaces joined by a
shaped veth link, `fsdp_lab.emulate`) of two ranks each, launched as one would on two machines
(`torchrun --nnodes 2 --node-rank k --master-addr <node 0>`), gives the bytes, verdicts and
parity the same lab gives on one host with four ranks.

Root only (ip netns, tc): elsewhere these tests skip with the reason. The namespaces and every
process in them are removed when the module's tests end, also on failure.
"""

from __future__ import annotations

import json
import math
import os

import pytest

from fsdp_lab import emulate

NEEDS = emulate.unavailable()
# Whole labs under torchrun on two emulated nodes: an end-to-end run (`pytest -m e2e`, CI).
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(NEEDS is not None, reason=f"emulated nodes: {NEEDS}"),
]

# Each lab at a small size: what is compared is exact, so small is enough. The end-to-end runs
# (`pytest -m e2e`) take the sharding lab (FSDP across nodes);
# FSDP_LAB_MULTINODE_ALL=1 (scripts/multinode_check.sh) runs every lab, as the README reports.
EVERY_LAB = os.environ.get("FSDP_LAB_MULTINODE_ALL") == "1"
IN_THE_SUITE = ("shard",)
LABS = {
    "collectives": ["--numel", "64"],
    "shard": ["--steps", "2", "--no-sharded-optimizer"],
    "checkpoint": ["--layers", "8", "--dim", "16", "--batch", "8"],
    "tying": [
        "--vocab",
        "768",
        "--dim",
        "48",
        "--layers",
        "3",
        "--heads",
        "2",
        "--seq-len",
        "12",
        "--batch",
        "4",
        "--steps",
        "2",
        "--spike-steps",
        "1",
    ],
    "meta-init": ["--model-mb", "16", "--sizes-mb", "16", "--no-70b"],
    "pp-seed": [
        "--stages",
        "2",
        "--steps",
        "4",
        "--grow-dims",
        "--scale-ranks",
        "--repeats",
        "1",
        "--convergence-seeds",
        "1",
        "--convergence-steps",
        "2",
    ],
    "hsdp": ["--steps", "2", "--mesh", "2,2", "--no-pytorch"],
}
# Leaves that move with the clock, the host or the processes: not compared.
VARYING = ("time", "second", "rss", "resident", "timeline", "memory_trace", "markers", "origin",
           "host", "pid", "emulated", "wall", "elapsed", "throughput", "speed")  # fmt: skip


def _varies(key: str) -> bool:
    key = key.lower()
    return (
        any(v in key for v in VARYING)
        or key in ("t", "start", "end")
        or key.endswith(("_s", "_ms"))
    )


def _leaves(value, path=()):
    """(path, value) of every bool, and of every number whose key names bytes, calls or a
    difference from a reference: what must not depend on where the ranks run."""
    if isinstance(value, dict):
        for key, item in value.items():
            # PyTorch's own memory traces follow its asynchronous frees: they move with timing.
            theirs = "fsdp2" in path and key == "traces"
            if not _varies(str(key)) and not theirs:
                yield from _leaves(item, (*path, str(key)))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _leaves(item, (*path, str(i)))
    elif isinstance(value, bool) or (
        isinstance(value, (int, float))
        and path
        and ("bytes" in path[-1] or "diff" in path[-1] or "calls" in path[-1])
    ):
        yield path, value


def _same(path: tuple, value, reference: dict) -> bool:
    """Bytes, calls and verdicts exactly; a difference from a reference (parity) to within what
    the reference's own last bits allow — under torchrun rank 0 computes the single-process
    reference itself, one thread, where a Cluster's driver uses the machine's cores."""
    if path not in reference:
        return False
    expected = reference[path]
    if isinstance(value, bool) or "diff" not in path[-1]:
        return value == expected
    return math.isclose(value, expected, rel_tol=0.05, abs_tol=1e-7)


@pytest.fixture(scope="module")
def nodes():
    with emulate.emulated_nodes(2, rate="10gbit") as emulated:
        yield emulated


def _one_host(capfd, argv: list[str]) -> dict:
    from fsdp_lab import cli

    capfd.readouterr()
    code = cli.main([*argv, "--world-size", "4", "--json"])
    out, err = capfd.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize(
    "lab",
    [
        pytest.param(
            lab,
            marks=pytest.mark.skipif(
                not EVERY_LAB and lab not in IN_THE_SUITE,
                reason="every lab: FSDP_LAB_MULTINODE_ALL=1 (scripts/multinode_check.sh)",
            ),
        )  # fmt: skip
        for lab in LABS
    ],
)
def test_every_lab_under_multi_node_torchrun_gives_what_one_host_gives(nodes, capfd, lab):
    argv = [lab, *LABS[lab]]
    sent_before = _sent(nodes)
    node0, node1 = emulate.torchrun_on_nodes(nodes, 2, [*argv, "--json"], timeout=240)
    assert node0.returncode == node1.returncode == 0, node0.stderr[-3000:] + node1.stderr[-3000:]
    printed = [line for line in node0.stdout.splitlines() if line.startswith("{")]
    assert len(printed) == 1 and "{" not in node1.stdout  # rank 0 (on node 0) alone prints
    multi = json.loads(printed[0])
    single = _one_host(capfd, argv)
    compared = dict(_leaves(single))
    assert compared, "nothing to compare"
    differing = {p: (v, compared.get(p)) for p, v in _leaves(multi) if not _same(p, v, compared)}
    assert not differing, differing
    if "world_size" in single:
        assert multi["world_size"] == single["world_size"] == 4
    # Ranks 2 and 3 live in node 1: the job's traffic crossed the veth pair (its counters).
    assert _sent(nodes) - sent_before > 0


def _sent(nodes) -> int:
    """Bytes node 0's end of the emulated link has sent so far."""
    path = f"/sys/class/net/{nodes.interfaces[0]}/statistics/tx_bytes"
    return int(emulate.subprocess.run(
        ["ip", "netns", "exec", nodes.namespaces[0], "cat", path],
        capture_output=True, text=True, check=True,
    ).stdout)  # fmt: skip
