"""What makes a plan that does not fit fit: every combination of the changes a user can make,
ranked by what each costs by the planner's own model.
"""

from __future__ import annotations

from typing import Any


def changes_that_fit(setup: dict[str, Any], most: int = 5) -> list[dict[str, Any]]:
    """Every combination of another checkpointing, a higher ZeRO stage (HSDP -> ZeRO-3), a smaller
    micro-batch and more GPUs (up to 128x) after which the plan fits, cheapest first by the
    planner's own cost — GPU-seconds per thousand tokens a step trains — then by headroom;
    at most `most`, each with its words, its cost and its peak."""
    from fsdp_lab.planning import planner

    order = ["none", "optimizer", "grad_op", "full"]
    lab = setup["lab_strategy"]
    strategies: list[tuple[str, dict[str, Any]]] = [("", {})]
    if lab in order[:-1]:
        strategies += [
            (
                f"strategy='{planner.LAB_NAMES[s]}'",
                {"lab_strategy": s, "strategy": planner.LAB_NAMES[s]},
            )
            for s in order[order.index(lab) + 1 :]
        ]
    if lab.startswith("hybrid"):
        strategies.append(
            (
                "strategy='zero3', mesh=None",  # a mesh is HSDP's only: the change drops it
                {"lab_strategy": "full", "strategy": "zero3", "mesh": None},
            )  # fmt: skip
        )
    checkpoints = [("", {})] + [
        (f"checkpoint='{other}'", {"checkpoint": other})
        for other in planner.CHECKPOINTS
        if other != setup["checkpoint"]
    ]
    batches = [("", {})]
    b = setup["micro_batch"]
    while b > 1:
        b //= 2
        batches.append((f"micro_batch={b}", {"micro_batch": b}))
    fits = []
    for words_c, c in checkpoints:
        for words_s, st in strategies:
            for words_b, mb in batches:
                for doublings in range(8):
                    trial = {**setup, **c, **st, **mb}
                    more = setup["gpus"] * 2**doublings
                    if more > planner.MAX_GPUS:
                        break
                    trial["gpus"] = more
                    if trial["mesh"]:
                        trial["mesh"] = (more // trial["mesh"][1], trial["mesh"][1])
                    trial["shard_ranks"] = trial["mesh"][1] if trial["mesh"] else more
                    words = [w for w in (words_c, words_s, words_b) if w]
                    words += [f"gpus={more}"] if doublings else []
                    if not words:
                        continue
                    planned = planner.predict(trial, planner.model_layout(trial["model"], trial["seq"],
                                                          trial["shard_ranks"]))  # fmt: skip
                    if planned["fits"]:
                        tokens = trial["seq"] * trial["micro_batch"] * trial["grad_accumulation"]
                        fits.append({
                            "change": ", ".join(words),
                            "gpu_s_per_1k_tokens": planned["step_time_s"] * 1e3 / tokens,
                            "peak_bytes": planned["per_rank_bytes"]["total"],
                            "headroom_bytes": planned["usable_bytes"]
                            - planned["per_rank_bytes"]["total"],
                        })  # fmt: skip
                        break  # more GPUs than the fewest that fit only cost more
    fits.sort(key=lambda f: (round(f["gpu_s_per_1k_tokens"], 9), -f["headroom_bytes"]))
    return fits[:most]
