"""compact_kv_, compact_kv_layers_ and compact_kv_paged_ against the reference on every backend and
dtype; hand-built moves; bad input."""
from __future__ import annotations

import pytest
import torch

from dartree_ext import reference


def random_moves(batch, l_max, seq, gen):
    """Per request: a committed length, then increasing accepted slots after it."""
    src = torch.zeros(batch, l_max, dtype=torch.int64)
    dst = torch.zeros(batch, dtype=torch.int64)
    lengths = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        start = int(torch.randint(0, seq // 2, (1,), generator=gen))
        room = seq - start
        n = int(torch.randint(0, min(l_max, room) + 1, (1,), generator=gen)) if b else min(l_max, room)
        slots = torch.sort(torch.randperm(room, generator=gen)[:n]).values + start
        src[b, :n] = slots
        dst[b], lengths[b] = start, n
    return src, dst, lengths


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("heads, seq, dk, dv, l_max", [(2, 40, 8, 8, 6), (3, 100, 64, 32, 17), (1, 10, 5, 3, 10)])
def test_compact_kv(backend, dtype, heads, seq, dk, dv, l_max):
    gen = torch.Generator().manual_seed(heads * seq + dk)
    batch = 3
    keys = torch.randn(batch, heads, seq, dk, generator=gen).to(dtype)
    values = torch.randn(batch, heads, seq, dv, generator=gen).to(dtype)
    src, dst, lengths = random_moves(batch, l_max, seq, gen)
    expected_k, expected_v = keys.clone(), values.clone()
    reference.compact_kv_(expected_k, expected_v, src, dst, lengths)
    k_dev, v_dev = backend.put(keys, values)
    backend.ops.compact_kv_(k_dev, v_dev, *backend.put(src, dst, lengths))
    assert torch.equal(k_dev.cpu(), expected_k) and torch.equal(v_dev.cpu(), expected_v)


def test_compact_kv_hand_built(backend):
    # prefix of 3, tree nodes in slots 3..8; accepted nodes sit in slots 4, 5 and 8
    cache = torch.arange(10, dtype=torch.float32).view(1, 1, 10, 1).repeat(1, 2, 1, 2)
    values = cache.clone()
    src = torch.tensor([[4, 5, 8]])
    k_dev, v_dev = backend.put(cache, values)
    backend.ops.compact_kv_(k_dev, v_dev, *backend.put(src, torch.tensor([3]), torch.tensor([3], dtype=torch.int32)))
    assert k_dev.cpu()[0, 1, :, 0].tolist() == [0, 1, 2, 4, 5, 8, 6, 7, 8, 9]
    assert torch.equal(k_dev.cpu(), v_dev.cpu())


def test_compact_kv_long_moves_chunk_columns(backend):
    # enough moved rows x columns that the CUDA kernel stages them in several column chunks
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 700, 40, generator=gen, dtype=torch.float64)
    values = keys.clone()
    src = torch.arange(100, 700, dtype=torch.int64)[None]
    expected = keys.clone()
    reference.compact_kv_(expected, expected.clone(), src, torch.tensor([1]), torch.tensor([600], dtype=torch.int32))
    k_dev, v_dev = backend.put(keys, values)
    backend.ops.compact_kv_(k_dev, v_dev, *backend.put(src, torch.tensor([1]), torch.tensor([600], dtype=torch.int32)))
    assert torch.equal(k_dev.cpu(), expected)


# paged pools -------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_compact_kv_layers_matches_reference(backend, seed):
    """Every layer's keys and values in one call: mixed dtypes, heads and head dims (one copy unit
    must divide all rows: 3 x 2-byte rows force 2-byte units), batch 3."""
    gen = torch.Generator().manual_seed(seed)
    seq, l_max = 50, 9
    shapes = [(2, 8, torch.float32), (2, 8, torch.float32), (1, 3, torch.bfloat16), (4, 16, torch.float16),
              (3, 5, torch.float64)][:2 + seed % 4]
    caches = [torch.randn(3, h, seq, d, generator=gen).to(dt) for h, d, dt in shapes]
    src, dst, lengths = random_moves(3, l_max, seq, gen)
    expected = [c.clone() for c in caches]
    reference.compact_kv_layers_(expected, src, dst, lengths)
    moved = backend.put(*caches, src, dst, lengths)
    backend.ops.compact_kv_layers_(list(moved[:len(caches)]), *moved[len(caches):])
    for got, want in zip(moved[:len(caches)], expected):
        assert torch.equal(got.cpu(), want)


def test_compact_kv_layers_more_than_one_launch(backend):
    """70 tensors: more than the 64 one CUDA launch takes."""
    gen = torch.Generator().manual_seed(1)
    caches = [torch.randn(2, 2, 20, 4, generator=gen) for _ in range(70)]
    src, dst, lengths = random_moves(2, 5, 20, gen)
    expected = [c.clone() for c in caches]
    reference.compact_kv_layers_(expected, src, dst, lengths)
    moved = backend.put(*caches, src, dst, lengths)
    backend.ops.compact_kv_layers_(list(moved[:70]), *moved[70:])
    assert all(torch.equal(got.cpu(), want) for got, want in zip(moved[:70], expected))


def test_compact_kv_layers_bad_input_leaves_the_caches():
    from dartree_ext import ops
    gen = torch.Generator().manual_seed(2)
    caches = [torch.randn(2, 2, 20, 4, generator=gen), torch.randn(2, 1, 20, 6, generator=gen)]
    before = [c.clone() for c in caches]
    src, dst, lengths = torch.tensor([[5, 4], [3, 4]]), torch.tensor([2, 2]), torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="increasing"):
        ops.compact_kv_layers_(caches, src, dst, lengths)
    assert all(torch.equal(c, b) for c, b in zip(caches, before)), "a rejected call must not move anything"
    ok = torch.tensor([[5, 6], [3, 4]])
    with pytest.raises(ValueError, match="at least one tensor"):
        ops.compact_kv_layers_([], ok, dst, lengths)
    with pytest.raises(ValueError, match="same sequence length"):
        ops.compact_kv_layers_([caches[0], torch.randn(2, 2, 21, 4)], ok, dst, lengths)
    with pytest.raises(ValueError, match="batch size 2"):
        ops.compact_kv_layers_([caches[0], torch.randn(3, 2, 20, 4)], ok, dst, lengths)
    with pytest.raises(RuntimeError, match=r"caches\[1\] must be contiguous"):
        ops.compact_kv_layers_([caches[0], torch.randn(2, 20, 2, 4).transpose(1, 2)], ok, dst, lengths)
    with pytest.raises(RuntimeError, match=r"must be \[B, H, S, Dh\]"):
        ops.compact_kv_layers_([caches[0], torch.randn(2, 20, 4)], ok, dst, lengths)


