"""Every formula the labs compare their measurements against, and nothing else.

(Over 450 lines on purpose: one home for every formula is the rule a reader relies on — a
formula elsewhere would be one nobody checks.)

A lab measures (bytes counted at the collective call, storages the tracker saw, layer calls a
hook counted) and then sets the number beside the formula from here; no lab keeps a private
copy. Ψ is the number of parameters, N the ranks a tensor is sharded over, b bytes per element.

Model state per rank (Rajbhandari et al. 2020, "ZeRO: memory optimizations toward training
trillion parameter models", Section 3 and Table 1), with p bytes per parameter, g per gradient
and K bytes of optimizer state per parameter (fp32 master weights counted in K):

    "none"       DDP      (p + g + K)·Ψ
    "optimizer"  ZeRO-1   (p + g)·Ψ + K·Ψ/N
    "grad_op"    ZeRO-2   p·Ψ + (g + K)·Ψ/N
    "full"       ZeRO-3   (p + g + K)·Ψ/N

`Precision` turns dtypes into p, g, K: fp32 Adam (what the labs train) is p = g = 4, K = 8;
the paper's mixed-precision Adam is p = g = 2 (fp16), K = 12 (fp32 master weights, momentum
and variance). ``zero_table(7.5e9, 64, MIXED_ADAM)`` is the paper's Table 1 row: 120 GB ·
31.4 GB · 16.6 GB · 1.88 GB.

Collective bytes per rank and call, for the ring algorithms gloo and NCCL use: all-gather and
reduce-scatter move (N−1)/N of the whole tensor, all-reduce twice that, broadcast the tensor
once. FSDP per step: all-gather (N−1)/N·Ψ·b in forward and again in backward (ZeRO-3) for
every unit freed after forward (all but the root, which stays gathered by default, as in
FSDP2), reduce-scatter (N−1)/N·Ψ·b; DDP all-reduce 2(N−1)/N·Ψ·b.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

STRATEGIES = ("none", "optimizer", "grad_op", "full")  # DDP, ZeRO-1, ZeRO-2, ZeRO-3
ZERO_NAMES = {"none": "DDP", "optimizer": "ZeRO-1", "grad_op": "ZeRO-2", "full": "ZeRO-3"}
DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "sgd": 1, "sgd_plain": 0}  # tensors per parameter


def _check_count(name: str, value: Any, low: float = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= low:
        raise ValueError(f"{name}={value!r}: expected a number >= {low}")


# -- model state -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Precision:
    """The dtypes of a training setup, as the bytes per parameter of the ZeRO formulas.

    Args:
        param_dtype: the parameters the model computes with (p bytes each).
        grad_dtype: the gradients (g bytes each).
        optimizer: "adam"/"adamw" (two state tensors), "sgd" (momentum), "sgd_plain" (none).
        state_dtype: the optimizer's state tensors.
        master_weights: an fp32 copy of the parameters kept by the optimizer (mixed
            precision): 4 more bytes of K.
    """

    param_dtype: str = "float32"
    grad_dtype: str = "float32"
    optimizer: str = "adam"
    state_dtype: str = "float32"
    master_weights: bool = False

    def __post_init__(self) -> None:
        for name in ("param_dtype", "grad_dtype", "state_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: expected one of {sorted(DTYPE_BYTES)}"
                )
        if self.optimizer not in OPTIMIZER_STATES:
            raise ValueError(
                f"optimizer={self.optimizer!r}: expected one of {sorted(OPTIMIZER_STATES)}"
            )

    @property
    def p(self) -> int:
        """Bytes per parameter."""
        return DTYPE_BYTES[self.param_dtype]

    @property
    def g(self) -> int:
        """Bytes per gradient element."""
        return DTYPE_BYTES[self.grad_dtype]

    @property
    def k(self) -> int:
        """Bytes of optimizer state per parameter (the paper's K), master weights included."""
        states = OPTIMIZER_STATES[self.optimizer] * DTYPE_BYTES[self.state_dtype]
        return states + (4 if self.master_weights else 0)


FP32_ADAM = Precision()  # 4 + 4 + 8 = 16 B/param: what the labs train and measure
FP32_SGD = Precision(optimizer="sgd")  # momentum: 4 + 4 + 4
MIXED_ADAM = Precision("float16", "float16", "adam", "float32", master_weights=True)  # 2+2+12


def model_state_bytes(
    num_params: float, world_size: int, strategy: str, precision: Precision = FP32_ADAM
) -> float:
    """Per-rank bytes of parameters + gradients + optimizer state under `strategy`.

    The largest gathered unit (ZeRO-3's transient full parameters) is not included:
    `sharding` adds it for a concrete model.
    """
    _check_count("num_params", num_params)
    _check_count("world_size", world_size)
    if isinstance(world_size, float) and not world_size.is_integer():
        raise ValueError(f"world_size={world_size!r}: expected an int >= 1")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy={strategy!r}: expected one of {list(STRATEGIES)}")
    psi, n, (p, g, k) = float(num_params), world_size, (precision.p, precision.g, precision.k)
    return {
        "none": (p + g + k) * psi,
        "optimizer": (p + g) * psi + k * psi / n,
        "grad_op": p * psi + (g + k) * psi / n,
        "full": (p + g + k) * psi / n,
    }[strategy]


def zero_table(
    num_params: float, world_size: int, precision: Precision = FP32_ADAM
) -> dict[str, float]:
    """`model_state_bytes` for every strategy, plus the parameters alone replicated and sharded
    (what a rank holds right after materialising, before any gradient or optimizer state)."""
    table = {s: model_state_bytes(num_params, world_size, s, precision) for s in STRATEGIES}
    table["parameters_replicated"] = precision.p * float(num_params)
    table["parameters_sharded"] = precision.p * float(num_params) / world_size
    return table


# -- collectives -------------------------------------------------------------------------------


def collective_bytes(op: str, shard_bytes: float, world_size: int) -> float:
    """Per-rank bytes of one ring collective whose per-rank shard is `shard_bytes`.

    `op` is the `fsdp_lab.comm` name: broadcast and all_reduce move a tensor of `shard_bytes`;
    all_gather_into_tensor / reduce_scatter_tensor have N·shard_bytes on the full side.
    """
    n = world_size
    full = shard_bytes * n
    formulas = {
        "broadcast": float(shard_bytes) if n > 1 else 0.0,
        "all_gather_into_tensor": (n - 1) / n * full,
        "reduce_scatter_tensor": (n - 1) / n * full,
        "all_reduce": 2 * (n - 1) / n * shard_bytes,
    }
    if op not in formulas:
        raise ValueError(f"op={op!r}: expected one of {list(formulas)}")
    return formulas[op]


def sharding_step(
    strategy: str, units: list[dict[str, Any]], world_size: int, precision: Precision = FP32_ADAM
) -> dict[str, Any]:
    """Bytes per rank and training step under `strategy` for a model cut into `units`, and the
    peak model state (ZeRO-3: plus the largest gathered unit while it is live).

    Args:
        units: per wrap unit, "numel", "padded_numel" (rounded up to a multiple of N) and
            "element_size" (b), as `fsdp_lab.shard` reports them; under "full" also
            "reshard_after_forward" (default True): a unit freed after forward is gathered
            again for backward, one kept (the root, by default) is not. A unit with its own
            policy (`shard(policies=...)`) also has "strategy": "replicate" is all-reduced
            whole (2(N-1)/N·Ψ_u·b, like "none") and holds 16Ψ_u, the others as their name says;
            "offload": True adds the host link's copies — the shard (S_u·b, "shard_numel" S_u)
            to the device before each gather, the gradient shard back after each reduction.
    """
    n, b = world_size, units[0]["element_size"]
    f = (n - 1) / n

    def strategy_of(u: dict[str, Any]) -> str:
        own = u.get("strategy", strategy)
        return "none" if own == "replicate" else own

    psi = sum(u["numel"] for u in units)
    psi_padded = sum(u["padded_numel"] for u in units)
    replicated = [u for u in units if strategy_of(u) == "none"]
    sharded = [u for u in units if strategy_of(u) != "none"]
    # ZeRO-3 gathers again for backward what it freed after forward
    again = [
        u for u in sharded if strategy_of(u) == "full" and u.get("reshard_after_forward", True)
    ]
    largest = max(u["padded_numel"] * u["element_size"] for u in units)

    def total(us: list[dict[str, Any]], key: str) -> int:  # bytes, summed exactly (ints)
        return sum(u[key] * u["element_size"] for u in us)

    comm_bytes: dict[str, float] = {}
    unpadded: dict[str, float] = {}
    if sharded:
        comm_bytes["all_gather_into_tensor"] = f * (
            total(sharded, "padded_numel") + total(again, "padded_numel")
        )
        comm_bytes["reduce_scatter_tensor"] = f * total(sharded, "padded_numel")
        unpadded["all_gather_into_tensor"] = f * (total(sharded, "numel") + total(again, "numel"))
        unpadded["reduce_scatter_tensor"] = f * total(sharded, "numel")
    if replicated:
        comm_bytes["all_reduce"] = unpadded["all_reduce"] = 2 * f * total(replicated, "numel")
    offloaded = [u for u in units if u.get("offload")]
    if offloaded:  # each gather first copies the shard from host memory; each gradient back
        shards = total(offloaded, "shard_numel")  # once per step, and again if freed between
        copies = shards + total([u for u in again if u.get("offload")], "shard_numel")
        comm_bytes["host_to_device"] = unpadded["host_to_device"] = float(copies)
        comm_bytes["device_to_host"] = unpadded["device_to_host"] = float(shards)
    peak = 0.0
    for name in dict.fromkeys(strategy_of(u) for u in units):  # each strategy's units together
        numel = sum(u["numel"] for u in units if strategy_of(u) == name)
        peak += model_state_bytes(numel, n, name, precision)
    fully_sharded = [u for u in sharded if strategy_of(u) == "full"]
    if fully_sharded and n > 1:  # the largest ZeRO-3 unit, gathered (one rank gathers nothing)
        peak += max(u["padded_numel"] * u["element_size"] for u in fully_sharded)
    return {
        "psi": psi,
        "psi_padded": psi_padded,
        "bytes_per_element": b,
        "largest_unit_bytes": largest,
        "comm_bytes": comm_bytes,
        "comm_bytes_unpadded": unpadded,
        "peak_model_state_bytes": peak,
    }


def hybrid_step(
    strategy: str,
    units: list[dict[str, Any]],
    mesh: tuple[int, int],
    precision: Precision = FP32_ADAM,
) -> dict[str, Any]:
    """Bytes per rank and training step of HSDP on an (R, S) mesh, per group, and the peak
    model state: `sharding_step` inside a shard group of S ranks (ZeRO-3 for "hybrid", ZeRO-2
    for "hybrid_zero2"), plus what textbook formulas often leave out — the all-reduce of each
    rank's gradient shard across the R replicas, 2(R−1)/R · Ψ_padded·b/S, on the slow link.

    `units` as for `sharding_step`, their "padded_numel" a multiple of S.
    """
    if strategy not in ("hybrid", "hybrid_zero2"):
        raise ValueError(f"strategy={strategy!r}: expected 'hybrid' or 'hybrid_zero2'")
    r, s = mesh
    _check_count("replicas", r)
    _check_count("shard group size", s)
    inner = "full" if strategy == "hybrid" else "grad_op"
    step = sharding_step(inner, units, s, precision)
    b = step["bytes_per_element"]
    shard_bytes = step["psi_padded"] * b / s  # each rank's gradient shard
    across = {"all_reduce": 2 * (r - 1) / r * shard_bytes} if r > 1 else {}
    # S = 1: no shard group to speak of; each unit's whole gradient is all-reduced across.
    inner_bytes = step["comm_bytes"] if s > 1 else {}
    return {
        **step,
        "mesh": [r, s],
        "comm_bytes": {"shard": inner_bytes, "replicate": across},
    }


def sharded_optimizer_step(
    owned_numel_per_rank: list[int],
    trainable_numel: int,
    element_size: int,
    optimizer: str,
    world_size: int,
) -> dict[str, Any]:
    """DDP + a sharded optimizer (ZeRO-1 as an optimizer) per rank and step.

    Optimizer state K·Ψ_r on rank r for the Ψ_r elements it owns (Adam: K = 2b, SGD momentum:
    K = b), against K·Ψ/N for a perfect split: parameters are not cut, so the largest share
    is what a rank must hold. Bytes: DDP's all-reduce 2(N−1)/N·Ψ·b plus one broadcast of every
    trainable parameter, Ψ·b on every rank — where ZeRO-1 as a transformation moves
    2(N−1)/N·Ψ·b in all.
    """
    psi, n, b = sum(owned_numel_per_rank), world_size, element_size
    k = OPTIMIZER_STATES[optimizer] * b
    return {
        "optimizer_state_bytes_per_rank": [k * numel for numel in owned_numel_per_rank],
        "optimizer_state_bytes_even_split": k * psi / n,
        "largest_share_over_even_split": max(owned_numel_per_rank) / (psi / n),
        "comm_bytes": {
            "all_reduce": collective_bytes("all_reduce", psi * b, n),
            "broadcast": collective_bytes("broadcast", trainable_numel * b, n),  # 0 alone
        },
    }


# -- activation checkpointing -----------------------------------------------------------------


def checkpoint_cost(schedule: Any, n: int) -> Any:
    """Predicted (stored layer inputs, layer forward calls) of a `schedules.Schedule` on a
    chain of `n` layers: closed forms; `optimal` from its dynamic programme (no closed form).

        store_all       N stored, N calls
        full_recompute  2 stored, N(N+1)/2 calls (layer i: i no-grad calls, 1 with grad)
        every(C)        C+1 stored; the sweep to the last checkpoint, then each part recomputed
        segments(k)     ⌈N/k⌉ + k − 1 (or −2) stored; N + (⌈N/k⌉ − 1)·k calls
        optimal(b)      at most b stored; the fewest calls for that, in kept inputs (not bytes)
        revolve(s)      s + 1 stored (s snapshots and the state being taped), N taped calls +
                        Griewank–Walther's t(N, s) advances (`revolve_advances`)
    """
    from fsdp_lab.checkpointing import schedules  # torch: the schedules module runs chains

    schedules.check_range(schedule, n)
    name, arg = schedule.name, schedule.arg or 0
    cost = schedules.ScheduleCost
    if name == "store_all":
        return cost(n, n)
    if name == "full_recompute":
        return cost(min(n, 2), n * (n + 1) // 2)
    if name == "every":
        lengths = schedules.every_lengths(n, arg)
        calls = n - lengths[-1] + sum(length * (length + 1) // 2 for length in lengths)
        return cost(arg + 1 if arg < n else n, calls)
    if name == "segments":  # checkpoints freed as their segment is done; one rerun each
        n_seg = -(-n // arg)
        return cost(n_seg + arg - (2 if n % arg else 1), n + (n_seg - 1) * arg)
    if name == "revolve":  # every layer taped once, after its advances
        return cost(min(n, arg + 1), n + revolve_advances(n, arg))
    calls, stored = schedules.optimal_cost(n, arg)
    return cost(stored, calls)


def binomial_reach(snapshots: int, repetitions: int) -> int:
    """Griewank's binomial law: the longest chain reversible with s snapshots (the input's
    included) when no step is advanced more than r times, l = C(s + r, s)."""
    from math import comb

    _check_count("snapshots", snapshots)
    _check_count("repetitions", repetitions, 0)
    return comb(snapshots + repetitions, snapshots)


def revolve_repetitions(steps: int, snapshots: int) -> int:
    """The fewest advances r of the most-advanced step: the least r with C(s + r, s) >= l."""
    _check_count("steps", steps)
    r = 0
    while binomial_reach(snapshots, r) < steps:
        r += 1
    return r


def revolve_advances(steps: int, snapshots: int) -> int:
    """Griewank–Walther's fewest advances (forward steps that tape nothing) to reverse `steps`
    steps with `snapshots` snapshots: t = r·l − C(s + r, s + 1), r = `revolve_repetitions`
    (Griewank 1992; Griewank & Walther 2000, "Algorithm 799: revolve", ACM TOMS 26(1))."""
    from math import comb

    r = revolve_repetitions(steps, snapshots)
    return r * steps - comb(snapshots + r, snapshots + 1)


def checkpoint_all_gathers(units: int, spans_two_units: bool, world_size: int) -> int:
    """All-gathers per ZeRO-3 training step of `units` units with activation checkpointing:
    each unit gathered for forward and again for backward; a checkpoint spanning a pair of
    units reruns the first one's forward after it was freed — one more gather per pair. On one
    rank a shard is the whole parameter and nothing is gathered (FSDP1 switches to NO_SHARD)."""
    if world_size == 1:
        return 0
    return 2 * units + (units // 2 if spans_two_units else 0)


# -- pipeline ------------------------------------------------------------------------------------


def rng_replay_bytes(handoffs: int, generator_state_bytes: int, pipelines: int) -> int:
    """RNG replay sends the generator's state at every change of owner along the init order:
    `handoffs` messages of `generator_state_bytes` per pipeline."""
    return pipelines * handoffs * generator_state_bytes


# -- meta-device init ----------------------------------------------------------------------------


def sync_module_states_bytes(parameter_bytes: int, buffer_bytes: int, world_size: int) -> int:
    """Per-rank bytes of FSDP1's ``sync_module_states``: rank 0 broadcasts every parameter and
    buffer once, and a broadcast counts the tensor on every rank (nothing to send alone)."""
    return int(collective_bytes("broadcast", parameter_bytes + buffer_bytes, world_size))


def materialise_peak_bytes(
    model_bytes: float, largest_unit_bytes: float, world_size: int
) -> dict[str, float]:
    """Per-rank tensor bytes at the peak of building a model and sharding it (buffers and
    padding aside), by how it was built:

        ordinary             Ψ·b + Ψ·b/N   the whole model, and its shards copied out of it
        meta_param_init_fn   Ψ·b/N + unit  the shards, and one unit whole (the largest)
        meta_shard_init      Ψ·b/N         the shards only: each filled slice by slice
    """
    shards = model_bytes / world_size
    return {
        "ordinary": model_bytes + shards,
        "meta_param_init_fn": shards + largest_unit_bytes,
        "meta_shard_init": shards,
    }


# -- the map of parallelisms --------------------------------------------------------------------


def tensor_parallel_step_bytes(layers: int, tokens: int, dim: int, n: int, b: int = 4) -> float:
    """Megatron-style tensor parallelism (Shoeybi et al. 2019), per step, summed over the n
    ranks: each transformer layer all-reduces its (tokens, dim) output twice in forward (after
    attention, after the MLP) and twice in backward — 4·L all-reduces of tokens·dim·b bytes,
    2(n−1)/n of that per rank each. Embedding, head and norms left out."""
    return n * 4 * layers * collective_bytes("all_reduce", tokens * dim * b, n)


def context_parallel_step_bytes(
    layers: int, tokens: int, dim: int, psi: int, n: int, b: int = 4
) -> float:
    """Ring attention (Liu et al. 2023; PyTorch's context_parallel), per step, summed over the
    n ranks: in each layer's forward every rank passes its K and V blocks (tokens/n · dim each)
    around the ring, n−1 hops; backward passes K and V again and dK, dV back — three times the
    forward's 2(n−1)/n·tokens·dim·b per rank and layer. The weights are replicated, so the
    gradients are all-reduced as in DDP. (K, V heads = all heads: no grouped-query saving.)"""
    kv = 2 * (n - 1) / n * tokens * dim * b
    return n * (3 * layers * kv + collective_bytes("all_reduce", psi * b, n))


def pipeline_step_bytes(stages: int, tokens: int, dim: int, b: int = 4) -> float:
    """GPipe, per step, summed over the ranks: each of the S−1 stage boundaries carries every
    micro-batch's activations forward and their gradients back — 2(S−1)·tokens·dim·b, whatever
    the number of micro-batches (`fsdp_lab.pipeline.schedule`)."""
    return 2 * (stages - 1) * tokens * dim * b


def gpt_parameters(vocab: int, dim: int, layers: int, seq_len: int) -> int:
    """Parameters of a GPT-2-style decoder (the labs' TinyGPT and PipeGPT): token and position
    embeddings, and per block attention (4·dim²) and a 4x MLP (8·dim²) with their biases and
    norms; a tied head adds nothing. Used to refuse a model the host cannot hold before any
    rank builds it, so a few-percent difference does not matter."""
    return vocab * dim + seq_len * dim + layers * (12 * dim * dim + 13 * dim) + 2 * dim


def gpt_host_bytes(params: int, copies: int, tokens: int, vocab: int) -> int:
    """At least the host memory `copies` whole builds of a GPT of `params` parameters need when
    they train on `tokens` tokens in all: fp32 weights, gradients and optimizer state, 16 bytes a
    parameter per copy; the logits, their gradient and their softmax, 12 bytes per token and
    vocabulary entry. Activations inside the blocks come on top: a lower bound, to refuse a run
    the host cannot hold before any rank starts it."""
    return 16 * params * copies + 12 * tokens * vocab


# -- a plan at real size (`fsdp_lab.planning`): one rank's memory by category -------------------


def llama_activation_bytes(
    shape: dict[str, int], tokens: int, checkpoint: str = "none", b: int = 2
) -> dict[str, float]:
    """Bytes one rank holds for backward in the lab's Llama (`fsdp_lab.models.Llama`) trained
    by `reference.train_steps`, its `tokens` (micro-batch × sequence) computed in b-byte
    elements, read off its forward:

        per_block  11·D + 4·F + KV elements per token: RMSNorm x·r and its output (twice),
                   rotated q, repeated k and v, attention's output and its (B, T, D) copy, the
                   residual after attention, the block's output; SwiGLU w1·x, silu(w1·x), w3·x
                   and their product (F wide each); k before its repeat (KV = K/V heads ×
                   head_dim) — plus 2 RMSNorm scales (b each) and attention's log-sum-exp
                   (4 bytes per head)
        kept       what the blocks keep to the end of forward: every block's set, or under
                   `checkpoint="blocks"` each block's input only (D); "selective" (every second
                   block recomputed, torchtitan's layer option 2) one of each; under
                   "selective-op" (torchtitan's per-op policy, `planning.selective`) each
                   block's input and what the policy saves: q, v, attention's output and
                   log-sum-exp, w1's and w2's outputs (4·D + KV + F, and 4 bytes per head)
        recompute  one block's set again while it is recomputed (checkpointed blocks)
        ends       the embedding's output (D) and the final norm (2·D); the logits (b·V, kept
                   by the training loop's variable) and their fp32 log-softmax (4·V)
        loss_forward  the loss's forward: the fp32 copy of the logits beside its log-softmax
                   (4·V more than `ends`, for a moment)
        loss_grad  the loss's backward: the gradient of the log-softmax and of its input,
                   2 × 4·V — the step's largest transient at a large vocabulary
        head_grad  later in backward: the logits stay, the log-softmax is gone (b·V + 3·D·b)
        logits     what stays to the end of backward: the logits (b·V)
        head_weight_grad  the output layer's gradient (b·V·D, not per token), held whole from
                   the head's backward until the root unit's gradient is complete
    Shape keys: dim, ffn_dim, n_heads, kv_dim, n_layers, vocab_size.
    """
    d, f, kv, h = shape["dim"], shape["ffn_dim"], shape["kv_dim"], shape["n_heads"]
    v, layers = shape["vocab_size"], shape["n_layers"]
    per_block = tokens * ((11 * d + 4 * f + kv) * b + 2 * b + 4 * h)
    if checkpoint == "none":
        kept, recompute = layers * per_block, 0
    elif checkpoint == "selective-op":  # per block: its input, q and v (the 1st and 3rd
        # matmuls), attention's output and log-sum-exp, w1's and w2's outputs (5th and 7th)
        saved = tokens * ((3 * d + kv + f) * b + 4 * h)
        kept, recompute = layers * (saved + tokens * d * b), per_block - saved
    elif checkpoint in ("blocks", "selective"):
        recomputed = layers if checkpoint == "blocks" else layers // 2  # blocks 1, 3, 5, ...
        kept = (layers - recomputed) * per_block + recomputed * tokens * d * b
        recompute = per_block  # the last block is one of them: recomputed first in backward
    else:
        raise ValueError(
            f"checkpoint={checkpoint!r}: expected 'none', 'selective-op', 'selective' or 'blocks'"
        )
    return {
        "per_block": float(per_block),
        "kept": float(kept),
        "recompute": float(recompute),
        "ends": float(tokens * (3 * d * b + b * v + 4 * v)),
        "loss_grad": float(tokens * 2 * 4 * v),
        "head_grad": float(tokens * (3 * d * b + b * v)),
        "logits": float(tokens * b * v),
        "head_weight_grad": float(b * v * d),
        "loss_forward": float(tokens * 4 * v),
    }


def rank_memory(
    strategy: str,
    units: list[dict[str, Any]],
    shard_ranks: int,
    compute_bytes: int,
    param_tensors: int,
    activations: dict[str, float],
    accumulating: bool = False,
    largest_tensor: int = 0,
) -> dict[str, dict[str, float]]:
    """One rank's bytes by category under `fsdp_lab.shard` with Adam (fp32 shards, gradients
    and moments; units gathered in `compute_bytes` = c per element) at the moments one of
    which is the step's peak — the largest total is (`llama_activation_bytes` for the names;
    R = the root unit's padded numel, B = the largest block's):

        end_of_forward  the loss computed: kept + ends; last step's gradient shards still held
                        (dropped at zero_grad, after forward); under ZeRO-3/HSDP only the root
                        unit gathered (kept for backward; every block freed)
        loss_forward    as end_of_forward, with the loss's fp32 logits beside their log-softmax
        optimizer_step  Adam's step: every gradient, and two fp32 temporaries the size of its
                        largest tensor (`largest_tensor` numel; a flat shard when sharded); the
                        logits still held by the loop
        loss_backward   after zero_grad (every gradient dropped), the loss's backward: kept +
                        ends + loss_grad
        block_backward  the last block's backward begins: every block's set (recomputed: its
                        set rebuilt), the head's remains and the head weight's gradient;
                        gathered the root, the block, the next one prefetched and a shard's copy
        in_backward     the last block's gradient being reduced: its set freed, the head's
                        remains and the head weight's gradient; the block's whole gradient
                        (c·B), its fp32 copy and its new shard; gathered as in block_backward
                        less the block itself (ZeRO-2/3 free a unit before its gradient is
                        built, as FSDP2 frees it before its reduction)
        root_backward   the embedding's gradient arrives: the head's and the embedding's
                        gradients and the root's whole gradient they are summed into (2·c·R)
        root_reduce     the root's whole gradient (c·R) and its fp32 copy, reduced last; under
                        ZeRO-2/3 and HSDP nothing is gathered any more
        end_of_backward ZeRO-1 only: it reduces when backward is over, so every unit's whole
                        gradient is held (c·Ψ_padded), the one being reduced also in fp32

    Model state: parameters 4·Ψ_padded/S (DDP 4Ψ); gradients 4·Ψ_padded/S (DDP 4Ψ);
    optimizer_state 8·Ψ_padded/S (DDP 8Ψ) and a 4-byte step counter per parameter tensor.
    ZeRO-1/2 keep the whole model gathered through backward, DDP a compute copy when it is not
    fp32. `accumulating`: a later micro-batch of gradient accumulation, whose gradient shards
    are held from the one before (none are dropped). `units`: "numel" and "padded_numel" (a
    multiple of S = `shard_ranks`), the root first.
    """
    s, c = shard_ranks, compute_bytes
    padded = sum(u["padded_numel"] for u in units)
    psi = sum(u["numel"] for u in units)
    steps = 4 * param_tensors
    a = activations
    root, blocks = units[0], units[1:] or units[:1]
    largest = max(u["padded_numel"] for u in blocks)
    fp32_copy = 4.0 if c != 4 else 0.0  # a gradient cast to fp32 for its reduction
    max_shard = max(u["padded_numel"] for u in units) / s
    if strategy == "none":
        state = {
            "parameters": 4.0 * psi,
            "gradients": 4.0 * psi,
            "optimizer_state": 8.0 * psi + steps,
        }
        forward_end = backward = float(c * psi if c != 4 else 0)
    else:
        state = {
            "parameters": 4.0 * padded / s,
            "gradients": 4.0 * padded / s,
            "optimizer_state": 8.0 * padded / s + steps,
        }
        if strategy in ("full", "hybrid"):
            forward_end = float(c * root["padded_numel"])
            backward = c * (root["padded_numel"] + 2 * largest + largest / s)
        else:  # optimizer, grad_op, hybrid_zero2: gathered once, kept all step
            forward_end = backward = float(c * padded)
    held = state["gradients"] if accumulating else 0.0  # shards kept from the micro-batch before
    # ZeRO-2/3 and HSDP free each unit, the root too, once its backward has computed every
    # gradient; ZeRO-1 keeps every unit gathered, DDP its compute copy
    frees = strategy not in ("none", "optimizer")
    after_backward = 0.0 if frees else forward_end
    block_set = a["per_block"] if not a["recompute"] else 0.0
    moments = {
        "end_of_forward": {**state, "gathered": forward_end, "activations": a["kept"] + a["ends"]},
        "loss_forward": {
            **state,
            "gathered": forward_end,
            "activations": a["kept"] + a["ends"] + a["loss_forward"],
        },
        "optimizer_step": {
            **state,
            # single-tensor Adam (PyTorch's default off CUDA): two temporaries of one tensor
            "optimizer_state": state["optimizer_state"]
            + 8.0 * (largest_tensor if strategy == "none" else max_shard),
            "gathered": float(after_backward),
            "activations": a["logits"],
        },
        "loss_backward": {
            **state,
            "gradients": held,
            "gathered": forward_end,
            "activations": a["kept"] + a["ends"] + a["loss_grad"],
        },
        "in_backward": {
            **state,
            "gradients": state["gradients"] if strategy == "none" else held,
            "gathered": float(backward - (c * largest if frees else 0)),
            "activations": a["kept"] - block_set + a["recompute"] + a["head_grad"],
        },
    }
    if strategy == "none":  # DDP's gradients are the parameters' own, counted whole
        return moments
    moments["block_backward"] = {  # the last block's backward begins (recomputed: rebuilt)
        **moments["in_backward"],
        "gathered": float(backward),
        "activations": a["kept"] + a["recompute"] + a["head_grad"] + a["head_weight_grad"],
    }
    in_backward = moments["in_backward"]
    in_backward["activations"] += a["head_weight_grad"] + c * largest - a["recompute"]
    if strategy != "optimizer":  # reduced now: cast, and its shard
        in_backward["gradients"] += fp32_copy * largest + 4.0 * largest / s
    root_numel = root["padded_numel"]
    blocks_done = 4.0 * (padded - root_numel) / s + (4.0 * root_numel / s if accumulating else 0)
    moments["root_backward"] = {
        **state,
        # ZeRO-1: the blocks' whole gradients, not reduced until backward is over
        "gradients": held + c * (padded - root_numel) if strategy == "optimizer" else blocks_done,
        "gathered": float(c * root_numel if frees else forward_end),
        "activations": a["logits"] + 2.0 * c * root_numel,
    }
    moments["root_reduce"] = {
        **state,
        "gradients": blocks_done + fp32_copy * root_numel + 4.0 * root_numel / s,
        "gathered": float(after_backward),
        "activations": a["logits"] + c * root_numel,
    }
    if strategy == "optimizer":  # ZeRO-1 reduces once backward is over: every unit's whole
        # gradient (compute dtype) is held then, and the one being reduced also in fp32
        moments["end_of_backward"] = {
            **state,
            "gradients": float(held + c * padded + 4 * largest),
            "gathered": forward_end,
            "activations": a["head_grad"],
        }
    return moments
