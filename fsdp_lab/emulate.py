"""An emulated multi-node cluster on one Linux machine: each "node" a network namespace, the
nodes joined by veth pairs shaped with `tc` (a token bucket, `tbf`), the ranks of a node inside
its namespace, collectives over real TCP (gloo).

    with emulated_nodes(2, rate="1gbit") as nodes:       # ip netns, veth, tc: root only
        results = run_ranks(nodes, ranks_per_node=2, job=fn)  # fn(rank, world) on every rank

[Note: the emulated link] Inside a namespace the ranks of a node reach each other through their
own address (the kernel loops it back: no shaping). Between two nodes every packet crosses the
veth pair, whose sending side is a `tbf` qdisc of `rate`: the slow inter-node network. `netem`
(added latency) is often missing from cloud kernels; without it the link has only its own
latency, which `measure_link` measures, and the network model takes the measured value. The
namespaces (and with them the veth ends and their addresses, 10.231.x.y, used nowhere else)
are removed when the block ends, also on an exception. Rendezvous is a `FileStore` in a
private temporary folder: a file, not a port, so no listening socket outside the namespaces.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue as queue_module
import shutil
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

CLONE_NEWNET = 0x40000000
IN_LAUNCHER_ENV = "FSDP_LAB_IN_LAUNCHER"  # = fsdp_lab.cluster.launcher's (torch-free here)
NETNS_DIR = "/var/run/netns"


@dataclass
class Nodes:
    """The emulated nodes: namespace, interface and address of each, and the link's rate."""

    namespaces: list[str]
    interfaces: list[str]
    addresses: list[str]
    rate: str
    netem: bool = False
    folder: str = field(default="")


def unavailable() -> str | None:
    """Why this machine cannot emulate nodes (one line), or None when it can."""
    if not os.path.isdir("/proc/self/ns") or os.name != "posix":
        return "needs Linux network namespaces"
    if os.geteuid() != 0:
        return "needs root (ip netns, tc): run as root to emulate nodes"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (Debian: apt-get install iproute2)"
    probe = f"fsdplab-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip() or made.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _run(*args: str) -> None:
    proc = subprocess.run(list(args), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed: {proc.stderr.strip()}")


def parse_rate(rate: str) -> float:
    """tc's rate ("1gbit", "200mbit", "500kbit") in bytes per second."""
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "bit": 1.0}
    text = str(rate).strip().lower()
    for unit, scale in units.items():
        if text.endswith(unit):
            number = text[: -len(unit)]
            try:
                value = float(number)
            except ValueError:
                break
            if value > 0:
                return value * scale / 8
    raise ValueError(
        f"rate={rate!r}: expected a positive number and a unit of kbit, mbit or gbit "
        "(tc's spelling). Fix: rate='1gbit'"
    )


