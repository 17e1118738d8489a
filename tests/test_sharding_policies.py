"""Per-unit policies (issue 28): a unit's own strategy ("replicate"), precision and offload,
`ignored_params`, DDP's gradient buckets, and the refusal of a collective over slices of unequal
size — each against one process and PyTorch's own (`fully_shard`, DDP) on the same model."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_peer_suite import VOCAB, TinyLM, _batch

from fsdp_lab.sharding.policy import MixedPrecision, UnitPolicy, resolve_policies
from fsdp_lab.sharding.wrap import PlanError, build_plan, without_params

FP32 = MixedPrecision(torch.float32, torch.float32)
BF16 = MixedPrecision(torch.bfloat16, torch.float32)
NORMS = (nn.LayerNorm,)


def _norm_params(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, NORMS) for p in m.parameters()]


# -- resolving policies: every refusal before any message (no ranks needed) ----------------------


def _resolve(policies, strategy="full", **kw):
    from fsdp_lab.choices import strategy_named

    model = TinyLM()
    plan = build_plan(model, {nn.Linear, nn.Embedding})
    return resolve_policies(model, plan, strategy_named(strategy), policies=policies, **kw)


def test_a_policy_by_name_or_class_reaches_exactly_its_units():
    plans = _resolve({"": UnitPolicy(strategy="replicate"), nn.Embedding: UnitPolicy(offload=True)})
    assert plans[""].strategy.name == "replicate" and not plans[""].strategy.sharded
    assert plans["embed"].offload and plans["embed"].strategy.name == "full"
    others = [u for u in plans if u not in ("", "embed")]
    assert others and all(plans[u].strategy.name == "full" and not plans[u].offload for u in others)
    # The defaults: every unit but the root freed after forward, as before policies existed.
    assert not plans[""].reshard_after_forward and plans["blocks.0.fc1"].reshard_after_forward


def test_a_policy_keyed_by_a_module_instance_says_how_to_key_it():
    model = TinyLM()
    plan = build_plan(model, {nn.Linear, nn.Embedding})
    from fsdp_lab.choices import strategy_named

    with pytest.raises(ValueError, match=r"keyed by a module \(Linear\).*Fix: policies\['head'\]"):
        resolve_policies(model, plan, strategy_named("full"), {model.head: UnitPolicy()})


def test_a_name_policy_wins_over_its_class_policy():
    plans = _resolve(
        {nn.Linear: UnitPolicy(mixed_precision=BF16), "head": UnitPolicy(mixed_precision=FP32)}
    )
    assert plans["head"].compute_dtype == torch.float32
    assert plans["blocks.0.fc1"].compute_dtype == torch.bfloat16


@pytest.mark.parametrize(
    "policies, message",
    [
        ({"blocks.9": UnitPolicy()}, "policies['blocks.9'] names no unit: expected one of"),
        ({"heads": UnitPolicy()}, "Fix: policies['head']"),  # a typo: the nearest name
        ({nn.GELU: UnitPolicy()}, "policies[GELU]: no unit's first module is a GELU"),
        ({"": "replicate"}, "policies[''] is a str: expected a UnitPolicy"),
        ({"": UnitPolicy(offload="no")}, "offload='no': expected True, False or None"),
        ({"": UnitPolicy(strategy="hybrid")}, "strategy='hybrid' on a model sharded with 'full'"),
        ({"": UnitPolicy(strategy="none")}, "Fix: strategy='replicate'"),
        (
            {"head": UnitPolicy(strategy="replicate", reshard_after_forward=True)},
            "reshard_after_forward=True under strategy 'replicate'",
        ),
    ],
)
def test_a_policy_that_cannot_be_kept_is_refused_naming_it(policies, message):
    with pytest.raises(ValueError) as err:
        _resolve(policies)
    assert message in str(err.value)


def test_ignored_params_leave_the_plan_and_strangers_are_refused():
    model = TinyLM()
    plan = build_plan(model, {nn.Linear, nn.Embedding})
    kept = without_params(plan, model, _norm_params(model))
    assert kept.params[""] == ()  # the root held only norms
    assert kept.params["head"] == plan.params["head"]
    with pytest.raises(PlanError, match=r"1 parameter\(s\) of another model"):
        without_params(plan, model, [nn.Parameter(torch.zeros(3))])
    with pytest.raises(PlanError, match=r"ignored_params\[0\] is a LayerNorm, not a parameter"):
        without_params(plan, model, [model.norm])
    with pytest.raises(PlanError, match="wrap unit 'head' has only ignored parameters"):
        without_params(plan, model, list(model.head.parameters()))


# -- on ranks -----------------------------------------------------------------------------------


def _train_on_rank(wrap, steps=3, lr=0.5, capture=None, build=TinyLM):
    """`build()` (TinyLM; seed 0) wrapped by `wrap`, SGD, this rank's half of each batch; its parameters
    after `steps` steps, whole (a DTensor read whole, ours through full_state_dict)."""
    from fsdp_lab.sharding import full_state_dict, sharding_state

    torch.manual_seed(0)
    model = wrap(build())
    seen = {}
    if capture:  # the dtype each module computes with, read inside its forward
        for name in capture:
            module = model.get_submodule(name)

            def note(m, args, name=name):
                seen.setdefault(name, m.weight.dtype)  # returns None: the inputs stay as they are

            module.register_forward_pre_hook(note)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    rank, world = dist.get_rank(), dist.get_world_size()
    half = 8 // world
    for step in range(steps):
        tokens = _batch(step)[rank * half : (rank + 1) * half]
        logits = model(tokens[:, :-1]).float()
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    if sharding_state(model, required=False) is not None:
        params = full_state_dict(model, rank0_only=False)
    else:
        params = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()
        }
    return params, seen


def _ours(**kw):
    def wrap(model):
        from fsdp_lab.sharding import shard

        if "ignored" in kw:
            kw2 = {k: v for k, v in kw.items() if k != "ignored"}
            return shard(
                model, units={nn.Linear, nn.Embedding}, ignored_params=_norm_params(model), **kw2
            )
        return shard(model, units={nn.Linear, nn.Embedding}, **kw)

    return wrap


def _fully_shard(mp_units=None, mp_root=None, ignored=False, offload=False):
    def wrap(model):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        def policy(mp):
            return (
                {"mp_policy": MixedPrecisionPolicy(mp.param_dtype, mp.reduce_dtype)} if mp else {}
            )

        extra = {"offload_policy": CPUOffloadPolicy(pin_memory=False)} if offload else {}
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                fully_shard(module, **policy(mp_units), **extra)
        ignored_params = set(_norm_params(model)) if ignored else None
        return fully_shard(model, **policy(mp_root), ignored_params=ignored_params, **extra)

    return wrap


def run_pair(ours_kw, theirs_kw, capture=None):
    return _train_on_rank(_ours(**ours_kw), capture=capture), _train_on_rank(
        _fully_shard(**theirs_kw), capture=capture
    )


def _close(a, b, atol, what):
    assert sorted(a) == sorted(b), what
    for name in a:
        torch.testing.assert_close(
            a[name], b[name], rtol=0, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def test_ignored_params_train_like_fully_shard_and_stay_unreduced(cluster_of):
    """FSDP2's meaning: an ignored parameter is neither sharded nor reduced, so each rank's copy
    follows its own half-batch — the norms differ between ranks (the control) exactly as under
    fully_shard(ignored_params=...)."""
    per_rank = cluster_of(2).run(run_pair, {"ignored": True}, {"ignored": True})
    for (ours, _), (theirs, _) in per_rank:
        _close(ours, theirs, 1e-6, "ours vs fully_shard")
    norms = [n for n in per_rank[0][0][0] if "norm" in n]
    assert norms and all(not torch.equal(per_rank[0][0][0][n], per_rank[1][0][0][n]) for n in norms)


def test_per_unit_mixed_precision_matches_fully_shard(cluster_of):
    """bf16 for every Linear and Embedding, the root (the norms) in fp32: FSDP2's common recipe,
    one `fully_shard` call per unit there, one policy here."""
    capture = ["head", "norm", "blocks.0.norm1"]
    ours_kw = {"mixed_precision": BF16, "policies": {"": UnitPolicy(mixed_precision=FP32)}}
    theirs_kw = {"mp_units": BF16, "mp_root": FP32}
    for (ours, seen), (theirs, seen_theirs) in cluster_of(2).run(
        run_pair, ours_kw, theirs_kw, capture
    ):
        assert (
            seen
            == seen_theirs
            == {
                "head": torch.bfloat16,
                "norm": torch.float32,
                "blocks.0.norm1": torch.float32,
            }
        )
        _close(ours, theirs, 1e-5, "ours vs fully_shard (bf16 compute)")


# FSDP2's MixedPrecisionPolicy field by field, each on the lab's Llama and on PyTorch's own test
# Transformer (`common_dtensor`, LayerNorm): (units, default policy, {class: policy}).
BF16_OUT_FP32 = MixedPrecision(torch.bfloat16, torch.float32, output_dtype=torch.float32)
NO_INPUT_CAST = MixedPrecision(torch.bfloat16, torch.float32, cast_forward_inputs=False)
FP32_OUT_BF16 = MixedPrecision(torch.float32, torch.float32, output_dtype=torch.bfloat16)
PRECISION_CASES = {
    # The recipe in docs/labs.md: every Linear and Embedding in bf16, the root's norms in fp32 — each
    # Linear's fp32 input (a norm's output) is cast to bf16 by cast_forward_inputs.
    "fp32-root": ((nn.Linear, nn.Embedding), BF16, {"": FP32}),
    "output_dtype": ((nn.Linear, nn.Embedding), BF16_OUT_FP32, {"": FP32}),
    # Without the input cast the fp32 norm output meets a bf16 weight: both refuse alike.
    "no-input-cast": ((nn.Linear, nn.Embedding), NO_INPUT_CAST, {"": FP32}),
    # torchtitan's norms kept in fp32 as units of their own, handing bf16 on.
    "fp32-norm-units": ("blocks+norms", BF16, {"norms": FP32_OUT_BF16}),
}


def _library_transformer() -> nn.Module:
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

    args = ModelArgs(
        n_layers=2, vocab_size=VOCAB, max_seq_len=16, dim=32, n_heads=4, weight_tying=False
    )
    return Transformer(args)


def _precision_run(model_name: str, case: str, system: str):
    """`model_name` under one PRECISION_CASES case, wrapped by ours or by fully_shard (one call
    per unit, innermost first); its parameters after 3 SGD steps, or the error it raised."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fsdp_lab.models.llama import Llama, LlamaConfig, RMSNorm
    from fsdp_lab.sharding import shard

    units, default, own = PRECISION_CASES[case]

    def wrap(model):
        norms = tuple({type(m) for m in model.modules() if isinstance(m, (RMSNorm, nn.LayerNorm))})
        policies = {cls: own["norms"] for cls in norms} if "norms" in own else own
        classes = (*{type(b) for b in model.layers}, *norms) if units == "blocks+norms" else units
        if system == "ours":
            own_policy = {k: UnitPolicy(mixed_precision=mp) for k, mp in policies.items()}
            return shard(model, units=set(classes), mixed_precision=default, policies=own_policy)
        for module in reversed(list(model.modules())):
            if isinstance(module, classes):
                mp = policies.get(type(module), default)
                fully_shard(module, mp_policy=MixedPrecisionPolicy(**vars(mp)))
        root = policies.get("", default)
        return fully_shard(model, mp_policy=MixedPrecisionPolicy(**vars(root)))

    build = {"llama": lambda: Llama(LlamaConfig(vocab_size=VOCAB)), "common": _library_transformer}
    try:
        return _train_on_rank(wrap, lr=0.1, build=build[model_name])[0]
    except RuntimeError as exc:
        return type(exc).__name__, str(exc).strip().splitlines()[-1]


