"""Tests for oomtune.capture: the storage recorder and the live virtual GPU.

Expected values are worked out by hand from what each aten op allocates (see the comments).
"""

from __future__ import annotations

import gc
import threading

import pytest
import torch
from torch import nn

from oomtune.alloc.sim import CachingAllocatorSim
from oomtune.alloc.stream import AllocationStream
from oomtune.capture import StorageRecorder, StreamSink, VirtualGPU, capture_stream

F32 = 4


def _record(fn, existing=(), device=None):
    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(existing)
    n_existing = len(sink.events)
    with rec:
        fn()
    return sink, rec, sink.events[n_existing:]


# --------------------------------------------------------------------------------------------------
# Hand-checked mini workload: y = x @ W^T (nn.Linear(1024, 1024, bias=False)), batch 8, loss = sum,
# SGD without momentum, on meta.
#
#   existing: W (1024*1024*4 = 4194304 B), x (8*1024*4 = 32768 B)
#   forward : W.t() is a view (nothing); mm(x, W^T) -> y 8x1024 fp32 = 32768 B; y.sum() -> 4 B
#   del y   : y is not saved by autograd (mm saves x for W's grad, W^T only for x's grad, which
#             x does not need), so its storage is released at once
#   backward: torch.autograd creates the seed gradient ones_like(loss) = 4 B; SumBackward expands
#             it (a view); MmBackward computes grad of W^T = x^T @ g = 1024x1024 fp32 = 4194304 B
#             (mm_mat2_backward picks the transposed layout so TBackward's .t() is contiguous like
#             W, and AccumulateGrad keeps it without a copy); the seed is released when
#             backward() returns
#   SGD     : W.add_(grad, alpha=-lr) in place: nothing
#   zero_grad(set_to_none=True) releases the grad; del loss releases the loss.
# --------------------------------------------------------------------------------------------------

def _linear_setup(device="meta"):
    lin = nn.Linear(1024, 1024, bias=False, device=device)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(8, 1024, device=device)
    return lin, opt, x


def test_hand_checked_linear_step_sequence_and_peak():
    lin, opt, x = _linear_setup()

    def step():
        y = lin(x)
        loss = y.sum()
        del y
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss

    sink, rec, events = _record(step, existing=[lin.weight, x])
    assert sink.alloc_sizes[:2] == [1024 * 1024 * F32, 8 * 1024 * F32]   # registered first
    y_k, loss_k, seed_k, grad_k = (k for a, k, _, _ in events if a == "alloc")
    assert [(a, k, s) for a, k, s, _ in events] == [
        ("alloc", y_k, 8 * 1024 * F32),
        ("alloc", loss_k, F32),
        ("free", y_k, 8 * 1024 * F32),
        ("alloc", seed_k, F32),
        ("alloc", grad_k, 1024 * 1024 * F32),
        ("free", seed_k, F32),
        ("free", grad_k, 1024 * 1024 * F32),
        ("free", loss_k, F32),
    ]
    # Peak: W + x + loss + seed + grad (y was released before backward).
    expected_peak = 4194304 + 32768 + 4 + 4 + 4194304
    assert sink.peak_live_bytes == expected_peak == rec.peak_live_bytes
    assert rec.live_bytes == 4194304 + 32768


def test_views_are_not_counted():
    x = torch.randn(16, 8, device="meta")

    def views():
        a = x.view(-1)
        b = x[0]
        c = x.t()
        d = x.reshape(8, 16)   # contiguous: a view
        e = x.expand(2, 16, 8)
        del a, b, c, d, e

    _, rec, events = _record(views, existing=[x])
    assert events == []
    assert rec.n_allocs == 1   # only x, registered


def test_inplace_and_out_ops_allocate_nothing():
    x = torch.randn(16, 8)
    out = torch.empty(16, 8)

    def inplace():
        x.add_(1.0)
        x.mul_(2.0)
        x.relu_()
        torch.add(x, x, out=out)

    _, _, events = _record(inplace, existing=[x, out])
    assert events == []


def test_existing_storage_registered_once():
    x = torch.randn(4, 4, device="meta")
    sink = StreamSink()
    rec = StorageRecorder(sink)
    assert rec.register_existing([x, x.t(), x[1], {"nested": [x.view(16)]}]) == 1
    assert sink.alloc_sizes == [4 * 4 * F32]


