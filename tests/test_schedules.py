"""Checkpointing schedules: plain autograd's gradients, and measured costs equal to the theory;
Griewank–Walther's revolve(s) and its binomial law, counted by hooks."""

from math import comb

import pytest
import torch
import torch.nn as nn

from fsdp_lab.checkpointing.schedules import (
    LayerInputCounter,
    Schedule,
    ScheduleCost,
    every,
    full_recompute,
    min_budget,
    optimal,
    revolve,
    run_chain,
    segments,
    store_all,
)
from fsdp_lab.models import Chain, ChainLayer
from fsdp_lab.theory import checkpoint_cost as theory
from fsdp_lab.trace.memory import MemoryTracker, category

BATCH, DIM = 4, 8


@pytest.fixture(autouse=True)
def one_thread():
    """(4, 8) tensors gain nothing from intra-op threads; on a busy CPU they only wait for them."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def chain_and_input(n: int) -> tuple[Chain, torch.Tensor]:
    torch.manual_seed(0)
    return Chain(n, dim=DIM), torch.randn(BATCH, DIM, requires_grad=True)


def all_schedules(n: int) -> list[Schedule]:
    return [
        store_all,
        full_recompute,
        *(every(c) for c in range(1, n + 1)),
        *(segments(k) for k in range(1, n + 1)),
        *(optimal(b) for b in range(min_budget(n), n + 1)),
        *(revolve(s) for s in range(1, n + 1)),
    ]


def measured(chain: Chain, x: torch.Tensor, schedule: Schedule) -> ScheduleCost:
    """Stored activations and calls as the forward hooks saw them."""
    with LayerInputCounter(chain.layers) as counter:
        run_chain(chain.layers, x, schedule, grad_output=torch.ones(BATCH, DIM))
    return ScheduleCost(counter.stored_activations, counter.forward_calls)


@pytest.mark.parametrize("n", [1, 5, 8, 16])
def test_every_schedule_gives_plain_autograd_loss_and_gradients_bitwise(n):
    chain, x = chain_and_input(n)

    def loss_fn(y: torch.Tensor) -> torch.Tensor:
        return y.pow(2).mean()

    ref_loss = loss_fn(chain(x))
    ref_loss.backward()
    ref_grads = {name: p.grad.clone() for name, p in chain.named_parameters()}
    ref_grad_x = x.grad.clone()
    for schedule in all_schedules(n):
        chain.zero_grad(set_to_none=True)
        out = run_chain(chain.layers, x, schedule, loss_fn=loss_fn)
        # Bitwise, not just close: a recomputed layer replays the same kernels on the same input.
        assert torch.equal(out.loss, ref_loss.detach()), schedule
        assert torch.equal(out.grad_input, ref_grad_x), schedule
        for name, p in chain.named_parameters():
            assert torch.equal(p.grad, ref_grads[name]), (schedule, name)
    assert torch.equal(x.grad, ref_grad_x)  # the executor leaves x.grad alone


def test_upstream_gradient_path_and_grads_accumulate():
    chain, x = chain_and_input(6)
    g = torch.randn(BATCH, DIM)
    y = chain(x)
    y.backward(g)
    ref = {name: p.grad.clone() for name, p in chain.named_parameters()}
    chain.zero_grad(set_to_none=True)
    for _ in range(2):  # .grad accumulates across runs, as with loss.backward()
        out = run_chain(chain.layers, x, segments(2), grad_output=g)
    assert out.loss is None and torch.equal(out.output, y.detach())
    assert torch.equal(out.grad_input, x.grad)
    for name, p in chain.named_parameters():
        torch.testing.assert_close(p.grad, 2 * ref[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [1, 5, 8, 16])
def test_measured_calls_and_stored_activations_equal_theory(n):
    chain, x = chain_and_input(n)
    for schedule in all_schedules(n):
        assert measured(chain, x, schedule) == theory(schedule, n), schedule


@pytest.mark.parametrize("n", [5, 8, 16])
def test_call_counts_follow_the_textbook_formulas(n):
    chain, x = chain_and_input(n)
    assert measured(chain, x, store_all).forward_calls == n
    assert measured(chain, x, full_recompute) == ScheduleCost(2, n * (n + 1) // 2)  # quadratic
    for k in range(1, n + 1):
        last_segment = n % k or k  # its rerun under grad is its first forward: 2N minus it
        assert measured(chain, x, segments(k)).forward_calls == 2 * n - last_segment
    if n == 16:
        # C | N: sweep N - N/C, then C parts of N/C layers each recomputed from their start:
        # calls = N^2/(2C) + 3N/2 - N/C, the N^2/(2C) term halving as C doubles.
        quadratic = [measured(chain, x, every(c)).forward_calls - 24 + 16 // c for c in (1, 2, 4)]
        assert quadratic == [128, 64, 32]


def one_layer_bytes(layer: nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """Measured: (a checkpoint: one output under no_grad, what one layer keeps under grad
    (its GELU input and its output), that layer's peak during forward)."""
    with MemoryTracker() as mem, category("activations"):
        with torch.no_grad():
            out = layer(x)
        checkpoint = mem.current_bytes
        del out
    with MemoryTracker() as mem, category("activations"):
        y = layer(x.detach().requires_grad_())
        kept, peak = mem.current_bytes, mem.peak_bytes
        del y
    return checkpoint, kept, peak


def test_measured_activation_bytes_follow_the_schedule():
    n = 16
    chain, x = chain_and_input(n)
    g = torch.ones(BATCH, DIM)
    checkpoint, kept, peak_one = one_layer_bytes(chain.layers[0], x)
    assert checkpoint > 0 and kept > checkpoint and peak_one > kept

    def peak_bytes(schedule: Schedule, chain: Chain = chain) -> int:
        """The most activation bytes alive at once in one run, as the tracker saw them."""
        with MemoryTracker() as mem:
            run_chain(chain.layers, x, schedule, grad_output=g)
        return max(mem.trace()["bytes"]["activations"])

    peak = {s: peak_bytes(s) for s in (store_all, segments(4), full_recompute)}
    assert peak[store_all] > peak[segments(4)] > peak[full_recompute]
    assert peak[store_all] == pytest.approx((n - 1) * kept + peak_one, rel=0.02)  # O(N)
    # O(1): the rebuilt input, the chain output (kept for the caller) and one layer's forward.
    assert peak[full_recompute] == pytest.approx(2 * checkpoint + peak_one, rel=0.02)
    short_chain, _ = chain_and_input(8)
    assert peak_bytes(full_recompute, short_chain) == peak[full_recompute]
    for k in (2, 4, 8):
        # O(N/k + k): N/k - 1 checkpoints beyond the input, plus one taped segment of k layers.
        predicted = (n // k - 1) * checkpoint + (k - 1) * kept + peak_one
        assert peak_bytes(segments(k)) == pytest.approx(predicted, rel=0.02)


@pytest.mark.parametrize("n", [1, 5, 8, 16])
def test_optimal_lies_on_the_frontier(n):
    chain, x = chain_and_input(n)
    costs = {s: measured(chain, x, s) for s in all_schedules(n)}
    for budget in range(min_budget(n), n + 1):
        best = costs[optimal(budget)]
        assert best.stored_activations <= budget
        for s, cost in costs.items():
            if s.name != "optimal" and cost.stored_activations <= budget:
                assert best.forward_calls <= cost.forward_calls, (budget, s)
    assert costs[optimal(n)] == costs[store_all]
    # At 2 slots optimal tapes the first two layers at once: one call fewer than full recompute.
    assert costs[optimal(min_budget(n))].forward_calls == costs[full_recompute].forward_calls - (
        n > 1
    )
    if n == 16:  # and strictly better where it matters
        assert costs[optimal(5)].forward_calls < costs[every(4)].forward_calls
        assert costs[optimal(7)].forward_calls < costs[segments(4)].forward_calls


def test_optimal_table_agrees_with_exhaustive_search():
    def achievable(n: int) -> set[tuple[int, int]]:
        """(calls, stored) of every plan: tape, full recompute, or advance-split-recurse."""
        out = {(n, n), (n * (n + 1) // 2, min(n, 2))}
        for j in range(1, n):
            for left_calls, left_stored in achievable(j):
                for right_calls, right_stored in achievable(n - j):
                    out.add((j + left_calls + right_calls, max(left_stored, 1 + right_stored)))
        return out

    for n in range(1, 8):
        plans = achievable(n)
        for budget in range(min_budget(n), n + 1):
            fewest = min(calls for calls, stored in plans if stored <= budget)
            assert theory(optimal(budget), n).forward_calls == fewest, (n, budget)


def test_bad_inputs_raise_with_the_value_and_the_allowed_range():
    chain, x = chain_and_input(16)
    g = torch.ones(BATCH, DIM)
    bads = [(every, 0), (segments, 0), (optimal, 0), (revolve, 0), (every, -3), (segments, 2.5)]
    for make, bad in bads:
        with pytest.raises(ValueError, match=rf"={bad!r}\): expected an int >= 1"):
            make(bad)
    cases = [(every(17), "1..16"), (segments(17), "1..16"), (optimal(17), "2..16")]
    cases.append((revolve(17), "1..16"))
    for schedule, allowed in [*cases, (optimal(1), "2..16")]:
        with pytest.raises(ValueError, match=rf"{schedule.arg}\) is out of range .*{allowed}"):
            run_chain(chain.layers, x, schedule, grad_output=g)
        with pytest.raises(ValueError, match=allowed):
            theory(schedule, 16)
    assert theory(optimal(1), 1) == ScheduleCost(1, 1)  # one layer needs no second slot
    with pytest.raises(ValueError, match=r"'binomial'.*store_all, full_recompute, .*revolve"):
        Schedule("binomial", 3)
    with pytest.raises(ValueError, match="takes no argument"):
        Schedule("store_all", 3)
    with pytest.raises(ValueError, match="exactly one"):
        run_chain(chain.layers, x, store_all)
    with pytest.raises(ValueError, match="N >= 1"):
        run_chain([], x, store_all, grad_output=g)


class ReturnsTuple(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (x,)


@pytest.mark.parametrize(
    "schedule", [store_all, segments(2), optimal(2), full_recompute, revolve(1), revolve(2)]
)
def test_a_layer_returning_no_tensor_is_named(schedule):
    layers = [ChainLayer(DIM), ChainLayer(DIM), ReturnsTuple(), ChainLayer(DIM)]
    with pytest.raises(TypeError, match="layer 2 returned a tuple"):
        run_chain(layers, torch.randn(BATCH, DIM), schedule, grad_output=torch.ones(BATCH, DIM))


# -- Griewank–Walther's convention ----------------------------------------------------------------


def counted(n: int, schedule: Schedule) -> LayerInputCounter:
    chain, x = chain_and_input(n)
    with LayerInputCounter(chain.layers) as counter:
        run_chain(chain.layers, x, schedule, grad_output=torch.ones(BATCH, DIM))
    return counter


@pytest.mark.parametrize("s", [1, 2, 3])
@pytest.mark.parametrize("r", [1, 2, 3])
def test_revolve_follows_the_binomial_law(s, r):
    # Griewank's law: with s snapshots, l = C(s + r, s) is the longest chain in which no layer
    # is advanced more than r times, and the fewest advances are r·l − C(s + r, s + 1).
    steps = comb(s + r, s)
    at, past = counted(steps, revolve(s)), counted(steps + 1, revolve(s))
    assert at.repetitions == r and past.repetitions == r + 1
    assert at.advances == r * steps - comb(s + r, s + 1)
    assert at.forward_calls == steps + at.advances  # every layer taped exactly once
    assert at.stored_activations == min(steps, s + 1)  # the snapshots and the taped state


def test_revolve_with_one_snapshot_is_full_recompute_and_with_n_minus_one_a_single_sweep():
    n = 8
    one = counted(n, revolve(1))
    assert (one.forward_calls, one.stored_activations) == (n * (n + 1) // 2, 2)
    assert one.advances_per_layer == [n - 1 - i for i in range(n)]  # layer i: once per later one
    sweep = counted(n, revolve(n - 1))  # every state kept: each layer advanced once, bar the last
    assert sweep.advances_per_layer == [1] * (n - 1) + [0]


@pytest.mark.parametrize("n", [8, 16])
def test_at_equal_kept_inputs_optimal_makes_no_more_calls_than_revolve_but_holds_more_bytes(n):
    # The two conventions: optimal(b) lets a grad-mode tape double as the advance, so it never
    # needs more calls than revolve(b - 1), which keeps as many inputs. In bytes the order
    # turns: optimal's tapes keep every taped layer's GELU input too, revolve tapes one layer.
    chain, x = chain_and_input(n)
    g = torch.ones(BATCH, DIM)
    for b in range(3, n):
        ours, theirs = measured(chain, x, optimal(b)), measured(chain, x, revolve(b - 1))
        assert ours.stored_activations == theirs.stored_activations == b
        assert ours.forward_calls <= theirs.forward_calls, b

    def peak(schedule: Schedule) -> int:
        with MemoryTracker() as mem:
            run_chain(chain.layers, x, schedule, grad_output=g)
        return max(mem.trace()["bytes"]["activations"])

    b = n // 2
    assert (
        measured(chain, x, optimal(b)).forward_calls
        < measured(chain, x, revolve(b - 1)).forward_calls
    )
    assert peak(optimal(b)) > peak(revolve(b - 1))