def _precision_pair(model_name: str, case: str):
    return _precision_run(model_name, case, "ours"), _precision_run(model_name, case, "fsdp2")


@pytest.mark.parametrize("case", list(PRECISION_CASES))
@pytest.mark.parametrize("model_name", ["llama", "common"])
def test_each_mixed_precision_field_matches_fully_shard(cluster_of, model_name, case):
    """Issue 37: the documented recipe crashed on the lab's Llama (`float != c10::BFloat16`): a
    unit did not cast its inputs. Every field of FSDP2's policy, as fully_shard does it."""
    for ours, theirs in cluster_of(2).run(_precision_pair, model_name, case):
        if isinstance(theirs, tuple):  # fully_shard refuses this recipe: so must we, alike
            assert ours == theirs
        else:
            assert isinstance(ours, dict), ours
            _close(ours, theirs, 1e-5, f"{model_name} {case}: ours vs fully_shard")


def test_cpu_offload_matches_fully_shard_and_counts_the_host_link(cluster_of):
    """Offload keeps shards and gradients in host memory: every gather first copies the shard
    to the compute device, every gradient shard comes back — counted, byte for byte."""
    for (ours, _), (theirs, _) in cluster_of(2).run(run_pair, {"offload": True}, {"offload": True}):
        _close(ours, theirs, 1e-6, "ours vs fully_shard(offload_policy=CPUOffloadPolicy())")
    for step in cluster_of(2).run(_offload_ledger):
        assert step["host_to_device"] == step["gathered_shard_bytes"] > 0
        assert step["device_to_host"] == step["reduced_shard_bytes"] > 0