def test_zero_byte_storages_make_no_request():
    # NativeCachingAllocator::allocate calls malloc only if size != 0.
    _, _, events = _record(lambda: torch.empty(0, device="meta"))
    assert events == []


def test_storage_grown_by_out_op_is_new_request_then_release():
    a = torch.randn(10)
    holder = {}

    def grow():
        out = torch.empty(0)
        torch.add(a, a, out=out)   # resizes out's storage from 0 to 40 bytes
        holder["out"] = out

    _, _, events = _record(grow, existing=[a])
    assert [(act, size) for act, _, size, _ in events] == [("alloc", 10 * F32)]


def test_autograd_saved_tensor_lives_until_graph_released():
    x = torch.randn(256, device="meta", requires_grad=True)
    holder = {}

    def fwd():
        y = x.exp()          # ExpBackward saves its result y
        z = y.sum()
        del y                # still saved by the graph: no release
        holder["z"] = z

    sink, rec, events = _record(fwd, existing=[x])
    assert [(a, s) for a, _, s, _ in events] == [("alloc", 256 * F32), ("alloc", F32)]
    with rec:
        del holder["z"]      # graph freed: y's storage, then nothing else is left but x
        gc.collect()
    frees = [s for a, _, s, _ in sink.events if a == "free"]
    assert sorted(frees) == [F32, 256 * F32]


