"""compact_kv_ against the reference on every backend and dtype; hand-built moves."""
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