def _offload_ledger():
    from fsdp_lab import comm
    from fsdp_lab.sharding import shard, sharding_state

    torch.manual_seed(0)
    model = shard(TinyLM(), units={nn.Linear, nn.Embedding}, offload=True)
    tokens = _batch(0)
    with comm.CommLog() as log:
        model(tokens[:, :-1]).sum().backward()
    units = sharding_state(model).units
    gathers = log.calls_by_op()["all_gather_into_tensor"]  # root kept, the others gathered twice
    shard_bytes = {u.label: u.flat.shard_numel * 4 for u in units}
    again = sum(shard_bytes[u.label] for u in units if u.reshard_after_forward)
    return {
        **log.bytes_by_op(),
        "gathers": gathers,
        "gathered_shard_bytes": sum(shard_bytes.values()) + again,
        "reduced_shard_bytes": sum(shard_bytes.values()),
    }


def test_a_replicated_root_inside_zero3_is_all_reduced_and_its_bytes_follow_theory(cluster_of):
    for n in (2, 3):
        for measured, units in cluster_of(n).run(_replicated_root_ledger):
            from fsdp_lab import theory

            assert units[0]["strategy"] == "replicate" and "strategy" not in units[1]
            assert measured == theory.sharding_step("full", units, n)["comm_bytes"]
            assert set(measured) == {
                "all_gather_into_tensor",
                "reduce_scatter_tensor",
                "all_reduce",
            }


