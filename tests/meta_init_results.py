"""Lab 04's measurements without ranks: plain dicts shaped like `measure.measure()`'s, each
figure chosen so that a test can turn one comparison around (which approach was faster, whether
a meta build stayed below the ordinary one, whether the control disagreed).

Shared by test_meta_init_analysis.py and test_meta_init_report.py.
"""

from __future__ import annotations

from typing import Any

from fsdp_lab.labs.contract import LabResult
from fsdp_lab.meta_init.lab import MetaInitConfig, analysis
from fsdp_lab.meta_init.lab.config import APPROACHES, CONTROL, MODES, PARENT_INIT

MiB = 2**20
PSI_70B = 70_553_706_496  # Llama-3-70B's parameter count, as `meta_summary` counts it


def rss(peak: int) -> dict:
    return {"t": [0.0, 0.1, 0.2], "bytes": [0, peak, peak // 2], "marks": []}


def materialise(n: int = 2, growth: dict[str, int] | None = None) -> dict:
    """What `measure.measure_materialisation` returns: an 8 MiB model, a 1 MiB largest unit.

    `growth`: mode -> rank 0's resident-memory growth (default: 1, 2, 3 MiB in `MODES` order).
    """
    growth = growth or {}
    runs = {
        mode: [
            {
                "rss": rss((i + 1) * MiB),
                "rss_start_bytes": 100 * MiB,
                "rss_growth_bytes": growth.get(mode, (i + 1) * MiB) + r,  # rank r: + r bytes
                "rss_after_trim_bytes": 4 * MiB + r,
                "peak_bytes": (i + 5) * MiB + r,
                "after_bytes": 4 * MiB,
                "time_s": 0.1 * (i + 1),
            }
            for r in range(n)
        ]
        for i, mode in enumerate(MODES)
    }
    return {
        "model": {"dim": 64},
        "model_mb": 8,
        "full_model_bytes": 8 * MiB,
        "buffer_bytes": 4096,
        "units": 5,
        "largest_unit_bytes": MiB,
        "runs": runs,
    }


def size(
    model_mb: int,
    n: int = 2,
    wrong: dict | None = None,
    control: bool = False,
    times: dict[str, float] | None = None,
) -> dict:
    """What `measure.measure_size` returns; `wrong`: approach -> mismatched parameter names;
    `times`: approach -> the slowest rank's seconds (rank r takes that minus (n - 1 - r))."""
    params, buffers = model_mb * MiB, 1024
    runs = {}
    for approach in (*APPROACHES, CONTROL) if control else APPROACHES:
        moved = params + buffers if approach == "sync_module_states" and n > 1 else 0
        slowest = (times or {}).get(approach, float(n))
        runs[approach] = {
            "parameter_names": 10,
            "per_rank": [
                {
                    "time_s": slowest - (n - 1 - r),  # the last rank is the slowest
                    "bytes_moved": moved,
                    "bytes_by_op": {"broadcast": moved} if moved else {},
                    "comm_time_s": 0.5 if moved else 0.0,
                }
                for r in range(n)
            ],
            "mismatched_parameters": (wrong or {}).get(approach, []),
            "mismatched_buffers": [],
        }
    return {
        "model_mb": model_mb,
        "model": {"dim": 64},
        "parameters": params // 4,
        "parameter_bytes": params,
        "buffer_bytes": buffers,
        "runs": runs,
    }


KAIMING = {
    "shape": [512, 256],
    "world_size": 2,
    "row_shards_max_abs_diff": [0.0, 0.1],
    "row_shards_equal_own_rows": [True, False],
    "row_shards_equal_first_rows": [True, True],
    "bound_full": 0.0625,
    "bound_column_shard": 0.0625 * 2**0.5,
    "max_abs_full": 0.06,
    "max_abs_column_shard": 0.08,
    "deterministic_slices_equal_full": True,
    "deterministic_max_abs": 0.06,
}
_KEPT = {"tied_on_meta": True, "problems_after_shard": [], "output_equals_embedding": True}
TIES = {
    "param_init_fn": dict(_KEPT),
    "shard_init": dict(_KEPT),
    "to_empty": {
        "tied_after_to_empty": False,
        "problems": ["x"],
        "shard_refused": True,
        "shard_error": "retie",
    },
}
SEVENTY = {
    "build_time_s": 0.2,
    "rss_start_bytes": 1,
    "rss_growth_bytes": 4 * MiB,
    "second_build": {"build_time_s": 0.1, "rss_start_bytes": 1, "rss_growth_bytes": 2},
    "summary": {
        "parameters": PSI_70B,
        "parameter_bytes": 4 * PSI_70B,
        "by_dtype": {"float32": {"parameters": PSI_70B, "bytes": 4 * PSI_70B}},
        "parameter_tensors": 723,
        "shared_names": 0,
        "buffers": 512,
        "buffer_bytes": 2048,
        "modules": 966,
        "devices": ["meta"],
    },
    "config": {},
}


def parent_init(recipe_wrong: list[str] | None = None, n: int = 2) -> dict:
    """What `measure.measure_parent_init` returns; the recipe's mismatches on rank 1 only."""
    wrong = (
        ["blocks.0.attn.proj.weight", "tok_emb.weight"] if recipe_wrong is None else recipe_wrong
    )
    return {
        how: {
            "parameter_names": 53,
            "mismatched_per_rank": [
                wrong if how == "owners_only" and r == 1 else [] for r in range(n)
            ],  # fmt: skip
        }
        for how in PARENT_INIT
    }


def measured(seventy: dict | None = SEVENTY, **parts: Any) -> dict:
    """A whole `measure()` result; `parts` replace its entries by name."""
    return {
        "world_size": 2,
        "backend": "gloo",
        "seventy_b": seventy,
        "materialise": materialise(),
        "ties": [TIES, TIES],
        "agreement": [size(8, control=True), size(16)],
        "kaiming_on_a_shard": KAIMING,
        "parent_init": parent_init(),
        **parts,
    }


def analysed(config: MetaInitConfig | None = None, **parts: Any) -> LabResult:
    """`measured(**parts)` through the lab's analysis, as `lab.run` would return it."""
    config = config or MetaInitConfig(model_mb=8, sizes_mb=(8, 16))
    return LabResult("meta-init", analysis.analyse(config, measured(**parts)))