def _adam_step_record(device_filter):
    lin = nn.Linear(64, 64, bias=False, device="meta")
    opt = torch.optim.Adam(lin.parameters(), lr=1e-3)
    x = torch.randn(2, 64, device="meta")

    def step():
        lin(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sink, rec, _ = _record(step, existing=[lin.weight, x], device=device_filter)
    assert opt.state[lin.weight]["step"].device.type == "cpu"
    return sink, rec


def test_adam_state_counted_and_cpu_step_counter_filtered_on_meta():
    sink, rec = _adam_step_record("meta")
    # After the step only exp_avg and exp_avg_sq (each W-sized) remain besides W and x.
    assert rec.live_bytes == 3 * 64 * 64 * F32 + 2 * 64 * F32
    # Adam's 'step' counter is a CPU float32 scalar (not capturable/fused): no device request, but
    # an unfiltered recorder sees it as one more 4-byte storage that stays alive.
    all_sink, all_rec = _adam_step_record(None)
    assert all_rec.live_bytes == rec.live_bytes + F32
    assert all_sink.alloc_sizes.count(F32) == sink.alloc_sizes.count(F32) + 1


def test_release_from_another_thread_is_recorded():
    holder = {}
    sink, rec, events = _record(lambda: holder.setdefault("t", torch.empty(100, device="meta")))
    with rec:
        t = holder.pop("t")
        th = threading.Thread(target=lambda box=[t]: box.clear())
        del t
        th.start()
        th.join()
    assert [(a, s) for a, _, s, _ in sink.events] == [("alloc", 400), ("free", 400)]


def test_releases_after_exit_are_not_reported():
    holder = {}
    sink, _, _ = _record(lambda: holder.setdefault("t", torch.empty(100, device="meta")))
    holder.clear()
    assert [a for a, _, _, _ in sink.events] == ["alloc"]


def _resnet18_stream(device):
    import torchvision

    torch.manual_seed(0)
    with torch.device(device):
        model = torchvision.models.resnet18(num_classes=10)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(2, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (2,), device=device)

    def step():
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    sink = StreamSink()
    rec = StorageRecorder(sink, device=device)
    rec.register_existing(list(model.parameters()) + list(model.buffers()) + [x, y])
    with rec:
        step()
    return [(a, s) for a, _, s, _ in sink.events], sink.peak_live_bytes


def test_meta_and_cpu_give_the_same_stream():
    meta_events, meta_peak = _resnet18_stream("meta")
    cpu_events, cpu_peak = _resnet18_stream("cpu")
    assert len(meta_events) > 100
    assert meta_events == cpu_events
    assert meta_peak == cpu_peak


def test_capture_stream_builds_allocation_stream():
    lin, opt, x = _linear_setup()

    def step():
        lin(x).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    stream = capture_stream(step, existing=[lin.weight, x], device="meta")
    assert isinstance(stream, AllocationStream)
    assert len(stream) == 2 + 8   # two registered allocations, then 4 allocs and 4 frees
    assert stream.n_allocs == 6
    assert stream.peak_live_bytes() == 4194304 + 32768 + 4 + 4 + 4194304
    assert sorted(stream.live_keys) == [1, 2]   # W and x


# --------------------------------------------------------------------------------------------------
# VirtualGPU
# --------------------------------------------------------------------------------------------------

class BudgetSim:
    """A stand-in simulator: exact byte budget, no rounding; records misuse instead of raising it
    (a weakref callback swallows exceptions)."""

    def __init__(self, capacity_bytes):
        self.capacity, self.live, self.next_addr = capacity_bytes, {}, 1
        self.errors = []

    def malloc(self, size_bytes, stream=0):
        if sum(self.live.values()) + size_bytes > self.capacity:
            raise torch.OutOfMemoryError(f"simulated: tried to allocate {size_bytes} bytes")
        addr, self.next_addr = self.next_addr, self.next_addr + 1
        self.live[addr] = size_bytes
        return addr

    def free(self, addr):
        if self.live.pop(addr, None) is None:
            self.errors.append(addr)


def _linear_step(lin, opt, x):
    lin(x).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_virtual_gpu_fits_with_large_budget():
    lin, opt, x = _linear_setup()
    sim = BudgetSim(1 << 30)
    with VirtualGPU(sim) as vgpu:
        vgpu.register([lin.weight, x])
        _linear_step(lin, opt, x)
    assert sim.errors == []
    assert sum(sim.live.values()) == 4194304 + 32768   # only W and x stay
    # lin(x) is a temporary released once .sum() returns, so the peak is at the gradient:
    # W + x + loss + seed + grad.
    assert vgpu.peak_live_bytes == 4194304 + 32768 + 4 + 4 + 4194304


def test_virtual_gpu_raises_inside_step_at_the_failing_request():
    lin, opt, x = _linear_setup()
    # W + x fit, y and loss fit (y is released before backward), the seed fits, the 4 MiB
    # gradient does not.
    sim = BudgetSim(4194304 + 32768 + 32768 + 8)
    seen = []
    with pytest.raises(torch.OutOfMemoryError):
        with VirtualGPU(sim) as vgpu:
            vgpu.register([lin.weight, x])
            try:
                _linear_step(lin, opt, x)
            except torch.OutOfMemoryError:
                seen.append(vgpu.n_mallocs)
                raise
    assert seen == [2 + 3]   # W, x, y, loss, seed succeeded; the grad request failed
    gc.collect()
    assert sim.errors == []
    assert lin.weight.grad is None


def test_virtual_gpu_register_raises_when_parameters_do_not_fit():
    lin, _, x = _linear_setup()
    with VirtualGPU(BudgetSim(1 << 20)) as vgpu:
        with pytest.raises(torch.OutOfMemoryError):
            vgpu.register([lin.weight, x])


def test_virtual_gpu_enters_once():
    vgpu = VirtualGPU(BudgetSim(1 << 20))
    with vgpu:
        pass
    with pytest.raises(RuntimeError):
        vgpu.__enter__()


def _real_sim(total_bytes):
    return CachingAllocatorSim(total_memory_bytes=total_bytes)


def test_virtual_gpu_with_real_simulator_fits():
    lin, opt, x = _linear_setup()
    sim = _real_sim(1 << 30)
    with VirtualGPU(sim) as vgpu:
        vgpu.register([lin.weight, x])
        _linear_step(lin, opt, x)
    # W (4 MiB) and x (32 KiB, a multiple of 512 B so not rounded) stay allocated.
    assert sim.memory_stats()["allocated_bytes.all.current"] == 4194304 + 32768
    assert vgpu.n_mallocs == 6 and vgpu.n_frees == 4


def test_virtual_gpu_with_real_simulator_oom_inside_step():
    # W of nn.Linear(1024, 4096) is 16 MiB: >= 10 MiB, so its segment is exactly 16 MiB (sizes
    # rounded to 2 MiB: CUDACachingAllocator get_allocation_size); x, y (128 KiB), loss and the
    # seed share one 2 MiB small-pool segment. The 16 MiB gradient needs a new 16 MiB segment:
    # 16 + 2 + 16 = 34 MiB > 26 MiB, so it fails inside backward, after W, x, y, loss, seed.
    lin = nn.Linear(1024, 4096, bias=False, device="meta")
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(8, 1024, device="meta")
    sim = _real_sim(26 << 20)
    with pytest.raises(torch.OutOfMemoryError) as err:
        with VirtualGPU(sim) as vgpu:
            vgpu.register([lin.weight, x])
            assert vgpu.n_mallocs == 2
            _linear_step(lin, opt, x)
    assert vgpu.n_mallocs == 5
    assert "Tried to allocate 16.00 MiB" in str(err.value)
    assert sim.memory_stats()["num_ooms"] == 1


def test_oom_inside_backward_returns_the_failed_graphs_memory():
    # After an OOM inside backward() and the exception released, allocated memory returns to what
    # it was before the step (Accelerate's in-process retries rely on it). loss = s2 + s3 over
    # two heads of h: AddBackward queues both SumBackward tasks; the first head's MmBackward fails
    # at its first gradient, leaving the other head's task in the CPU engine's ready queue, whose
    # Node chain holds h. On CUDA the device thread drops that task at once; so must we.
    # W1 = 1024x1024 fp32 = 4 MiB, W2 = W3 = 16x1024 = 64 KiB each, x = h = 8x1024 = 32 KiB.
    # Forward peak: W's + x + h + y (512 B) + sums = 4 MiB + 192 KiB + ~520 B, under the capacity
    # of 4 MiB + 208 KiB; backward needs W's + x + h + loss + seed + a 32 KiB (grad h) or 64 KiB
    # (grad W) gradient = 4 MiB + 224 KiB + 8 B: over it.
    lin1 = nn.Linear(1024, 1024, bias=False, device="meta")
    lin2 = nn.Linear(1024, 16, bias=False, device="meta")
    lin3 = nn.Linear(1024, 16, bias=False, device="meta")
    x = torch.randn(8, 1024, device="meta")
    sim = BudgetSim((4 << 20) + (208 << 10))

    def step():
        h = lin1(x)
        (lin2(h).sum() + lin3(h).sum()).backward()

    with VirtualGPU(sim) as vgpu:
        vgpu.register([lin1.weight, lin2.weight, lin3.weight, x])
        before = sum(sim.live.values())
        try:
            step()
        except torch.OutOfMemoryError:
            pass  # the exception and its frames are released at the end of this block
        after = sum(sim.live.values())
    assert before == 4194304 + 2 * 65536 + 32768
    assert vgpu.n_mallocs > 4       # the step ran (h, heads, sums, seed) before failing
    assert after == before          # h and the seed are freed with the failed graph
    assert sim.errors == []


# -- the virtual GPU's geometry ---------------------------------------------------------------------
def test_virtual_gpu_budget_is_a_memory_fraction_of_the_device():
    from oomtune.capture.virtual_gpu import budget_geometry

    gib = 1 << 30
    geo = budget_geometry(gib, 80 * gib)
    assert geo == {"total_memory_bytes": 80 * gib, "memory_fraction": 1 / 80}
    for budget in (gib, 3 * gib + 12345, 79 * gib + 1):  # setMemoryFraction: round(fraction * total)
        g = budget_geometry(budget, 80 * gib)
        assert round(g["memory_fraction"] * g["total_memory_bytes"]) == budget
    assert budget_geometry(gib, None) == {"total_memory_bytes": gib, "memory_fraction": 1.0}


def test_garbage_collection_threshold_acts_on_the_virtual_gpu():
    # torch's malloc calls garbage_collect_cached_blocks only under a memory fraction
    # (CUDACachingAllocator.cpp). Budget 1000 MiB, threshold 0.8 -> 800 MiB. An 850 MiB block is
    # cached, then 900 MiB is requested: no cached block fits; reserved 850 > 800, so GC frees the
    # 850 MiB block and the new segment fits without a retry. On a device the size of the budget
    # (no fraction), GC never runs: 850 + 900 > 1000 fails, the cache is released, and the retry
    # succeeds (num_alloc_retries = 1).
    from oomtune.capture.virtual_gpu import budgeted_sim

    mib = 1 << 20
    for device_memory, retries in ((80 << 30, 0), (None, 1)):
        sim = budgeted_sim("garbage_collection_threshold:0.8", 1000 * mib, device_memory)
        sim.free(sim.malloc(850 * mib))
        sim.malloc(900 * mib)
        assert sim.num_alloc_retries == retries
        assert sim.memory_stats()["reserved_bytes.all.current"] == 900 * mib


def test_plan_geometry_of_the_virtual_gpu_is_the_trials():
    from oomtune.device import resolve_device
    from oomtune.plan.predictor import sim_geometry

    dev = resolve_device("cpu", virtual_device_memory="80GiB")
    assert sim_geometry(dev, 1 << 30) == {"total_memory_bytes": 80 << 30, "memory_fraction": 1 / 80}
