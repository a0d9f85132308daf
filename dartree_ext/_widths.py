"""Tree widths (children kept per depth) as every layer takes them: one integer for all depths,
or one per depth. A leaf module (no torch, no other dartree_ext import) so that the ops, the
pure-PyTorch reference and the tree builders read a width the same way."""
from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["width_list", "canonical_width"]


def width_list(width: int | Sequence[int], depth: int) -> list[int]:
    """``[W] * depth`` for an integer ``W`` (any ``numbers.Integral``, e.g. a numpy integer), or
    the given per-depth widths as Python ints, exactly as given (the op checks that there is one
    per depth; :func:`dartree_ext.tree.depth_widths` is the lenient form that repeats the last)."""
    if isinstance(width, numbers.Integral):
        return [int(width)] * depth
    return [int(w) for w in width]


def canonical_width(width: int | Sequence[int]) -> int | tuple[int, ...]:
    """An integer width as ``int``, per-depth widths as a ``tuple`` of ints (hashable, printable)."""
    if isinstance(width, numbers.Integral):
        return int(width)
    return tuple(int(w) for w in width)
