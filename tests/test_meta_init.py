"""meta_init: counting a meta model, host memory measured, the counter-based deterministic init
(any slice, bitwise, by name)."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fsdp_lab.meta_init.counter_init import DeterministicInit, build_on_meta, meta_summary
from fsdp_lab.models import Llama, LlamaConfig, llama_70b_config, llama_param_count
from fsdp_lab.trace import RssSampler

MB = 10**6
SMALL = LlamaConfig(vocab_size=50, dim=16, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=40)

# -- meta_summary, build_on_meta, the formulas -------------------------------------------------


@pytest.mark.parametrize("tie", [False, True])
def test_meta_summary_counts_exactly_what_a_real_model_has(tie):
    config = LlamaConfig(**{**SMALL.__dict__, "tie_embeddings": tie})
    torch.manual_seed(0)
    real = Llama(config)
    meta, seconds = build_on_meta(lambda: Llama(config))
    assert seconds >= 0 and all(p.is_meta for p in meta.parameters())
    expected = sum(p.numel() for _, p in real.named_parameters())  # a tie once (deduplicated)
    s = meta_summary(meta)
    assert s["parameters"] == expected == llama_param_count(config)
    assert s["parameter_bytes"] == 4 * expected
    assert s["by_dtype"] == {"float32": {"parameters": expected, "bytes": 4 * expected}}
    assert s["shared_names"] == (1 if tie else 0)
    if tie:  # the head is the embedding: vocab_size * dim fewer parameters
        assert expected == llama_param_count(SMALL) - config.vocab_size * config.dim
    # Buffers: the two non-persistent rotary tables (seq_len, head_dim/2), float32.
    assert s["buffers"] == 2 * config.seq_len * config.head_dim // 2
    assert s["buffer_bytes"] == 4 * s["buffers"]
    assert s["modules"] == sum(1 for _ in real.modules())
    assert s["devices"] == ["meta"] and meta_summary(real)["devices"] == ["cpu"]


def test_meta_summary_splits_by_dtype():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2).to(torch.bfloat16))
    s = meta_summary(model)
    assert s["by_dtype"] == {
        "float32": {"parameters": 15, "bytes": 60},
        "bfloat16": {"parameters": 8, "bytes": 16},
    }
    assert s["parameters"] == 23 and s["parameter_bytes"] == 76


def test_llama_70b_builds_on_meta_without_host_memory():
    with RssSampler() as rss:
        model, _ = build_on_meta(lambda: Llama(llama_70b_config()))
        rss.mark("built")
    s = meta_summary(model)
    assert 68e9 <= s["parameters"] <= 71e9
    assert s["parameters"] == llama_param_count(llama_70b_config())
    assert s["parameter_bytes"] == 4 * s["parameters"]  # bytes it counts but does not hold
    assert rss.growth_bytes < 200 * MB, rss.growth_bytes  # memory, not time: safe to assert


# -- RssSampler ---------------------------------------------------------------------------------


def test_rss_sampler_sees_an_allocation_and_its_release():
    with RssSampler(interval_s=0.002) as rss:
        x = torch.empty(50 * 10**6, dtype=torch.float32)  # 200 MB, not yet resident
        x.fill_(1.0)  # now every page is touched
        held = rss.mark("allocated")
        del x
        freed = rss.mark("freed")
    assert rss.growth_bytes > 190 * MB
    assert held - rss.start_bytes > 190 * MB
    assert held - freed > 150 * MB  # a large block goes back to the OS when freed
    assert [label for _, label, _ in rss.marks] == ["allocated", "freed"]
    times = [t for t, _ in rss.samples]
    assert len(times) >= 3 and times == sorted(times)
    assert rss._thread is not None and not rss._thread.is_alive()


def test_rss_sampler_does_not_count_pages_of_a_file_read_through_a_mapping(tmp_path):
    # Code pages of shared libraries are file-backed: the kernel evicts them under memory
    # pressure and faults them back in on the next call. Counted as growth, they made a meta
    # build on a busy CI machine look as big as the ordinary one. A mapped file is the same
    # kind of page, deterministically: psutil's rss grows by it, the sampler must not.
    import mmap

    import psutil

    path = tmp_path / "pages"
    path.write_bytes(b"\1" * (64 * MB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        before = psutil.Process().memory_info().rss
        with RssSampler(interval_s=0.002) as rss:
            total = sum(pages[i] for i in range(0, len(pages), 4096))  # touch every page
            rss.mark("read")
        after = psutil.Process().memory_info().rss
    assert total == 64 * MB // 4096
    assert after - before > 48 * MB  # the control: the file's pages are resident
    assert rss.growth_bytes < 8 * MB, rss.growth_bytes


def test_rss_sampler_stops_on_an_exception_and_refuses_reuse():
    sampler = RssSampler()
    with pytest.raises(KeyError), sampler:
        raise KeyError("boom")
    assert not sampler._thread.is_alive()
    with pytest.raises(RuntimeError, match="new one"), sampler:
        pass
    with pytest.raises(ValueError, match="interval_s"):
        RssSampler(interval_s=0)


# -- DeterministicInit: any slice, bitwise --------------------------------------------------------

W = "layers.3.attention.wq.weight"


@pytest.mark.parametrize(
    ("name", "shape"), [(W, (37, 29)), ("tok_embeddings.weight", (41, 23)), ("c.weight", (5, 3, 7))]
)
def test_values_do_not_depend_on_how_the_range_is_split(name, shape):
    init = DeterministicInit(seed=7)
    numel = math.prod(shape)
    full = init.values(name, shape, 0, numel)
    assert full.shape == (numel,) and full.dtype == torch.float32
    assert torch.equal(init.values(name, shape, 0, 10), torch.cat([
        init.values(name, shape, 0, 4), init.values(name, shape, 4, 10)
    ]))  # fmt: skip
    for n in (1, 2, 3, 4):  # FSDP's equal shards: ceil(numel / n) each, the last one padded
        per = -(-numel // n)
        pieces = [init.values(name, shape, min(r * per, numel), min((r + 1) * per, numel))
                  for r in range(n)]  # fmt: skip
        assert torch.equal(torch.cat(pieces), full), n
    rng = random.Random(0)
    for _ in range(5):  # random cut points, and a chunking that changes nothing
        cuts = sorted({0, numel, *(rng.randrange(numel) for _ in range(rng.randint(1, 6)))})
        pieces = [init.values(name, shape, a, b) for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(pieces), full)
    small_chunks = DeterministicInit(seed=7, chunk_elements=5)
    assert torch.equal(small_chunks.values(name, shape, 3, numel), full[3:])


def test_values_reach_past_32_bit_indices():
    init, shape = DeterministicInit(1), (2**17, 2**17)  # 2**34 elements: the high word counts
    start = 2**32 - 3
    v = init.values(W, shape, start, start + 6)
    again = torch.cat(
        [init.values(W, shape, start, start + 3), init.values(W, shape, 2**32, start + 6)]
    )
    assert torch.equal(v, again)
    low = init.values(W, shape, 0, 6)  # i and i + 2**32 share their low 32 bits only
    assert not torch.equal(init.values(W, shape, 2**32, 2**32 + 6), low)


def test_same_seed_and_name_repeat_other_names_and_seeds_differ():
    shape, n = (64, 32), 64 * 32
    a = DeterministicInit(0).values(W, shape, 0, n)
    assert torch.equal(a, DeterministicInit(0).values(W, shape, 0, n))
    for other in ("layers.4.attention.wq.weight", "layers.3.attention.wk.weight"):
        b = DeterministicInit(0).values(other, shape, 0, n)
        assert not torch.equal(a, b) and abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.1
    for seed in (1, 2**40):
        assert not torch.equal(a, DeterministicInit(seed).values(W, shape, 0, n))


def test_rule_follows_pytorch_defaults_by_name_and_shape():
    init = DeterministicInit(0)
    assert init.rule("layers.0.attention.wq.weight", (8, 16)) == ("uniform", -0.25, 0.25)
    assert init.rule("conv.weight", (8, 4, 3, 3)) == ("uniform", -1 / 6, 1 / 6)  # fan_in 36
    assert init.rule("tok_embeddings.weight", (50, 16)) == ("normal", 0.0, 1.0)
    assert init.rule("wte.weight", (50, 16)) == ("normal", 0.0, 1.0)
    assert DeterministicInit(0, embedding_std=0.02).rule("tok_emb.weight", (5, 4))[2] == 0.02
    assert init.rule("layers.0.attention_norm.weight", (16,)) == ("constant", 1.0, 0.0)
    assert init.rule("fc.bias", (16,)) == ("constant", 0.0, 0.0)
    with pytest.raises(ValueError, match="temperature"):
        init.rule("temperature", ())
    # nn.Linear's own bound: kaiming_uniform_(a=sqrt(5)) = gain * sqrt(3 / fan_in).
    gain = nn.init.calculate_gain("leaky_relu", math.sqrt(5))
    assert init.rule("x.weight", (3, 16))[2] == pytest.approx(gain * math.sqrt(3 / 16))


def test_values_follow_the_rule_in_distribution():
    init = DeterministicInit(3)
    shape = (1000, 400)
    n = math.prod(shape)
    u = init.values("layers.0.feed_forward.w1.weight", shape, 0, n)
    bound = 1 / math.sqrt(400)
    assert u.min() >= -bound and u.max() <= bound
    assert u.min() < -0.99 * bound and u.max() > 0.99 * bound  # fills the whole interval
    assert abs(u.mean()) < 1e-4 and u.std().item() == pytest.approx(bound / math.sqrt(3), rel=0.01)
    z = DeterministicInit(3, embedding_std=2.0).values("tok_embeddings.weight", shape, 0, n)
    assert abs(z.mean()) < 0.01 and z.std().item() == pytest.approx(2.0, rel=0.01)
    frac_within_1sd = ((z.abs() < 2.0).double().mean()).item()
    assert frac_within_1sd == pytest.approx(0.6827, abs=0.005)  # normal, not uniform
    assert torch.all(init.values("norm.weight", (7,), 0, 7) == 1)
    assert torch.all(init.values("wq.bias", (7,), 2, 7) == 0)


def test_dtype_and_device_handling():
    init, shape = DeterministicInit(0), (16, 8)
    f32 = init.values(W, shape, 0, 128)
    bf16 = init.values(W, shape, 0, 128, dtype=torch.bfloat16, device=torch.device("cpu"))
    assert bf16.dtype == torch.bfloat16 and bf16.device.type == "cpu"
    assert torch.equal(bf16, f32.to(torch.bfloat16))  # the float32 value, rounded once more
    f64 = init.values(W, shape, 0, 128, dtype=torch.float64)
    assert torch.equal(f64, f32.double())
    meta = init.values(W, shape, 0, 128, device="meta")
    assert meta.is_meta and meta.shape == (128,)
    if torch.cuda.is_available():  # the same integer and IEEE arithmetic on the GPU
        assert torch.equal(init.values(W, shape, 0, 128, device="cuda").cpu(), f32)


def test_fill_slice_writes_into_a_view_of_a_flat_buffer():
    # What a rank does with its shard of a flat parameter: no separate tensor per parameter.
    init, shape = DeterministicInit(5), (6, 10)
    flat = torch.full((100,), -7.0, dtype=torch.bfloat16)
    init.fill_slice_(flat[20:50], W, shape, 13)
    assert torch.equal(flat[20:50], init.values(W, shape, 13, 43, dtype=torch.bfloat16))
    assert torch.all(flat[:20] == -7) and torch.all(flat[50:] == -7)  # nothing else touched
    with pytest.raises(ValueError, match="1-D"):
        init.fill_slice_(torch.empty(2, 3), W, shape, 0)


def test_values_errors_name_the_parameter_and_the_fix():
    init = DeterministicInit(0)
    with pytest.raises(ValueError, match=r"'w\.weight'.*start <= end"):
        init.values("w.weight", (4, 4), 5, 3)
    with pytest.raises(ValueError, match=r"'w\.weight'.*16 elements, end=17.*clip"):
        init.values("w.weight", (4, 4), 0, 17)
    with pytest.raises(ValueError, match="start"):
        init.values("w.weight", (4, 4), -1, 3)
    with pytest.raises(ValueError, match="floating"):
        init.values("w.weight", (4, 4), 0, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="shape"):
        init.values("w.weight", (4, -1), 0, 3)
    with pytest.raises(ValueError, match="seed"):
        DeterministicInit(-1)


def test_init_module_fills_every_parameter_as_values_does():
    torch.manual_seed(0)
    model = Llama(SMALL)
    init = DeterministicInit(11)
    init.init_module_(model)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach().reshape(-1), init.values(name, p.shape, 0, p.numel())), name
    # A block initialised alone, with its prefix, gets the whole model's values.
    block = Llama(SMALL).layers[1]
    init.init_module_(block, prefix="layers.1")
    for (_, a), (_, b) in zip(
        block.named_parameters(), model.layers[1].named_parameters(), strict=True
    ):
        assert torch.equal(a, b)
    # ...and each block its own values, keyed by the full name.
    assert not torch.equal(model.layers[0].attention.wq.weight, model.layers[1].attention.wq.weight)
    with torch.device("meta"):
        meta = Llama(SMALL)
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        init.init_module_(meta)


def test_init_module_then_training_works():
    # Initialised by DeterministicInit alone (no torch init ran), the model must train: the
    # loss falls over a few Adam steps on a fixed batch, and every parameter moves.
    torch.manual_seed(0)
    model = Llama(SMALL)
    DeterministicInit(0).init_module_(model)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids = torch.randint(0, SMALL.vocab_size, (4, 9))
    x, y = ids[:, :-1], ids[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(model(x).reshape(-1, SMALL.vocab_size), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.8 * losses[0], losses
    still = [k for k, v in model.named_parameters() if torch.equal(v, before[k])]
    assert still == [], still
