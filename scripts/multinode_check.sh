#!/usr/bin/env bash
# Every lab under multi-node torchrun: two emulated nodes (network namespaces joined by a shaped
# link) of two ranks each, each lab's result compared with four ranks on one host. Root only
# (ip netns, tc); about three minutes on 2 cores. The test suite runs the sharding lab; this
# runs all seven.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 MPLBACKEND=Agg
export FSDP_LAB_MULTINODE_ALL=1
exec "${PYTHON:-python3}" -m pytest -q -p no:cacheprovider -rs --durations=10 "$@" tests/test_multinode.py
