"""Teaching models: shapes, the tied embedding/head, causality, seeded construction, batches."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.models import (
    GPTConfig,
    Llama,
    LlamaConfig,
    MLPStack,
    TinyGPT,
    llama,
    llama_70b_config,
    llama_config_of_bytes,
    llama_param_count,
    synthetic_batch,
    tiny_gpt,
)


def lm_loss(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)  # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


# -- TinyGPT -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(2, 16), (3, 5), (1, 1)])
def test_tiny_gpt_maps_ids_to_logits(batch, seq):
    model = tiny_gpt(vocab_size=40, seq_len=16)
    ids = torch.randint(0, 40, (batch, seq), dtype=torch.int64)
    logits = model(ids)
    assert logits.shape == (batch, seq, 40)
    assert logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_head_is_the_token_embedding_parameter():
    model = tiny_gpt()
    assert model.head.weight is model.tok_emb.weight
    assert isinstance(model.head.weight, nn.Parameter)
    # One Parameter, listed once: the optimizer must not see it twice.
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1


def test_tie_survives_backward_and_an_optimizer_step():
    model = tiny_gpt()
    before = model.tok_emb.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    inputs, targets = synthetic_batch(model.vocab_size, 2, 8, step=0)
    lm_loss(model, inputs, targets).backward()
    opt.step()
    assert model.head.weight is model.tok_emb.weight
    assert not torch.equal(model.tok_emb.weight, before)  # the step did move it


def test_tied_gradient_is_the_sum_of_embedding_and_head_gradients():
    tied = tiny_gpt()
    untied = copy.deepcopy(tied)
    untied.tok_emb.weight = nn.Parameter(tied.tok_emb.weight.detach().clone())
    untied.head.weight = nn.Parameter(tied.tok_emb.weight.detach().clone())
    assert untied.head.weight is not untied.tok_emb.weight

    inputs, targets = synthetic_batch(tied.vocab_size, 4, 12, step=3)
    loss_tied = lm_loss(tied, inputs, targets)
    loss_untied = lm_loss(untied, inputs, targets)
    torch.testing.assert_close(loss_tied, loss_untied)  # same function before any step
    loss_tied.backward()
    loss_untied.backward()

    g_tied = tied.tok_emb.weight.grad
    g_emb, g_head = untied.tok_emb.weight.grad, untied.head.weight.grad
    # Both paths contribute, so the check below could not pass with one of them alone.
    assert g_emb.abs().sum() > 0 and g_head.abs().sum() > 0
    assert not torch.allclose(g_tied, g_head) and not torch.allclose(g_tied, g_emb)
    torch.testing.assert_close(g_tied, g_emb + g_head)


def test_causal_changing_a_later_token_leaves_earlier_logits_unchanged():
    model = tiny_gpt()
    T = 10
    ids = torch.randint(0, model.vocab_size, (2, T))
    with torch.no_grad():
        base = model(ids)
        for t in range(T - 1):
            changed = ids.clone()
            changed[:, t + 1] = (changed[:, t + 1] + 1) % model.vocab_size
            out = model(changed)
            torch.testing.assert_close(out[:, : t + 1], base[:, : t + 1], rtol=0, atol=1e-6)
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])  # the change does matter


def test_tiny_gpt_is_deterministic():
    a, b = tiny_gpt().state_dict(), tiny_gpt().state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    # Not trivially equal: the weights are random, not constant.
    assert a["blocks.0.attn.qkv.weight"].std() > 0


def test_tiny_gpt_does_not_depend_on_the_global_rng_state():
    first = tiny_gpt().tok_emb.weight.detach().clone()
    torch.manual_seed(12345)
    torch.rand(100)
    assert torch.equal(tiny_gpt().tok_emb.weight, first)


def test_tiny_gpt_overrides_reach_the_config():
    model = tiny_gpt(vocab_size=20, seq_len=8, dim=16, n_layers=2, n_heads=2)
    assert isinstance(model, TinyGPT)
    assert model.config == GPTConfig(20, 8, 16, 2, 2)
    assert len(model.blocks) == 2
    assert model.tok_emb.weight.shape == (20, 16)
    assert model.pos_emb.weight.shape == (8, 16)


def test_init_weights_gpt2_style():
    model = tiny_gpt()
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif p.dim() == 1:
            assert torch.all(p == 1), name
    # Residual projections start smaller than the other matrices.
    assert model.blocks[0].mlp.proj.weight.std() < model.blocks[0].mlp.fc.weight.std()


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dim": 30, "n_heads": 4}, "n_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab_size": -1}, "vocab_size"),
        ({"dim": True}, "dim"),
        ({"n_heads": True, "dim": 32}, "n_heads"),
        ({"seq_len": 16.0}, "seq_len"),
    ],
)
def test_gpt_config_rejects_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        GPTConfig(**kwargs)


def test_gpt_config_indivisible_dim_names_both_fields():
    with pytest.raises(ValueError) as info:
        GPTConfig(dim=30, n_heads=4)
    assert "dim=30" in str(info.value) and "n_heads=4" in str(info.value)


def test_gpt_config_is_frozen():
    with pytest.raises(AttributeError):
        GPTConfig().dim = 8  # type: ignore[misc]


# -- synthetic batches ---------------------------------------------------------------------------


def test_synthetic_batch_is_deterministic_per_step():
    a = synthetic_batch(50, 3, 7, step=5)
    b = synthetic_batch(50, 3, 7, step=5)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_synthetic_batch_differs_across_steps_and_seeds():
    x0, _ = synthetic_batch(50, 3, 7, step=0)
    x1, _ = synthetic_batch(50, 3, 7, step=1)
    other_seed, _ = synthetic_batch(50, 3, 7, step=0, seed=99)
    assert not torch.equal(x0, x1)
    assert not torch.equal(x0, other_seed)


def test_synthetic_batch_targets_are_inputs_shifted_by_one():
    inputs, targets = synthetic_batch(50, 3, 7, step=2)
    assert inputs.shape == targets.shape == (3, 7)
    assert inputs.dtype == targets.dtype == torch.int64
    assert torch.equal(targets[:, :-1], inputs[:, 1:])
    both = torch.cat([inputs, targets])
    assert both.min() >= 0 and both.max() < 50


def test_synthetic_batch_does_not_touch_the_global_rng():
    torch.manual_seed(7)
    expected = torch.rand(3)
    torch.manual_seed(7)
    synthetic_batch(50, 3, 7, step=0)
    assert torch.equal(torch.rand(3), expected)


# -- MLPStack ------------------------------------------------------------------------------------


def test_mlp_stack_shapes_and_untied_head():
    model = MLPStack(vocab_size=24, dim=8, n_layers=3)
    ids = torch.randint(0, 24, (2, 5))
    assert model(ids).shape == (2, 5, 24)
    assert len(model.blocks) == 3
    assert model.head.weight is not model.emb.weight
    assert model.head.weight.shape == model.emb.weight.shape == (24, 8)
    assert model.blocks[0].mlp.fc.weight.shape == (32, 8)  # 4 x dim hidden


def test_mlp_stack_is_position_wise():
    # No attention: each position's logits depend on its own token only.
    model = MLPStack(vocab_size=24, dim=8, n_layers=2)
    ids = torch.randint(0, 24, (1, 6))
    with torch.no_grad():
        whole = model(ids)
        alone = torch.cat([model(ids[:, t : t + 1]) for t in range(6)], dim=1)
    torch.testing.assert_close(whole, alone)


# -- Llama ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(("batch", "seq"), [(2, 16), (3, 5), (1, 1)])
def test_llama_maps_ids_to_logits(batch, seq):
    model = llama(vocab_size=40)
    ids = torch.randint(0, 40, (batch, seq))
    logits = model(ids)
    assert logits.shape == (batch, seq, 40) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()
    assert model.vocab_size == 40


def test_llama_has_the_llama_shapes_grouped_query_and_no_bias():
    c = LlamaConfig(vocab_size=50, dim=32, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=80)
    model = Llama(c)
    attn, ff = model.layers[1].attention, model.layers[1].feed_forward
    assert attn.wq.weight.shape == (32, 32) and attn.wo.weight.shape == (32, 32)
    assert attn.wk.weight.shape == attn.wv.weight.shape == (2 * 4, 32)  # 2 K/V heads of 4
    assert ff.w1.weight.shape == ff.w3.weight.shape == (80, 32) and ff.w2.weight.shape == (32, 80)
    assert not any(n.endswith("bias") for n, _ in model.named_parameters())
    assert isinstance(model.layers, nn.ModuleList) and len(model.layers) == 2
    assert model.output.weight is not model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == llama_param_count(c)
    assert "layers.1.attention.wq.weight" in dict(model.named_parameters())


def test_llama_tied_embeddings_share_one_parameter():
    model = llama(tie_embeddings=True)
    assert model.output.weight is model.tok_embeddings.weight
    assert sum(p.numel() for p in model.parameters()) == llama_param_count(model.config)


def test_llama_train_steps_decrease_the_loss():
    model = llama()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    inputs, targets = synthetic_batch(model.vocab_size, 4, 16, step=0)
    losses = []
    for _ in range(10):  # the same batch: the model must fit it
        loss = lm_loss(model, inputs, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.2, losses
    assert all(p.grad is not None for p in model.parameters())


def test_llama_is_causal():
    model = llama()
    ids = torch.randint(0, model.vocab_size, (2, 10))
    changed = ids.clone()
    changed[:, 6] = (changed[:, 6] + 1) % model.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    torch.testing.assert_close(a[:, :6], b[:, :6], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 6], b[:, 6])


def test_llama_position_matters_through_rope():
    # No position embedding: only the rotation tells positions apart. Without it, causal
    # attention sees the prefix as a set, so the last position's logits cannot depend on the
    # order of the earlier tokens; with it they must. One layer: in a deeper stack the earlier
    # positions' own outputs already depend on the order (causal masking), rotation or not.
    # (Identical tokens would prove nothing: every position then averages the same value
    # vectors, rotation or not.)
    model = llama(n_layers=1)
    ids = torch.tensor([[5, 17, 3, 9, 11, 2]])
    swapped = ids[:, [1, 0, 2, 3, 4, 5]]  # the first two tokens exchanged
    with torch.no_grad():
        order_matters = (model(ids)[0, -1] - model(swapped)[0, -1]).abs().max().item()
        model.rope.rope_cos.fill_(1.0)  # the control: every angle zero, no rotation
        model.rope.rope_sin.zero_()
        without_rope = (model(ids)[0, -1] - model(swapped)[0, -1]).abs().max().item()
    assert without_rope < 1e-5, without_rope  # order-blind: only float rounding differs
    assert order_matters > 1e-3, order_matters  # two orders of magnitude above that


def test_llama_rotary_cache_is_non_persistent_and_rebuilt_after_to_empty():
    reference = llama()
    assert not any("rope" in k for k in reference.state_dict())  # derived, not saved
    assert {n for n, _ in reference.named_buffers()} == {"rope.rope_cos", "rope.rope_sin"}
    with torch.device("meta"):
        model = Llama(reference.config)
    assert model.rope.rope_cos.is_meta
    model.to_empty(device="cpu")
    model.rope.rope_cos.fill_(float("nan"))  # what to_empty leaves is garbage: make it visible
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(model.rope.rope_cos, reference.rope.rope_cos)
    assert torch.equal(model.rope.rope_sin, reference.rope.rope_sin)
    assert torch.all(model.norm.weight == 1)  # RMSNorm.reset_parameters: ones
    assert torch.all(model.layers[0].ffn_norm.weight == 1)
    ids = torch.randint(0, model.vocab_size, (2, 8))
    assert torch.isfinite(model(ids)).all()
    model.load_state_dict(reference.state_dict())  # the state_dict loads without the cache
    torch.testing.assert_close(model(ids), reference(ids))


def test_llama_rejects_a_sequence_longer_than_the_rotary_cache():
    model = llama(seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 9, dtype=torch.int64))


def test_llama_factory_is_seeded():
    a, b = llama().state_dict(), llama().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_heads": 3}, "n_heads=3"),
        ({"n_kv_heads": 3}, "n_kv_heads=3"),
        ({"dim": 12, "n_heads": 4, "n_kv_heads": 1}, "odd"),
        ({"ffn_dim": 0}, "ffn_dim"),
        ({"vocab_size": True}, "vocab_size"),
        ({"tie_embeddings": 1}, "tie_embeddings"),
        ({"rope_theta": 0.0}, "rope_theta"),
    ],
)
def test_llama_config_rejects_bad_values_naming_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kwargs)


def test_llama_70b_config_is_the_llama_3_70b_shape():
    c = llama_70b_config()
    assert (c.dim, c.n_layers, c.n_heads, c.n_kv_heads, c.ffn_dim) == (8192, 80, 64, 8, 28672)
    assert (c.vocab_size, c.seq_len, c.tie_embeddings) == (128256, 4096, False)
    assert llama_param_count(c) == 70_553_706_496
    assert llama_70b_config(n_layers=2).n_layers == 2


def test_llama_config_of_bytes_fits_the_target():
    target = 3 * 2**29  # 1.5 GiB
    c = llama_config_of_bytes(target)
    fp32 = 4 * llama_param_count(c)
    deeper = LlamaConfig(**{**c.__dict__, "n_layers": c.n_layers + 1})
    assert fp32 <= target < 4 * llama_param_count(deeper)
    assert fp32 > 1e9 and c.n_layers == 29
    with pytest.raises(ValueError, match="target_bytes"):
        llama_config_of_bytes(10**6)
