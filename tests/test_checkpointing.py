"""Activation checkpointing from scratch: bitwise the gradients of store-all and of PyTorch's
own checkpoint, twice the layer calls, a fraction of the activation memory."""

import copy
import functools

import pytest
import torch
import torch.nn as nn
import torch.utils.checkpoint as torch_ckpt

from fsdp_lab.checkpointing.recompute import (
    CheckpointWrapper,
    ForwardCounter,
    checkpoint,
    checkpoint_modules,
    run_segments,
)
from fsdp_lab.models import Chain, ChainLayer
from fsdp_lab.trace.memory import MemoryTracker, category

N_LAYERS, DIM, BATCH = 8, 32, 256
torch_checkpoint = functools.partial(torch_ckpt.checkpoint, use_reentrant=False)


def dropout_chain(device: str = "cpu") -> Chain:
    torch.manual_seed(0)
    return Chain(N_LAYERS, DIM, dropout=0.2).to(device).train()


def train_step(model: Chain, x: torch.Tensor, segment_size: int | None, checkpoint_fn=checkpoint):
    """One forward + backward from the same RNG state: (loss, grads, RNG state afterwards)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    loss = run_segments(model.layers, x, segment_size, checkpoint_fn).square().mean()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    return loss.detach(), grads, torch.get_rng_state()


def all_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b, strict=True))


def test_dropout_chain_gradients_are_bitwise_those_of_store_all_and_of_torch():
    model, x = dropout_chain(), torch.randn(BATCH, DIM)
    loss, grads, rng_after = train_step(model, x, None)
    ours = train_step(model, x, 2)
    theirs = train_step(model, x, 2, torch_checkpoint)
    for other_loss, other_grads, other_rng_after in (ours, theirs):
        assert torch.equal(other_loss, loss)
        assert all_equal(other_grads, grads)  # same dropout masks in the recompute
        assert torch.equal(other_rng_after, rng_after)  # the generator advanced the same
    assert len(grads) == 2 * N_LAYERS and all(g.abs().sum() > 0 for g in grads)


def test_without_rng_restore_dropout_masks_differ_and_so_do_the_gradients():
    model, x = dropout_chain(), torch.randn(BATCH, DIM)
    loss, grads, rng_after = train_step(model, x, None)
    careless = functools.partial(checkpoint, preserve_rng_state=False)
    wrong_loss, wrong_grads, wrong_rng_after = train_step(model, x, 2, careless)
    assert torch.equal(wrong_loss, loss)  # the forward itself is untouched...
    assert not all_equal(wrong_grads, grads)  # ...but backward used other masks
    assert not any(torch.allclose(g, w) for g, w in zip(grads, wrong_grads, strict=True))
    assert not torch.equal(wrong_rng_after, rng_after)  # and the recompute drew extra numbers
    # The control's control: without dropout there is nothing random to restore.
    model = Chain(N_LAYERS, DIM, dropout=0.0)
    assert all_equal(train_step(model, x, 2, careless)[1], train_step(model, x, None)[1])


def test_layer_forward_calls_are_n_for_store_all_and_2n_for_checkpointed_segments():
    model, x = dropout_chain(), torch.randn(BATCH, DIM)
    counts = {}
    for name, segment_size, fn in [
        ("store_all", None, checkpoint),
        ("ours", 2, checkpoint),
        ("torch", 2, torch_checkpoint),
        ("ours_one_segment", N_LAYERS, checkpoint),
    ]:
        with ForwardCounter(model.layers) as calls:
            train_step(model, x, segment_size, fn)
        counts[name] = calls.per_module
    assert counts["store_all"] == [1] * N_LAYERS
    assert counts["ours"] == counts["torch"] == [2] * N_LAYERS
    assert counts["ours_one_segment"] == [2] * N_LAYERS  # one recompute, whatever the segment
    with ForwardCounter(model.layers) as calls, torch.no_grad():
        run_segments(model.layers, x, 2)
    assert calls.total == N_LAYERS  # nothing to recompute without a backward
    assert calls._handles == [] and model.layers[0]._forward_pre_hooks == {}  # hooks removed


def peak_activation_bytes(segment_size: int | None, checkpoint_fn=checkpoint) -> tuple[int, int]:
    """(peak activation bytes in the forward, peak total bytes over forward + backward)."""
    model = dropout_chain()
    torch.manual_seed(5)
    with MemoryTracker() as mem:
        with category("activations"):
            x = torch.randn(BATCH, DIM)
            loss = run_segments(model.layers, x, segment_size, checkpoint_fn).square().mean()
        forward_peak = max(mem.trace()["bytes"]["activations"])
        loss.backward()
        del loss, x
        mem.mark("backward")
        step_peak = mem.peak_bytes
    return forward_peak, step_peak


def test_checkpointed_segments_hold_a_fraction_of_the_activations_like_torch():
    store_all, store_all_step = peak_activation_bytes(None)
    ours, ours_step = peak_activation_bytes(2)
    theirs, theirs_step = peak_activation_bytes(2, torch_checkpoint)
    # Store-all keeps per layer its input, the GELU input (4 B each) and the dropout mask (1 B).
    layer_saved = (4 + 4 + 1) * BATCH * DIM
    assert store_all >= N_LAYERS * layer_saved
    assert ours < 0.6 * store_all and ours_step < 0.6 * store_all_step
    assert ours == pytest.approx(theirs, rel=0.05)
    assert ours_step == pytest.approx(theirs_step, rel=0.05)  # needs the recompute's early stop


def test_several_inputs_kwargs_and_non_tensor_arguments():
    torch.manual_seed(0)
    layer = nn.Linear(DIM, DIM)
    drop = nn.Dropout(0.3)

    def block(a, b, frozen, n_repeats, bias=None, *, act="tanh", module=layer, use_drop=True):
        y = a * b + frozen
        for _ in range(n_repeats):
            y = module(torch.tanh(y) if act == "tanh" else torch.relu(y))
        if use_drop:
            y = drop(y)
        y = y if bias is None else y + bias
        return y.sum(dim=1), frozen * 2  # the second output requires no grad

    def run(fn):
        torch.manual_seed(0)
        a, b = torch.randn(8, DIM, requires_grad=True), torch.randn(8, DIM, requires_grad=True)
        frozen, bias = torch.randn(8, DIM), torch.randn(DIM, requires_grad=True)
        layer.zero_grad(set_to_none=True)
        y, doubled = fn(block, a, b, frozen, 2, bias, act="relu", use_drop=True)
        assert not doubled.requires_grad and torch.equal(doubled, frozen * 2)
        y.pow(2).sum().backward()
        assert frozen.grad is None
        return [a.grad, b.grad, bias.grad, layer.weight.grad, layer.bias.grad]

    reference = run(lambda fn, *args, **kwargs: fn(*args, **kwargs))
    assert all_equal(run(checkpoint), reference)
    assert all_equal(run(torch_checkpoint), reference)


@pytest.mark.parametrize(
    "bad, named", [({"y": 1}, "dict"), ([1], "list"), (None, "NoneType"), (3, "int")]
)
def test_outputs_other_than_tensors_are_rejected_with_the_type(bad, named):
    x = torch.randn(4, requires_grad=True)

    def returns_bad(t):
        y = t * 2
        return {"y": y} if isinstance(bad, dict) else [y] if isinstance(bad, list) else bad

    with pytest.raises(TypeError, match=f"returned a {named}.*Tensor or a tuple of Tensors"):
        checkpoint(returns_bad, x)
    with pytest.raises(TypeError, match="returned a tuple holding str"):
        checkpoint(lambda t: (t * 2, "label"), x)


def test_under_no_grad_it_just_runs_and_saves_nothing():
    model, x = dropout_chain().eval(), torch.randn(BATCH, DIM)
    expected = model(x)
    with MemoryTracker() as mem, torch.no_grad(), ForwardCounter(model.layers) as calls:
        with category("activations"):
            out = run_segments(model.layers, x, 2)
        mem.mark("forward")
        held = mem.trace()["bytes"]["activations"][-1]
    assert torch.equal(out, expected) and out.grad_fn is None and not out.requires_grad
    assert calls.total == N_LAYERS
    assert held == out.nbytes  # no segment inputs, no RNG states: only the output itself


def test_autocast_is_restored_for_the_recompute():
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM))
    x = torch.randn(16, DIM)

    def grads(fn):
        layers.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fn(layers, x)
        assert y.dtype == torch.bfloat16
        y.float().square().sum().backward()  # outside autocast, as recommended
        return [p.grad for p in layers.parameters()]

    assert all_equal(grads(checkpoint), grads(lambda f, t: f(t)))


def test_a_recompute_that_computes_something_else_is_an_error():
    x = torch.randn(4, requires_grad=True)
    calls = []

    def changes_its_mind(t):
        calls.append(1)
        return t.exp() if len(calls) == 1 else t * 2  # exp saves one tensor, t * 2 none

    with pytest.raises(RuntimeError, match="recompute of .*saved 0 tensors, the forward 1"):
        checkpoint(changes_its_mind, x).sum().backward()


def test_retain_graph_and_autograd_grad_recompute_every_time():
    model, x = dropout_chain(), torch.randn(BATCH, DIM)
    _, grads, _ = train_step(model, x, None)
    torch.manual_seed(1234)
    loss = run_segments(model.layers, x, 2).square().mean()
    params = list(model.parameters())
    first = torch.autograd.grad(loss, params, retain_graph=True)  # reentrant cannot do this
    second = torch.autograd.grad(loss, params)
    assert all_equal(list(first), grads) and all_equal(list(second), grads)


def test_checkpoint_modules_wraps_in_place_and_keeps_parameters_and_gradients():
    plain, x = dropout_chain(), torch.randn(BATCH, DIM)
    wrapped = copy.deepcopy(plain)
    names = checkpoint_modules(wrapped, lambda name, m: isinstance(m, ChainLayer))
    assert names == [f"layers.{i}" for i in range(N_LAYERS)]
    assert all(isinstance(layer, CheckpointWrapper) for layer in wrapped.layers)
    assert checkpoint_modules(wrapped, lambda name, m: isinstance(m, ChainLayer)) == []
    plain_params, wrapped_params = dict(plain.named_parameters()), dict(wrapped.named_parameters())
    assert list(wrapped_params) == [n.replace(".fc", ".module.fc") for n in plain_params]
    assert all_equal(list(wrapped_params.values()), list(plain_params.values()))

    def step(model):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(99)
        model(x).square().mean().backward()
        return [p.grad for p in model.parameters()]

    with ForwardCounter(wrapped.layers) as calls:  # counted through the wrapped ChainLayers
        wrapped_grads = step(wrapped)
    assert calls.per_module == [2] * N_LAYERS
    assert all_equal(wrapped_grads, step(plain))


def test_checkpoint_modules_by_name_wraps_only_the_chosen_ones():
    model = dropout_chain()
    names = checkpoint_modules(model, lambda name, m: name in {"layers.1", "layers.6"})
    assert names == ["layers.1", "layers.6"]
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds.count("CheckpointWrapper") == 2 and kinds[1] == kinds[6] == "CheckpointWrapper"
    with pytest.raises(ValueError, match="segment_size=0"):
        run_segments(model.layers, torch.randn(2, DIM), 0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dropout_masks_are_replayed_from_the_cuda_generator():
    model, x = dropout_chain("cuda"), torch.randn(BATCH, DIM, device="cuda")

    def step(segment_size):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)  # seeds the CUDA generators too
        run_segments(model.layers, x, segment_size).square().mean().backward()
        return [p.grad.clone() for p in model.parameters()], torch.cuda.get_rng_state()

    grads, rng_after = step(None)
    ours, ours_rng_after = step(2)
    assert all_equal(ours, grads) and torch.equal(ours_rng_after, rng_after)
