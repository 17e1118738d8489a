"""The invalid-wrapping audit: one row per system, the same on every rank; ours refuses at wrap.

What PyTorch's FSDPs do with the split tie is measured, not asserted: it depends on the torch."""

from __future__ import annotations

import pytest

import fsdp_lab
from fsdp_lab.models import tiny_gpt
from fsdp_lab.tying.lab.audit import STAGES, SYSTEMS, _agree, audit_worker
from fsdp_lab.tying.lab.report import audit_table


@pytest.fixture(scope="module")
def audited(cluster_of):
    return cluster_of(2).run(audit_worker)


@pytest.fixture(scope="module")
def audit_rows(audited):
    return [per_rank["rows"] for per_rank in audited]


def test_one_row_per_system_on_every_rank_and_ranks_agree(audit_rows):
    assert len(audit_rows) == 2
    for rows in audit_rows:
        assert [row["system"] for row in rows] == list(SYSTEMS)
    assert audit_rows[0] == audit_rows[1]


def test_the_audit_says_which_model_it_ran_on(audited):
    # Without a workload: TinyGPT as its factory builds it, read off the model built.
    model = tiny_gpt()
    assert audited[0]["model"] == audited[1]["model"]
    built = audited[0]["model"]
    assert built["model"] == "fsdp_lab.models:tiny_gpt"
    assert [built["vocab"], built["dim"]] == list(model.tok_emb.weight.shape)
    assert built["layers"] == len(model.blocks)
    assert built["parameters"] == sum(p.numel() for p in model.parameters())


def test_fsdp_lab_refuses_at_wrap_naming_the_tie(audit_rows):
    ours = next(row for row in audit_rows[0] if row["system"] == "fsdp_lab shard")
    assert ours["accepted"] is False
    assert ours["stage"] == "wrap"
    assert ours["error"].startswith("PlanError: ")
    for name in ("'tok_emb.weight'", "'tok_emb'", "'head'"):
        assert name in ours["error"]
    assert ours["still_tied"] is None and ours["equal_values"] is None


def test_rows_are_consistent_whatever_torch_does(audit_rows):
    for row in audit_rows[0]:
        if row["accepted"]:
            assert row["stage"] is None
            assert isinstance(row["still_tied"], bool), row
            assert isinstance(row["equal_values"], bool), row
            if row["still_tied"]:  # one tensor cannot hold two values
                assert row["equal_values"]
        else:
            assert row["stage"] in STAGES
            assert isinstance(row["error"], str) and row["error"].strip()
            assert row["still_tied"] is None and row["equal_values"] is None


def test_table_has_a_line_per_system(audit_rows):
    table = audit_table(audit_rows[0]).splitlines()
    assert table[0].startswith("| system | accepted | stage")
    assert len(table) == 2 + len(SYSTEMS)
    for line, system in zip(table[2:], SYSTEMS, strict=True):
        assert line.startswith(f"| {system} |")
        assert line.count(" | ") == 5  # '|' inside messages is escaped


def _fails_on_rank_one() -> tuple:
    def stage() -> int:
        if fsdp_lab.rank() == 1:
            raise RuntimeError("only rank 1 broke\nsecond line dropped")
        return 7

    return _agree(stage)


def test_a_failure_on_one_rank_is_recorded_on_every_rank(cluster_of):
    # Rank 0 succeeded, yet it must stop too: going on alone would hang in the next collective.
    expected = (False, None, "rank 1: RuntimeError: only rank 1 broke")
    assert cluster_of(2).run(_fails_on_rank_one) == [expected, expected]
    assert cluster_of(2).run(_agree, lambda: 3) == [(True, 3, None), (True, 3, None)]
