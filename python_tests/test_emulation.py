"""The emulation layer proves itself: it computes right with the barriers a kernel needs, wrong
without them, emulates warp primitives and atomics, and reports a deadlock instead of hanging; the
instrumented build reports global out-of-bounds accesses and counts global-memory bytes exactly."""
from __future__ import annotations

import ctypes

import pytest
import torch

import emulated
from conftest import emulated_ops
from emulated import FORWARD, REVERSE, SHUFFLED, EmulatedOps, byte_range, instrumenting_compiler


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr())


@pytest.fixture
def emu():
    ops = emulated_ops()
    yield ops
    ops.set_schedule(SHUFFLED, 0)


@pytest.mark.parametrize("schedule", [FORWARD, REVERSE, SHUFFLED])
@pytest.mark.parametrize("threads", [32, 128, 256])
def test_block_reduction_needs_its_barriers(emu, threads, schedule):
    emu.set_schedule(schedule, seed=threads)
    values = torch.arange(1, threads + 1, dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    emu.call("emu_block_sum", _ptr(values), threads, threads, 1, _ptr(out))
    assert int(out) == threads * (threads + 1) // 2
    out.zero_()
    if emu.instrumented:  # the race detector names the missing barrier before the result can
        with pytest.raises(RuntimeError, match="data race in block_sum_kernel"):
            emu.call("emu_block_sum", _ptr(values), threads, threads, 0, _ptr(out))
        return
    emu.call("emu_block_sum", _ptr(values), threads, threads, 0, _ptr(out))
    if schedule == REVERSE:
        # reverse order is a legal schedule under which this race happens to be harmless: the
        # reason tests use shuffled schedules and this self-test asserts the forward one
        return
    assert int(out) != threads * (threads + 1) // 2  # the missing __syncthreads shows


@pytest.mark.parametrize("threads", [32, 96, 80])
def test_warp_primitives_and_atomics(emu, threads):
    values = torch.randint(-50, 50, (threads,), dtype=torch.int32, generator=torch.Generator().manual_seed(threads))
    warps = (threads + 31) // 32
    warp_sums = torch.zeros(warps, dtype=torch.int32)
    ballots = torch.zeros(warps, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    minimum = torch.full((1,), 1 << 30, dtype=torch.int32)
    if threads % 32:  # a full-mask collective in a partial warp names lanes that do not exist
        with pytest.raises(RuntimeError, match="does not exist"):
            emu.call("emu_warp_primitives", _ptr(values), threads, _ptr(warp_sums), _ptr(ballots), _ptr(total),
                     _ptr(minimum))
        return
    emu.call("emu_warp_primitives", _ptr(values), threads, _ptr(warp_sums), _ptr(ballots), _ptr(total), _ptr(minimum))
    for w in range(warps):
        lanes = values[32 * w: 32 * (w + 1)]
        assert int(warp_sums[w]) == int(lanes.sum())
        expected_ballot = sum(1 << lane for lane, v in enumerate(lanes.tolist()) if v & 1)
        assert int(ballots[w]) & 0xFFFFFFFF == expected_ballot
    assert int(total) == int(values.sum())
    assert int(minimum) == int(values.min())


def test_divergent_barrier_is_reported_not_hung(emu):
    out = torch.zeros(32, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="deadlock"):
        emu.call("emu_divergent_barrier", _ptr(out))
    # the runtime recovers: the next launch works
    values = torch.ones(64, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int32)
    emu.call("emu_block_sum", _ptr(values), 64, 64, 1, _ptr(total))
    assert int(total) == 64


def test_oversized_block_is_rejected(emu):
    values = torch.ones(2048, dtype=torch.int32)
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="1..1024 threads"):
        emu.call("emu_block_sum", _ptr(values), 2048, 2048, 1, _ptr(out))


def test_barrier_after_exit_is_an_error(emu):
    """__syncthreads reached after some threads of the block returned is undefined in CUDA."""
    with pytest.raises(RuntimeError, match="exited"):
        emu.call("emu_exit_then_barrier", _ptr(torch.zeros(32, dtype=torch.int32)))


def test_shuffle_with_an_exited_lane_is_an_error(emu):
    with pytest.raises(RuntimeError, match="lane 31 of warp 0 is in the mask but exited"):
        emu.call("emu_exit_then_shuffle", _ptr(torch.zeros(32, dtype=torch.int32)))


@pytest.mark.parametrize("where, count, offset, match", [
    (0, 10, 10, "byte 40 of the dynamic shared memory \\(40 bytes\\)"),   # one past the end
    (0, 10, -1, "byte -4 of the dynamic shared memory"),                   # just before the start
    (0, 0, 0, "byte 0 of the dynamic shared memory \\(0 bytes\\)"),     # none was asked for
    (1, 0, 33, "byte 132 of a static shared array \\(132 bytes\\)"),
])
def test_shared_memory_out_of_bounds_write_is_an_error(emu, where, count, offset, match):
    """Guard zones around every shared array catch a write outside it (after the block ran)."""
    out = torch.zeros(64, dtype=torch.int32)  # alive through the call: the kernel writes it
    with pytest.raises(RuntimeError, match=match):
        emu.call("emu_shared_write", where, count, offset, _ptr(out))


@pytest.mark.parametrize("where, count, offset", [(0, 10, 9), (0, 10, 0), (1, 0, 32)])
def test_shared_memory_writes_in_bounds_pass(emu, where, count, offset):
    out = torch.zeros(64, dtype=torch.int32)
    emu.call("emu_shared_write", where, count, offset, _ptr(out))
    assert out.sum() == 64  # both blocks ran to the end


@pytest.mark.parametrize("shape, match", [
    ((1, 70000, 1, 32, 1, 1, 0), "gridDim.y = 70000"),
    ((1, 1, 0, 32, 1, 1, 0), "gridDim.z = 0"),
    ((1, 1, 1, 1, 1, 65, 0), "blockDim.z = 65"),
    ((1, 1, 1, 32, 1, 1, 64 * 1024), "without opting in"),
])
def test_launches_past_the_real_limits_fail(emu, shape, match):
    out = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        emu.call("emu_launch_shape", *shape, _ptr(out))
    emu.call("emu_launch_shape", 2, 3, 1, 32, 1, 1, 48 * 1024, _ptr(out))  # at the limits: runs
    assert int(out) == 1


def test_block_order_is_shuffled_under_the_shuffled_schedule(emu):
    """CUDA promises no order between blocks: the shuffled schedule runs them in a seeded random
    order (every block once), forward in index order."""
    def order(schedule, seed):
        emu.set_schedule(schedule, seed)
        out, count = torch.full((64,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
        emu.call("emu_block_order", 64, _ptr(out), _ptr(count))
        return out.tolist()
    assert order(FORWARD, 0) == list(range(64))
    shuffled = order(SHUFFLED, 1)
    assert sorted(shuffled) == list(range(64)) and shuffled != list(range(64))
    assert order(SHUFFLED, 1) == shuffled and order(SHUFFLED, 2) != shuffled  # seeded


# The instrumented build (clang++ load/store tracing): global-memory bounds and byte counts.
needs_clang = pytest.mark.skipif(instrumenting_compiler() is None,
                                 reason="the instrumented emulator needs clang++ (apt-get install clang)")


@pytest.fixture(scope="module")
def instrumented():
    ops = EmulatedOps(schedule=FORWARD, instrumented=True)
    yield ops


@needs_clang
def test_global_read_past_the_input_is_an_error(instrumented):
    values, out = torch.arange(40, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    ranges = [byte_range(values), byte_range(out)]
    instrumented.call("emu_copy_prefix", _ptr(values), 40, 0, _ptr(out), ranges=ranges)  # in bounds: runs
    assert torch.equal(out[:40], values)
    with pytest.raises(RuntimeError, match=r"global memory read out of bounds in copy_prefix_kernel, block \(1, 0, 0\), "
                                           r"thread \(8, 0, 0\): 4 bytes at 0x[0-9a-f]+, byte 160 of the nearest "
                                           r"registered range \[0x[0-9a-f]+, 0x[0-9a-f]+\) \(160 bytes\)"):
        instrumented.call("emu_copy_prefix", _ptr(values), 40, 1, _ptr(out), ranges=ranges)


@needs_clang
def test_global_write_outside_the_registered_tensors_is_an_error(instrumented):
    values, out = torch.arange(40, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="global memory write out of bounds in copy_prefix_kernel"):
        instrumented.call("emu_copy_prefix", _ptr(values), 40, 0, _ptr(out), ranges=[byte_range(values)])


@needs_clang
def test_ops_register_their_tensors(instrumented, monkeypatch):
    """An op checks its own tensors: with all of them registered it runs clean; with its int64
    output left out, the kernel's first store to it is an error."""
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 0, 0]], dtype=torch.int32)
    num_nodes = torch.tensor([6], dtype=torch.int32)
    bits, depths = instrumented.tree_ancestor_bits(parents, num_nodes)
    assert depths[0, :6].tolist() == [0, 1, 1, 2, 2, 2]
    real = emulated.byte_range
    monkeypatch.setattr(emulated, "byte_range",
                        lambda t: (t.data_ptr(), t.data_ptr()) if t.dtype == torch.int64 else real(t))
    with pytest.raises(RuntimeError, match="global memory write out of bounds in tree_ancestor_bits_kernel"):
        instrumented.tree_ancestor_bits(parents, num_nodes)


@needs_clang
@pytest.mark.parametrize("count", [1, 40, 100])
def test_global_bytes_of_a_copy_are_counted_exactly(instrumented, count):
    """A thread per element reads 4 bytes and writes 4: nothing else is global memory (arguments,
    stacks, shared memory and the runtime's bookkeeping are the emulator's)."""
    values, out = torch.arange(count, dtype=torch.int32), torch.zeros(count, dtype=torch.int32)
    with instrumented.counting() as traffic:
        instrumented.call("emu_copy_prefix", _ptr(values), count, 0, _ptr(out),
                          ranges=[byte_range(values), byte_range(out)])
    assert (traffic.read_bytes, traffic.write_bytes, traffic.launches) == (4 * count, 4 * count, 1)
    assert traffic.per_kernel == {"copy_prefix_kernel": (1, 4 * count, 4 * count)}
    assert instrumented.kernel_traffic()["copy_prefix_kernel"][0] >= 1
    instrumented.reset_kernel_traffic()
    assert instrumented.kernel_traffic() == {}


@needs_clang
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_global_bytes_of_compact_kv_are_counted_exactly(instrumented, dtype):
    """compact_kv_ on [B, H, S, Dh] keys and values in one launch: a block per (request, head,
    tensor) whose 256 threads each read the request's length (4 bytes) and destination (8); every
    moved element (here the copy unit: rows of 5 elements are copied element by element) reads its
    source position twice (8 + 8: before and after the barrier) and its value once, and writes it
    once."""
    batch, heads, seq, dim, l_max = 2, 3, 10, 5, 4
    keys = torch.randn(batch, heads, seq, dim).to(dtype)
    values = torch.randn(batch, heads, seq, dim).to(dtype)
    src = torch.tensor([[4, 6, 7, 9], [5, 8, 0, 0]])
    dst = torch.tensor([3, 4])
    lengths = torch.tensor([4, 2], dtype=torch.int32)
    expected_keys = keys.clone()
    for b in range(batch):
        for i in range(int(lengths[b])):
            expected_keys[b, :, int(dst[b]) + i] = keys[b, :, int(src[b, i])]
    with instrumented.counting() as traffic:
        instrumented.compact_kv_(keys, values, src, dst, lengths)
    assert torch.equal(keys, expected_keys)
    moved = heads * int(lengths.sum()) * dim  # elements per cache
    element = keys.element_size()
    blocks = heads * batch
    per_cache_reads = blocks * 256 * (4 + 8) + moved * (8 + 8 + element)
    assert traffic.launches == 1
    assert (traffic.read_bytes, traffic.write_bytes) == (2 * per_cache_reads, 2 * moved * element)


def test_counting_needs_the_instrumented_build(emu):
    if emu.instrumented:
        pytest.skip("the tests' backend is the instrumented build here")
    with pytest.raises(RuntimeError, match="instrumented"):
        with emu.counting():
            pass


@needs_clang
@pytest.mark.parametrize("schedule", [FORWARD, REVERSE, SHUFFLED])
@pytest.mark.parametrize("kind, blocks, match", [
    (0, 1, r"data race in racy_kernel: thread \d+ of block 0 (reads|writes) byte 0 of static shared array 0, which "
           r"thread \d+ of the same block (wrote|read)"),
    (1, 1, r"byte 4 of static shared array 0"),                # another warp, no __syncthreads
    (4, 1, r"byte 8 of static shared array 0"),                # lanes of one warp, no __syncwarp
    (5, 2, r"writes global memory at 0x[0-9a-f]+, which thread 0 of block \d \(blocks of one launch are unordered\) wrote"),
])
def test_data_races_are_errors(instrumented, schedule, kind, blocks, match):
    instrumented.set_schedule(schedule, seed=kind)
    out = torch.zeros(4 * 64 * blocks, dtype=torch.int32)
    try:
        with pytest.raises(RuntimeError, match=match):
            instrumented.call("emu_racy", kind, blocks, _ptr(out), ranges=[byte_range(out)])
    finally:
        instrumented.set_schedule(FORWARD, 0)


@needs_clang
@pytest.mark.parametrize("schedule", [FORWARD, REVERSE, SHUFFLED])
@pytest.mark.parametrize("kind, blocks", [(2, 1), (3, 1), (6, 3)])
def test_ordered_accesses_are_not_races(instrumented, schedule, kind, blocks):
    """A __syncthreads between warps, a __syncwarp between lanes, and neighbouring bytes written
    by different threads are clean; with detection off, a racy kernel runs too."""
    instrumented.set_schedule(schedule, seed=kind)
    out = torch.zeros(4 * 64 * blocks, dtype=torch.int32)
    try:
        instrumented.call("emu_racy", kind, blocks, _ptr(out), ranges=[byte_range(out)])
        if kind == 2:
            assert int(out[0]) == 5
        if kind == 3:
            assert int(out[1]) == 7
        if kind == 6:
            assert out.view(torch.int16)[:64 * blocks].tolist() == list(range(64)) * blocks
        instrumented.set_race_detection(False)
        instrumented.call("emu_racy", 0, 1, _ptr(out), ranges=[byte_range(out)])
    finally:
        instrumented.set_race_detection(True)
        instrumented.set_schedule(FORWARD, 0)


@needs_clang
def test_shared_memory_out_of_bounds_read_is_an_error(instrumented):
    out = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"shared memory read out of bounds in racy_kernel: byte 256 of a static "
                                           r"shared array \(256 bytes\), thread 0 of block 0"):
        instrumented.call("emu_racy", 7, 1, _ptr(out), ranges=[byte_range(out)])


@needs_clang
def test_atomics_are_not_races(instrumented):
    order, count = torch.full((16,), -1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    instrumented.call("emu_block_order", 16, _ptr(order), _ptr(count))
    assert sorted(order.tolist()) == list(range(16))
