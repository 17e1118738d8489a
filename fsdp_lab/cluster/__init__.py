"""Live ranks for notebooks, scripts and the CLI: start them once, `run` functions on them.

    from fsdp_lab import Cluster
    with Cluster(4) as cluster:           # 4 rank processes in one process group
        cluster.run(fn, *args)            # fn on every rank; results in rank order

Modules, in the order a call travels:
    driver.py     Cluster: start, run, failure policy (read its docstring first)
    protocol.py   the messages and RankError
    launcher.py   the fork server ranks are forked from (torch imported once)
    rank_main.py  the loop inside each rank
    output.py     ranks' stdout/stderr, live, as [rank r] lines
    where.py      rank(), world_size(), device() inside a rank
    torchrun.py   AttachedCluster: the same interface under torchrun; borrow() for labs,
                  shared_folder() for files every rank reads
"""

# Importing this package starts nothing, and imports no torch: the fork server ranks are forked
# from starts with the first Cluster (`launcher.warm_up`), so a command that never starts ranks
# (`fsdp-lab grade` before its first reference, `--help`) leaves no process behind; and a command
# about to start ranks can start the fork server (`launcher`, torch-free) before it imports
# torch itself, the two imports side by side on two cores.
from fsdp_lab.lazy import lazy_names

_TORCHRUN = ("AttachedCluster", "borrow", "open_cluster", "shared_folder", "under_torchrun")
_WHERE = ("BACKENDS", "Placement", "device", "in_rank_threads", "intra_op_threads", "rank",
          "rank_threads", "resolve_backend", "resolve_placement", "world_size")  # fmt: skip
_PUBLIC = {
    "Cluster": "fsdp_lab.cluster.driver",
    "RankError": "fsdp_lab.cluster.protocol",
    **dict.fromkeys(_TORCHRUN, "fsdp_lab.cluster.torchrun"),
    **dict.fromkeys(_WHERE, "fsdp_lab.cluster.where"),
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_names(__name__, _PUBLIC, globals())