def _replicated_root_ledger():
    from fsdp_lab import comm
    from fsdp_lab.sharding import shard, sharding_state
    from fsdp_lab.sharding.lab.measure import unit_layout

    torch.manual_seed(0)
    model = shard(
        TinyLM(), units={nn.Linear, nn.Embedding}, policies={"": UnitPolicy(strategy="replicate")}
    )
    tokens = _batch(0)
    model(tokens[:, :-1]).sum().backward()  # the first step records the order; measure the next
    with comm.CommLog() as log:
        model(tokens[:, :-1]).sum().backward()
    return log.bytes_by_op(), [unit_layout(u) for u in sharding_state(model).units]


# -- DDP's buckets --------------------------------------------------------------------------------


def _ddp_pair(bucket_cap_mb):
    from fsdp_lab.sharding import shard

    ours = _train_on_rank(lambda m: shard(m, strategy="none", bucket_cap_mb=bucket_cap_mb))[0]
    theirs = _train_on_rank(
        lambda m: nn.parallel.DistributedDataParallel(m, bucket_cap_mb=bucket_cap_mb)
    )[0]
    return ours, {n.removeprefix("module."): v for n, v in theirs.items()}


@pytest.mark.parametrize("cap", [25.0, 0.01], ids=["one-bucket", "many-buckets"])
def test_bucketed_none_is_bit_equal_to_ddp(cluster_of, cap):
    for ours, ddp in cluster_of(2).run(_ddp_pair, cap):
        for name in ddp:
            assert torch.equal(ours[name], ddp[name]), name