def paged_case(seed: int, batch: int = 3, page_size: int = 4, pages_per_request: int = 6, l_max: int = 9):
    """Pools for 2 layers (keys [P, page, H, 8] bf16, values [P, page, H, 6] fp32, so copy units
    differ), block tables that give each request scattered, distinct pages, and moves that cross
    page boundaries (sources in later pages than their destinations)."""
    gen = torch.Generator().manual_seed(seed)
    num_pages = batch * pages_per_request + 3
    perm = torch.randperm(num_pages, generator=gen)[:batch * pages_per_request]
    table = perm.view(batch, pages_per_request).to(torch.int32)
    caches = [torch.randn(num_pages, page_size, 2, 8, generator=gen).to(torch.bfloat16),
              torch.randn(num_pages, page_size, 2, 6, generator=gen),
              torch.randn(num_pages, page_size, 2, 8, generator=gen).to(torch.bfloat16),
              torch.randn(num_pages, page_size, 3, generator=gen).to(torch.float16)]
    capacity = pages_per_request * page_size
    src = torch.zeros(batch, l_max, dtype=torch.int64)
    dst = torch.zeros(batch, dtype=torch.int64)
    lengths = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        n = int(torch.randint(0, l_max + 1, (1,), generator=gen)) if b else l_max
        start = int(torch.randint(0, capacity - 2 * n, (1,), generator=gen))
        # source i = start + i + gap_i with non-decreasing gaps: increasing, at or after start + i
        gaps = torch.randint(0, capacity - start - n + 1, (n,), generator=gen).sort().values
        src[b, :n] = start + torch.arange(n) + gaps
        dst[b], lengths[b] = start, n
    return caches, table, src, dst, lengths


