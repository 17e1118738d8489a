"""MemoryTracker measures the storages that really exist: exact byte budgets, on CPU."""

import gc
import json
import threading

import pytest
import torch

from fsdp_lab.trace.memory import CATEGORIES, MemoryTracker, category

MiB = 2**20


def last(mem: MemoryTracker, cat: str) -> int:
    """Bytes in `cat` at the latest sample (after a refresh)."""
    return mem.trace()["bytes"][cat][-1]


def approx(expected: int) -> object:
    """The 1% tolerance the lab promises; on CPU most figures below are in fact exact."""
    return pytest.approx(expected, rel=0.01)


def test_known_sizes_are_counted_exactly_and_freed():
    with MemoryTracker() as mem:
        baseline = mem.current_bytes
        a = torch.empty(MiB // 4)  # 1 MiB of float32
        b = torch.zeros(3 * MiB, dtype=torch.int8)  # 3 MiB of int8
        assert mem.current_bytes == approx(baseline + 4 * MiB)
        c = torch.randn(512, 512)  # 1 MiB
        d = c @ c  # the matmul output is a new 1 MiB storage
        e = torch.tensor([1.0] * 1024)  # built outside dispatch, seen through lift_fresh
        assert mem.current_bytes == baseline + 6 * MiB + 4096  # exact: the 4 KiB count too
        del b
        assert mem.current_bytes == approx(baseline + 3 * MiB + 4096)
        del a, c, d, e
        assert abs(mem.current_bytes - baseline) <= 0.01 * MiB
        assert mem.peak_bytes == baseline + 6 * MiB + 4096


def test_peak_between_markers_is_captured():
    with MemoryTracker() as mem:
        keep = torch.empty(MiB // 4)
        mem.mark("before")
        tmp = torch.empty(2 * MiB)  # 8 MiB, gone before the next marker
        del tmp
        tmp = torch.empty(2 * MiB)  # a free followed by an alloc is no new peak
        del tmp
        mem.mark("after")
        trace = mem.trace()
        assert [m["total"] for m in trace["markers"]] == [MiB, MiB]
        assert trace["peak_bytes"] == approx(9 * MiB)
        assert trace["peak_by_category"]["other"] == approx(9 * MiB)
        mem.reset_peak()
        assert mem.peak_bytes == mem.current_bytes == MiB
        del keep


def test_forgotten_references_keep_bytes_alive():
    kept = []
    with MemoryTracker() as mem:

        def step() -> None:
            x = torch.empty(MiB)  # 4 MiB
            kept.append(x[:10])  # a 40-byte view pins the whole 4 MiB storage

        def make_closure():
            buf = torch.empty(MiB // 2)  # 2 MiB captured by the lambda below
            return lambda: buf.sum()

        step()
        fn = make_closure()
        gc.collect()
        assert mem.current_bytes == approx(6 * MiB)
        mem.mark("end of step")
        assert mem.trace()["total"][-1] == approx(6 * MiB)
        del fn
        assert mem.current_bytes == approx(4 * MiB)
        kept.clear()
        assert mem.current_bytes == 0


def test_views_and_in_place_ops_do_not_double_count():
    with MemoryTracker() as mem:
        a = torch.zeros(512, 512)  # 1 MiB
        views = [a[10:], a.view(-1, 4), a.t(), a.reshape(-1), a.detach(), a.unsqueeze(0)]
        a.add_(1).mul_(2)
        torch.add(a, 1, out=a)
        assert mem.current_bytes == approx(MiB)
        copy = a.t().contiguous()  # a transposed view made contiguous is a real copy
        assert mem.current_bytes == approx(2 * MiB)
        del views, copy


def test_storages_created_before_tracking_are_invisible_unless_tracked():
    before = torch.empty(MiB // 4)
    with MemoryTracker() as mem:
        view = before[1:]  # a view of an untracked storage is not a new allocation
        assert mem.current_bytes == 0
        mem.track(before, category="comm_buffers")
        assert last(mem, "comm_buffers") == approx(MiB)
        del view


def test_category_context_tags_new_storages():
    with MemoryTracker() as mem:
        with category("comm_buffers"):
            buf = torch.empty(MiB // 4)
            with category("activations"):
                act = torch.empty(MiB // 2)
            out = torch.empty(MiB)
        plain = torch.empty(MiB // 8)
        assert last(mem, "comm_buffers") == approx(5 * MiB)
        assert last(mem, "activations") == approx(2 * MiB)
        assert last(mem, "other") == approx(MiB // 2)
        del buf, act, out, plain


def test_bad_category_name_is_rejected_with_the_allowed_names():
    with pytest.raises(ValueError, match="comm_buffers") as info, category("activation"):
        pass
    assert "'activation'" in str(info.value)
    with MemoryTracker() as mem, pytest.raises(ValueError, match="optimizer_state"):
        mem.track(torch.zeros(1), category="weights")


def test_module_parameters_and_gradients_are_classified_by_role():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    with MemoryTracker() as mem:
        mem.track(model)
        mem.mark("init")
        assert last(mem, "parameters") == param_bytes
        assert last(mem, "gradients") == 0
        with category("activations"):
            loss = model(torch.randn(32, 256)).sum()
            assert mem.current_bytes > param_bytes  # input and saved activations
            loss.backward()
        del loss
        mem.mark("backward")
        assert last(mem, "parameters") == param_bytes
        assert last(mem, "gradients") == param_bytes  # grads made in backward, re-tagged
        assert last(mem, "activations") == 0  # backward freed what forward saved
        assert mem.current_bytes == 2 * param_bytes


def test_adam_state_is_optimizer_state_with_exact_bytes():
    with MemoryTracker() as mem:
        model = torch.nn.Linear(300, 100)  # created while tracking: tagged "other" at first
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        mem.track(model)
        mem.track(optimizer)
        model(torch.randn(4, 300)).pow(2).mean().backward()
        optimizer.step()
        mem.mark("step")
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        state = [v for s in optimizer.state.values() for v in s.values()]
        expected = sum(v.untyped_storage().nbytes() for v in state if torch.is_tensor(v))
        step_bytes = sum(
            s["step"].nbytes for s in optimizer.state.values() if torch.is_tensor(s["step"])
        )
        assert expected == 2 * param_bytes + step_bytes  # exp_avg + exp_avg_sq (+ step scalars)
        assert last(mem, "optimizer_state") == expected
        assert last(mem, "parameters") == param_bytes
        assert last(mem, "gradients") == param_bytes
        assert last(mem, "other") == 0


def test_tracked_objects_are_held_weakly():
    model = torch.nn.Linear(512, 512)
    with MemoryTracker() as mem:
        mem.track(model)
        assert mem.current_bytes == approx(MiB + 2048)
        del model
        gc.collect()
        mem.mark("model deleted")
        assert mem.current_bytes == 0


def test_storage_resize_is_seen_at_the_next_mark():
    with MemoryTracker() as mem:
        with category("comm_buffers"):
            gathered = torch.empty(MiB // 4)
        param_view = gathered[: 1024 * 16].view(128, 128)  # views outlive the free below
        gathered.untyped_storage().resize_(0)  # FSDP's way to free an unsharded buffer
        mem.mark("resharded")
        assert mem.current_bytes == 0
        gathered.untyped_storage().resize_(MiB)  # and to re-allocate it for the next unshard
        with category("comm_buffers"):
            grown_from_empty = torch.empty(0)
        grown_from_empty.untyped_storage().resize_(2 * MiB)
        mem.mark("unsharded")
        assert last(mem, "comm_buffers") == 3 * MiB
        assert mem.trace()["markers"][0]["total"] == 0
        del param_view


def test_trace_is_columnar_and_json_serialisable():
    with MemoryTracker(rank=3) as mem:
        a = torch.empty(MiB // 4)
        mem.mark("allocated")
        with category("comm_buffers"):
            b = torch.empty(MiB // 2)
        del a
        mem.mark("freed")
        del b
    trace = json.loads(json.dumps(mem.trace()))
    assert set(trace) == {
        "rank",
        "device",
        "source",
        "categories",
        "t",
        "bytes",
        "total",
        "markers",
        "peak_bytes",
        "peak_by_category",
        "origin",  # the clock reading `t` counts from, and its host: ranks go on one axis
        "host",
    }
    assert (trace["rank"], trace["device"], trace["source"]) == (3, "cpu", "storages")
    assert trace["categories"] == list(CATEGORIES) == list(trace["bytes"])
    n = len(trace["t"])
    assert n >= 5 and all(len(trace["bytes"][c]) == n for c in CATEGORIES)
    assert trace["t"] == sorted(trace["t"])
    for i in range(n):
        assert trace["total"][i] == sum(trace["bytes"][c][i] for c in CATEGORIES)
    assert [m["label"] for m in trace["markers"]] == ["allocated", "freed"]
    assert [m["total"] for m in trace["markers"]] == [MiB, 2 * MiB]
    assert trace["peak_bytes"] >= max(trace["total"])
    assert trace["peak_bytes"] == 3 * MiB
    assert trace["peak_by_category"] == {
        **dict.fromkeys(CATEGORIES, 0),
        "other": MiB,
        "comm_buffers": 2 * MiB,
    }
    assert trace["total"][-1] == 0 == mem.current_bytes


def test_frees_after_stop_and_from_other_threads_are_safe():
    mem = MemoryTracker()
    with mem:
        x = torch.empty(MiB // 4)
        y = torch.empty(MiB // 4)
        worker = threading.Thread(target=lambda box=[y]: box.clear())
        del y
        worker.start()
        worker.join()  # the last reference died on another thread
        assert mem.current_bytes == MiB
    del x  # after stop: the callback is detached, nothing changes, nothing crashes
    gc.collect()
    assert mem.current_bytes == MiB
    with pytest.raises(RuntimeError, match="running"):
        mem.mark("too late")
    with mem:  # a tracker can be started again, with a fresh recording
        assert mem.current_bytes == 0 and mem.trace()["markers"] == []


def test_cuda_tracker_needs_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by test_cuda_totals_come_from_the_allocator")
    with pytest.raises(RuntimeError, match="CUDA"):
        MemoryTracker("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_totals_come_from_the_allocator():
    with MemoryTracker("cuda") as mem:
        baseline = mem.current_bytes
        with category("comm_buffers"):
            buf = torch.empty(MiB // 4, device="cuda")  # 1 MiB: a multiple of the 512 B blocks
        cpu_tensor = torch.empty(MiB)  # another device: not counted
        mem.mark("allocated")
        assert mem.current_bytes == baseline + MiB
        assert last(mem, "comm_buffers") == MiB
        del buf, cpu_tensor
        mem.mark("freed")
        trace = mem.trace()
    assert trace["source"] == "cuda_allocator" and trace["device"].startswith("cuda")
    assert trace["peak_bytes"] >= baseline + MiB
    assert trace["markers"][-1]["total"] == baseline
    # The process beside its tensors: the 1 MiB block stays reserved after the free.
    cuda = trace["cuda"]
    assert cuda["peak_reserved_bytes"] >= cuda["reserved_bytes"] >= MiB
    print("CUDA process memory:", cuda)  # context measured or why not: for gpu_check's log
    if cuda["process_bytes"] is not None:
        assert cuda["process_bytes"] >= cuda["reserved_bytes"]
        assert cuda["context_bytes"] == cuda["process_bytes"] - cuda["reserved_bytes"]


# -- a process's CUDA memory beyond its tensors, with CPU stand-ins for CUDA's readers ----------


def test_cuda_context_is_the_driver_count_less_the_allocator_reserve():
    from fsdp_lab.trace.cuda_memory import cuda_process_memory

    def allocator(_device):
        return 3 * MiB, 8 * MiB, 10 * MiB  # allocated, reserved, peak reserved

    measured = cuda_process_memory(
        torch.device("cuda", 0), allocator=allocator, driver=lambda _d: (508 * MiB, "NVML")
    )
    assert measured == {
        "allocated_bytes": 3 * MiB,
        "reserved_bytes": 8 * MiB,
        "peak_reserved_bytes": 10 * MiB,
        "process_bytes": 508 * MiB,
        "context_bytes": 500 * MiB,
        "context_source": "NVML",
    }
    unread = cuda_process_memory(
        torch.device("cuda", 0), allocator=allocator, driver=lambda _d: (None, "not measured: x")
    )
    assert unread["context_bytes"] is None and unread["context_source"] == "not measured: x"


def test_without_nvml_the_context_says_what_to_install(monkeypatch):
    import sys

    from fsdp_lab.trace.cuda_memory import process_gpu_bytes

    monkeypatch.setitem(sys.modules, "pynvml", None)  # an import of it now fails
    assert process_gpu_bytes(torch.device("cuda", 0)) == (
        None,
        "not measured: NVML's Python bindings are missing (pip install nvidia-ml-py)",
    )


def test_the_shard_report_states_each_ranks_cuda_memory_and_nothing_on_cpu():
    from fsdp_lab.sharding.lab.report import cuda_memory_lines

    cuda = {"reserved_bytes": 8 * MiB, "peak_reserved_bytes": 10 * MiB}
    traces = [
        {
            "device": "cuda:0",
            "peak_bytes": 3 * MiB,
            "cuda": {**cuda, "context_bytes": 500 * MiB, "context_source": "NVML"},
        },
        {
            "device": "cuda:0",
            "peak_bytes": 3 * MiB,
            "cuda": {**cuda, "context_bytes": None, "context_source": "not measured: y"},
        },
    ]
    lines = cuda_memory_lines({"memory_traces": traces})
    assert "rank 0 on cuda:0: tensors peak 3.00 MiB" in lines[3]
    assert "reserved 8.00 MiB (peak 10.00 MiB), CUDA context 500.00 MiB (NVML)" in lines[3]
    assert lines[4].endswith("CUDA context not measured: y")
    assert cuda_memory_lines({"memory_traces": [{"device": "cpu", "peak_bytes": 1}]}) == []


def test_storage_resize_is_seen_at_once_without_a_mark():
    # FSDP1/FSDP2 free gathered buffers with UntypedStorage.resize_ and never mark a tracker.
    with MemoryTracker() as mem:
        buf = torch.empty(1 << 18)  # 1 MiB
        view = buf[:10]
        assert mem.current_bytes == 1 << 20
        buf.untyped_storage().resize_(0)
        assert mem.current_bytes == 0
        buf.untyped_storage().resize_(1 << 19)
        assert mem.current_bytes == 1 << 19
        peak = mem.peak_bytes
    assert peak == 1 << 20 and view.untyped_storage().nbytes() == 1 << 19