def test_bucketed_none_matches_ddp_on_three_ranks(cluster_of):
    for ours, ddp in cluster_of(3).run(_ddp_pair, 0.01):
        _close(ours, ddp, 1e-6, "ours vs DDP, 3 ranks")


def _accumulated_pair():
    """Two backwards before one step, no zero_grad between: ours:none and DDP (whose buckets,
    like ours, are kept from step to step: a stale slot must not leak into a gradient)."""
    from fsdp_lab import reference

    out = []
    for system in ("ours:none", "ddp"):
        torch.manual_seed(0)
        model = reference.wrap(TinyLM(), system)
        rank = dist.get_rank()
        for step in range(2):
            for micro in range(2):
                tokens = _batch(2 * step + micro)[rank * 4 : (rank + 1) * 4]
                model(tokens[:, :-1]).float().pow(2).mean().backward()
            grads = {n.removeprefix("module."): p.grad.clone() for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
        out.append(grads)
    return out


def test_gradients_accumulated_over_two_backwards_equal_ddps(cluster_of):
    for ours, ddp in cluster_of(2).run(_accumulated_pair):
        assert sorted(ours) == sorted(ddp)
        for name in ddp:
            assert torch.equal(ours[name], ddp[name]), name


def _bucket_timeline():
    from fsdp_lab.sharding import shard
    from fsdp_lab.trace import Timeline

    torch.manual_seed(0)
    model = shard(TinyLM(), strategy="none", bucket_cap_mb=0.01)
    tokens = _batch(0)
    model(tokens[:, :-1]).sum().backward()
    with Timeline() as timeline:
        model(tokens[:, :-1]).sum().backward()
    spans = timeline.to_dict()["spans"]
    backward = [s for s in spans if s["kind"] == "compute" and s["name"].startswith("backward")]
    reduces = [s for s in spans if s["kind"] == "comm" and s["name"] == "all_reduce"]
    return backward, reduces, [p.grad is not None for p in model.parameters()]


def test_buckets_are_sent_while_backward_runs(cluster_of):
    """The overlap DDP is for: several all-reduces, the first issued before backward ends."""
    for backward, reduces, has_grad in cluster_of(2).run(_bucket_timeline):
        assert len(backward) == 1 and len(reduces) > 3
        assert min(r["start"] for r in reduces) < backward[0]["end"]
        assert all(has_grad)


def _unused_branch():
    from fsdp_lab.sharding import shard

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(4, 2)

        def forward(self, x):
            return self.used(self.body(x))

    torch.manual_seed(0)
    model = shard(TwoHeads(), strategy="none", bucket_cap_mb=0.0001)
    model(torch.randn(3, 4)).sum().backward()
    return {n: p.grad is not None for n, p in model.named_parameters()}


def test_a_parameter_backward_never_reaches_keeps_no_gradient(cluster_of):
    for got in cluster_of(2).run(_unused_branch):
        assert got == {
            "body.weight": True,
            "body.bias": True,
            "used.weight": True,
            "used.bias": True,
            "unused.weight": False,
            "unused.bias": False,
        }


# -- the hang that became an error ------------------------------------------------------------------


def _all_reduce_a_norm_slice():
    from fsdp_lab import comm
    from fsdp_lab.sharding import shard

    torch.manual_seed(0)
    model = shard(TinyLM(), units={nn.Linear, nn.Embedding}, strategy="full")
    model(_batch(0)[:, :-1]).sum().backward()
    lengths = [p.numel() for p in model.parameters()]
    weight = model.blocks[0].norm1.weight
    messages = []
    for tensor in (weight.grad, weight.data, weight.detach()):  # what a learner reaches for
        try:
            comm.all_reduce(tensor)
        except ValueError as exc:
            messages.append(str(exc))
    # All three refused (an empty slice's .data may be named after another empty slice at the
    # same place of the shard: refused all the same); the gradient by its own name.
    return (messages[0] if len(messages) == 3 else messages), lengths


def test_a_collective_over_uneven_slices_fails_at_once_naming_the_parameter(cluster_of):
    """Issue 28, point 2: the peer's comparison of gradients hung forever on gloo."""
    cluster = cluster_of(2)
    (msg0, _), (msg1, _) = cluster.run(_all_reduce_a_norm_slice)
    assert msg0 == msg1 and msg0 is not None
    assert "'blocks.0.norm1.weight'" in msg0
    assert "policies={'': UnitPolicy(strategy='replicate')}" in msg0  # its unit: the root
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in msg0
    assert cluster.run(dist.get_rank) == [0, 1]  # and the cluster is still usable


# -- sync_module_states on a model with values --------------------------------------------------------


def _sync_from_rank0():
    from fsdp_lab.sharding import full_state_dict, shard

    torch.manual_seed(dist.get_rank())  # every rank initialises differently
    model = TinyLM()
    rank0 = [p.detach().clone() for p in model.parameters()]
    dist.broadcast_object_list(holder := [rank0], src=0)
    shard(model, units={nn.Linear, nn.Embedding}, strategy="full", sync_module_states=True)
    got = full_state_dict(model, rank0_only=False)
    expected = dict(zip([n for n, _ in TinyLM().named_parameters()], holder[0], strict=True))
    return all(torch.equal(got[n], expected[n]) for n in expected)


def test_sync_module_states_gives_every_rank_rank0s_values(cluster_of):
    """A bug found on the way: each rank's shard was overwritten by rank 0's *shard*, not cut
    from rank 0's parameters."""
    assert cluster_of(2).run(_sync_from_rank0) == [True, True]


@pytest.mark.parametrize("cap", [-1, float("nan"), "25", True])
def test_a_bad_bucket_size_is_refused_before_any_message(cap):
    from fsdp_lab.sharding import shard

    with pytest.raises(ValueError, match=r"bucket_cap_mb=.*expected a number of MiB >= 0"):
        shard(TinyLM(), strategy="none", bucket_cap_mb=cap)


RAW_GATHER = """
import sys, torch, torch.nn as nn, torch.distributed as dist
sys.path.insert(0, {tests!r})
from fsdp_lab import Cluster

def raw_gather():
    from fsdp_lab.sharding import shard
    from test_peer_suite import TinyLM, _batch
    torch.manual_seed(0)
    model = shard(TinyLM(), units={{nn.Linear, nn.Embedding}}, strategy="full")
    model(_batch(0)[:, :-1]).sum().backward()
    grad = model.blocks[0].norm1.weight.grad
    out = [torch.empty_like(grad) for _ in range(2)]
    try:
        dist.all_gather(out, grad)  # the peer suite's own check, raw
    except RuntimeError as exc:
        return str(exc)
    return "no error"

with Cluster(2, backend="gloo", timeout=60, verbose=False) as cluster:
    print(cluster.run(raw_gather))
"""


def test_raw_collectives_over_uneven_slices_fail_at_once_under_the_documented_setting(tmp_path):
    """What docs/labs.md tells a learner whose own torch.distributed call would hang: with
    TORCH_DISTRIBUTED_DEBUG=DETAIL in the environment the ranks inherit, it fails at once."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "raw.py"
    script.write_text(RAW_GATHER.format(tests=str(Path(__file__).parent)))
    env = {**os.environ, "TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    proc = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("Detected mismatch between collectives on ranks") == 2, proc.stdout
    assert "TensorShape=[0]" in proc.stdout and "TensorShape=[32]" in proc.stdout


def _hybrid_with_replicated_root():
    from fsdp_lab.sharding import shard

    return _train_on_rank(
        lambda m: shard(
            m,
            units={nn.Linear, nn.Embedding},
            strategy="hybrid",
            mesh=(2, 2),
            policies={"": UnitPolicy(strategy="replicate")},
        )
    )[0]


def _one_process():
    """The same training in one process, the global batch whole (what every rank should end at)."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for step in range(3):
        tokens = _batch(step)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_a_replicated_unit_on_a_hybrid_mesh_averages_over_every_rank(cluster_of):
    """On a (2, 2) mesh a replicated unit's gradient is all-reduced in its shard group, then
    across the replicas: the average over all four ranks, as one process computes it."""
    single = _one_process()
    for got in cluster_of(4).run(_hybrid_with_replicated_root):
        _close(got, single, 1e-6, "hybrid + replicated root vs one process")


def _hybrid_with_a_bf16_replicated_root():
    from fsdp_lab.sharding import shard

    root = UnitPolicy(strategy="replicate")  # cast to bf16 like the rest: not DDP's buffer
    return _train_on_rank(
        lambda m: shard(
            m,
            units={nn.Linear, nn.Embedding},
            strategy="hybrid",
            mesh=(2, 2),
            mixed_precision=BF16,
            policies={"": root},
        )
    )[0]


def test_a_cast_replicated_unit_on_a_hybrid_mesh_stays_the_same_on_every_rank(cluster_of):
    """Its bf16-computed gradient is reduced in fp32 over both mesh dimensions: the four ranks'
    norms stay identical (reduced over the shard group only, the two replicas would drift)."""
    per_rank = cluster_of(4).run(_hybrid_with_a_bf16_replicated_root)
    norms = [n for n in per_rank[0] if "norm" in n]
    for got in per_rank[1:]:
        assert all(torch.equal(got[n], per_rank[0][n]) for n in norms)


def _clipped_norm():
    from fsdp_lab.sharding import clip_grad_norm_, shard

    torch.manual_seed(0)
    policies = {"": UnitPolicy(strategy="replicate")}
    model = shard(TinyLM(), units={nn.Linear, nn.Embedding}, strategy="full", policies=policies)
    rank, world = dist.get_rank(), dist.get_world_size()
    tokens = _batch(0)[rank * 8 // world : (rank + 1) * 8 // world]
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    return clip_grad_norm_(model, max_norm=1e9).item()


def test_clip_grad_norm_counts_a_replicated_unit_once(cluster_of):
    """Each rank holds the replicated root's whole gradient: summed over ranks like a slice, the
    norms would count it twice."""
    torch.manual_seed(0)
    model = TinyLM()
    tokens = _batch(0)
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
    single = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1e9).item()
    root = sum(p.grad.pow(2).sum().item() for m in model.modules() if isinstance(m, NORMS)
               for p in m.parameters())  # fmt: skip
    assert root > 1e-3 * single**2  # counted twice, it would move the norm by > 5e-4 (rel)
    for got in cluster_of(2).run(_clipped_norm):
        assert got == pytest.approx(single, rel=1e-5)


# -- plans that differ between ranks (issue 35, point 11) ----------------------------------------


def _policies_differ_by_rank():
    from fsdp_lab.sharding import shard

    torch.manual_seed(0)
    model = TinyLM()
    mine = {"": UnitPolicy(strategy="replicate")} if dist.get_rank() == 1 else None
    try:
        shard(model, units={nn.Linear, nn.Embedding}, strategy="full", policies=mine)
    except ValueError as exc:
        return str(exc)
    return None


def test_a_plan_that_differs_between_ranks_is_refused_on_every_rank_naming_it(cluster_of):
    """Rank 1 replicated its root where rank 0 sharded it: the ranks then sent different
    messages and gloo aborted the process ("a crash in native code"). Every rank compares a
    digest of its plan with the others' before the first collective and refuses, naming the
    first difference."""
    cluster = cluster_of(2)
    msg0, msg1 = cluster.run(_policies_differ_by_rank)
    assert msg0 is not None and msg0 == msg1
    assert "rank 0" in msg0 and "rank 1" in msg0 and "unit ''" in msg0
    assert "strategy=full" in msg0 and "strategy=replicate" in msg0
    assert cluster.run(dist.get_rank) == [0, 1]  # no rank died: the cluster is still usable


def _bf16_model_fp32_reduction(strategy: str, policies):
    from fsdp_lab import comm
    from fsdp_lab.sharding import shard

    torch.manual_seed(0)
    model = shard(
        TinyLM().to(torch.bfloat16),
        units={nn.Linear, nn.Embedding} if strategy == "full" else None,
        strategy=strategy,
        mixed_precision=MixedPrecision(reduce_dtype=torch.float32),
        policies=policies,
    )
    tokens = _batch(0)[dist.get_rank() * 4 : (dist.get_rank() + 1) * 4]
    model(tokens[:, :-1]).float().sum().backward()  # records the order
    with comm.CommLog() as log:
        model(tokens[:, :-1]).float().sum().backward()
    norms = sum(p.numel() for m in model.modules() if isinstance(m, NORMS) for p in m.parameters())
    total = sum(p.numel() for p in model.parameters())
    dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    return log.bytes_by_op().get("all_reduce", 0), norms, total, dtypes


@pytest.mark.parametrize("strategy", ["none", "full"])
def test_a_replicated_unit_reduces_in_reduce_dtype(cluster_of, strategy):
    """A bf16 model with reduce_dtype=fp32: FSDP2 reduces every gradient in fp32. A replicated
    unit (DDP's buckets, or a replicated root) reduced in bf16, since its parameters needed
    no cast to compute: 2 bytes an element where 4 were asked for."""
    policies = {"": UnitPolicy(strategy="replicate")} if strategy == "full" else None
    for sent, norms, total, dtypes in cluster_of(2).run(
        _bf16_model_fp32_reduction, strategy, policies
    ):
        replicated = total if strategy == "none" else norms
        assert sent == replicated * 4  # 2(N-1)/N = 1 at N = 2; fp32
        assert dtypes == {torch.bfloat16}  # handed back in the parameters' dtype


class _AsksItsDtype(nn.Module):
    """Casts its input to its own parameters' dtype, as Hugging Face's `self.dtype` does."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.seen: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = next(self.parameters())
        self.seen.append((tuple(weight.shape), weight.dtype))
        return self.proj(x.to(weight.dtype))


def _parameters_inside_forward(system: str):
    from fsdp_lab import reference

    torch.manual_seed(0)
    model = nn.Sequential(_AsksItsDtype(), _AsksItsDtype())
    bf16 = MixedPrecision(torch.bfloat16, torch.float32)
    if system == "ours:full":
        wrapped = reference.wrap(model, system, (_AsksItsDtype,), mixed_precision=bf16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        policy = MixedPrecisionPolicy(torch.bfloat16, torch.float32)
        wrapped = reference.wrap(model, system, (_AsksItsDtype,), mp_policy=policy)
    wrapped(torch.randn(2, 8)).float().sum().backward()
    return [m.seen for m in model]


def test_a_modules_parameters_inside_its_forward_are_the_gathered_ones(cluster_of):
    """Under fully_shard, `module.parameters()` inside a unit's forward yields the gathered
    parameters, in the compute dtype; ours yielded this rank's fp32 slice, so a model that
    casts to its own dtype fed fp32 into a bf16 matmul (found by the review)."""
    ours = cluster_of(2).run(_parameters_inside_forward, "ours:full")
    theirs = cluster_of(2).run(_parameters_inside_forward, "fully_shard")
    assert ours == theirs
    assert ours[0][0] == [((8, 8), torch.bfloat16)]


def test_mixed_precision_has_fsdp2s_fields_and_defaults():
    from dataclasses import asdict

    from torch.distributed.fsdp import MixedPrecisionPolicy

    assert asdict(MixedPrecision()) == vars(MixedPrecisionPolicy())