@contextlib.contextmanager
def emulated_nodes(count: int = 2, rate: str = "1gbit", delay_ms: float = 0.0) -> Iterator[Nodes]:
    """`count` network namespaces in a chain of veth pairs (node k to k+1; 2 nodes: one pair),
    each sending side shaped to `rate`; ``delay_ms`` where `netem` exists. Removed on exit."""
    parse_rate(rate)
    if count != 2:
        raise ValueError(f"count={count}: two emulated nodes are supported. Fix: count=2")
    reason = unavailable()
    if reason:
        raise RuntimeError(f"cannot emulate nodes here: {reason}")
    tag = f"{os.getpid() % 100000}"
    names = [f"fsdplab{tag}n{k}" for k in range(count)]
    ifaces = [f"fl{tag}v{k}" for k in range(count)]  # interface names: 15 characters at most
    subnet = 1 + os.getpid() % 250
    addrs = [f"10.231.{subnet}.{k + 1}" for k in range(count)]
    folder = tempfile.mkdtemp(prefix="fsdp_lab_nodes_")
    made: list[str] = []
    try:
        for name in names:
            _run("ip", "netns", "add", name)
            made.append(name)
        _run("ip", "link", "add", ifaces[0], "netns", names[0], "type", "veth", "peer", "name",
             ifaces[1], "netns", names[1])  # fmt: skip
        netem = False
        for name, iface, addr in zip(names, ifaces, addrs, strict=True):
            _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", iface)
            _run("ip", "-n", name, "link", "set", "lo", "up")
            _run("ip", "-n", name, "link", "set", iface, "up")
            tc = ["ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", iface, "root"]
            if delay_ms > 0:  # netem for the delay, tbf under it for the rate
                tried = subprocess.run([*tc, "handle", "1:", "netem", "delay", f"{delay_ms}ms"],
                                       capture_output=True)  # fmt: skip
                netem = tried.returncode == 0
            if netem:
                _run(*tc[:-1], "parent", "1:1", "handle", "10:", "tbf", "rate", rate,
                     "burst", "256kb", "latency", "400ms")  # fmt: skip
            else:
                _run(*tc, "tbf", "rate", rate, "burst", "256kb", "latency", "400ms")
        yield Nodes(names, ifaces, addrs, rate, netem, folder)
    finally:
        for name in made:  # the veth pair and the addresses go with the namespaces
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def _enter(namespace: str) -> None:
    """Move this process into `namespace` (setns on its /var/run/netns file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(os.path.join(NETNS_DIR, namespace), os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")
    finally:
        os.close(fd)


def _rank_main(
    rank: int, world: int, namespace: str, iface: str, store: str, job: Callable, args: tuple,
    queue: Any,
) -> None:  # fmt: skip
    try:
        _enter(namespace)  # before any socket: gloo's connections are made in here
        os.environ["GLOO_SOCKET_IFNAME"] = iface
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks on a few cores: no OpenMP threads spinning
        dist.init_process_group(
            "gloo", store=dist.FileStore(store, world), rank=rank, world_size=world
        )
        try:
            queue.put((rank, "ok", job(rank, world, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def run_ranks(
    nodes: Nodes, ranks_per_node: int, job: Callable, *args: Any, timeout: float = 600
) -> list[Any]:
    """`job(rank, world, *args)` on ranks_per_node ranks in each emulated node (rank r in node
    r // ranks_per_node), each in a fresh spawned process; their results by rank. A failed
    rank's traceback is raised here; every process is gone when this returns."""
    world = ranks_per_node * len(nodes.namespaces)
    store = os.path.join(nodes.folder, f"store{time.monotonic_ns()}")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = []
    # Inherited by the children: importing fsdp_lab there must not start a Cluster's fork server.
    os.environ[IN_LAUNCHER_ENV] = "1"
    try:
        for r in range(world):
            node = r // ranks_per_node
            ns, iface = nodes.namespaces[node], nodes.interfaces[node]
            p = ctx.Process(target=_rank_main, args=(r, world, ns, iface, store, job, args, queue))
            p.start()
            procs.append(p)
    finally:
        del os.environ[IN_LAUNCHER_ENV]
    results: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + timeout
        while len(results) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"emulated ranks did not finish within {timeout:.0f} s")
            try:
                rank, status, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead and not queue.qsize():  # died without a word (a signal, a crash)
                    raise RuntimeError(f"emulated rank(s) {dead} died: exit codes "
                                       f"{[procs[r].exitcode for r in dead]}") from None  # fmt: skip
                continue
            if status == "error":
                raise RuntimeError(f"emulated rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world)]


def torchrun_on_nodes(
    nodes: Nodes, nproc_per_node: int, argv: list[str], timeout: float = 300, port: int = 29500
) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes N --node-rank k -m fsdp_lab *argv`` in each emulated node, as one
    would type it on N machines: static rendezvous at node 0's address (`port`, inside the
    namespaces only), gloo bound to each node's link (``GLOO_SOCKET_IFNAME``). Returns each
    node's finished process (stdout, stderr, returncode); on a timeout every node's launcher
    and ranks are killed (each node runs in a session of its own) and a TimeoutError names it."""
    import sys

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPLBACKEND": "Agg"}
    procs = []
    for k, (ns, iface) in enumerate(zip(nodes.namespaces, nodes.interfaces, strict=True)):
        cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "torch.distributed.run",
               "--nnodes", str(len(nodes.namespaces)), "--node-rank", str(k),
               "--nproc-per-node", str(nproc_per_node), "--master-addr", nodes.addresses[0],
               "--master-port", str(port), "-m", "fsdp_lab", *argv]  # fmt: skip
        procs.append(subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**env, "GLOO_SOCKET_IFNAME": iface}, start_new_session=True,
        ))  # fmt: skip
    deadline = time.monotonic() + timeout
    finished = []
    try:
        for k, proc in enumerate(procs):
            left = max(1.0, deadline - time.monotonic())
            try:
                out, err = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"torchrun on emulated node {k} did not finish within {timeout:.0f} s: "
                    f"fsdp-lab {' '.join(argv)}"
                ) from None
            finished.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
    return finished