@pytest.mark.parametrize("seed", range(6))
def test_compact_kv_paged_matches_reference(backend, seed):
    caches, table, src, dst, lengths = paged_case(seed)
    expected = [c.clone() for c in caches]
    reference.compact_kv_paged_(expected, table, src, dst, lengths)
    got = [c.clone() for c in caches]
    moved = backend.put(*got, table, src, dst, lengths)
    backend.ops.compact_kv_paged_(list(moved[:len(got)]), *moved[len(got):])
    for g, e in zip(moved[:len(got)], expected):
        assert torch.equal(g.cpu(), e)
    assert any(not torch.equal(c, e) for c, e in zip(caches, expected)), "the case should move something"


def test_compact_kv_paged_by_hand(backend):
    """One request, page size 2, pages [3, 0, 2]: logical 4, 5 (page 2) move to 1, 2 (pages 3, 0)."""
    pool = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)
    table = torch.tensor([[3, 0, 2]], dtype=torch.int32)
    args = backend.put(pool.clone(), table, torch.tensor([[4, 5]]), torch.tensor([1]),
                       torch.tensor([2], dtype=torch.int32))
    backend.ops.compact_kv_paged_([args[0]], *args[1:])
    out = args[0].cpu()
    expected = pool.clone()
    expected[3, 1] = pool[2, 0]   # logical 1 = page 3 slot 1 <- logical 4 = page 2 slot 0
    expected[0, 0] = pool[2, 1]   # logical 2 = page 0 slot 0 <- logical 5 = page 2 slot 1
    assert torch.equal(out, expected)


def test_compact_kv_paged_bad_input_leaves_the_pools():
    from dartree_ext import ops
    caches, table, src, dst, lengths = paged_case(0)
    before = [c.clone() for c in caches]

    def rejects(match, table=table, src=src, dst=dst, lengths=lengths, caches=caches):
        with pytest.raises(ValueError, match=match):
            ops.compact_kv_paged_(caches, table, src, dst, lengths)
        assert all(torch.equal(c, b) for c, b in zip(caches, before)), "a rejected call must not move anything"

    bad = table.clone()
    bad[0, int(src[0, -1]) // 4] = 10 ** 6
    rejects("outside the pool", table=bad)
    shared = table.clone()
    shared[1] = shared[0]  # two requests on the same pages: their destinations overlap
    both = lengths.clone()
    both[1] = lengths[0]
    src2, dst2 = src.clone(), dst.clone()
    src2[1], dst2[1] = src[0], dst[0]
    rejects("same pool slot", table=shared, src=src2, dst=dst2, lengths=both)
    twice = table.clone()
    first = int(dst[0]) // 4
    twice[0, first + 1] = twice[0, first]
    rejects("two of its touched logical pages", table=twice)
    backwards = src.clone()
    backwards[0, 0] = int(dst[0]) - 1 if int(dst[0]) > 0 else 10 ** 6
    rejects("increasing", src=backwards)
    with pytest.raises(ValueError, match="agree on"):
        ops.compact_kv_paged_([caches[0], caches[1][:, :2].contiguous()], table, src, dst, lengths)
    with pytest.raises(ValueError, match="at least one pool"):
        ops.compact_kv_paged_([], table, src, dst, lengths)
