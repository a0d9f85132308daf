"""Applying the KV-compaction op to a transformers ``Cache``.

After a verification forward, each layer of the target's cache holds the committed prefix
followed by every tree node's entry. :func:`compact_cache_` keeps the accepted path's entries:
for each request they move to the slots right after its committed prefix (one
:func:`dartree_ext.ops.compact_kv_layers_` for every layer), and a croppable cache (``DynamicCache``) is cut
to ``new_length`` slots. A static cache (``StaticCache``) keeps its size; the caller's
attention mask hides the slots past each request's length.
"""
from __future__ import annotations

import torch

from .. import ops
from .._C import narrow_all
from .hf import layer_buffers


def cache_layers(cache) -> list:
    """The per-layer objects of a transformers ``Cache`` holding ``keys`` and ``values``
    tensors ``[B, H, S, D]``."""
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise TypeError(f"expected a transformers Cache with .layers (transformers >= 4.56), got {type(cache).__name__}")
    for i, layer in enumerate(layers):
        if getattr(layer, "keys", None) is None or getattr(layer, "values", None) is None:
            raise ValueError(f"cache layer {i} ({type(layer).__name__}) holds no keys/values yet (is it initialised?)")
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(f"cache layer {i} is a sliding-window layer: tree KV compaction needs full "
                                      "attention layers")
    return list(layers)


def compact_cache_(cache, src_positions: torch.Tensor, dst_start: torch.Tensor, lengths: torch.Tensor,
                   new_length: int | None = None):
    """Move, in every layer, request ``b``'s entries at ``src_positions[b, :lengths[b]]``
    (int64, increasing, ``>= dst_start[b]``) to ``dst_start[b] + i``; then crop a croppable
    cache to ``new_length`` slots (``None``: leave its length). Returns ``cache``."""
    layers = cache_layers(cache)
    tensors = [t for layer in layers for t in (layer.keys, layer.values)]
    if not all(t.is_contiguous() for t in tensors):
        # a growing cache (decoding.hf.new_cache): its keys and values are the first slots of
        # contiguous buffers, where the moves land the same (positions are below the length)
        buffers = [layer_buffers(layer) for layer in layers]
        if any(b is None for b in buffers) or len({b[0].shape[2] for b in buffers}) != 1:
            raise ValueError("cache keys/values must be contiguous (or a growing cache's buffers of one size) "
                             "for in-place compaction")
        tensors = [t for pair in buffers for t in pair]
    ops.compact_kv_layers_(tensors, src_positions, dst_start, lengths)
    return _crop_layers(cache, layers, new_length)


def crop_cache_(cache, new_length: int | None):
    """Cut a croppable cache (``DynamicCache``; not a ``StaticCache``) to ``new_length`` slots
    (``None``: leave it). Returns ``cache``."""
    return _crop_layers(cache, cache_layers(cache), new_length)  # (cache_layers checks the layers)


def _crop_layers(cache, layers: list, new_length: int | None):
    if new_length is not None and type(cache).__name__ != "StaticCache" \
            and any(layer.keys.shape[2] > new_length for layer in layers):
        # every layer's views in one native call (a Python slice costs a few microseconds a tensor)
        cropped = narrow_all([t for layer in layers for t in (layer.keys, layer.values)], 2, new_length)
        for i, layer in enumerate(layers):
            layer.keys, layer.values = cropped[2 * i], cropped[2 * i + 1]
    return cache


def select_requests_(cache, indices: torch.Tensor):
    """Keep only the requests ``indices`` (int64[B']) of every layer, in that order."""
    for layer in cache_layers(cache):
        layer.keys = layer.keys.index_select(0, indices).contiguous()
        layer.values = layer.values.index_select(0, indices).contiguous()
    return cache
