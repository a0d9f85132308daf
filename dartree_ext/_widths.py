"""Tree widths (children kept per depth) as every layer takes them: one integer for all depths,
or one per depth. A leaf module (no torch, no other dartree_ext import) so that the ops, the
pure-PyTorch reference and the tree builders read a width the same way.

* :func:`canonical_width`: a width as ``int`` or ``tuple`` of ints (hashable, printable);
* :func:`depth_widths`: the per-depth list (lenient: the last width repeats; ``exact=True``: one
  per depth as given, left to the op to check);
* :func:`parse_width`: the command-line form ``W`` or ``w1,w2,...``.

:mod:`dartree_ext.tree` re-exports :func:`depth_widths` and :func:`parse_width`.
"""
from __future__ import annotations

import numbers
from collections.abc import Sequence

__all__ = ["canonical_width", "depth_widths", "parse_width"]


def canonical_width(width: int | Sequence[int]) -> int | tuple[int, ...]:
    """An integer width (any ``numbers.Integral``, e.g. a numpy integer) as ``int``, per-depth
    widths as a ``tuple`` of ints (hashable, printable)."""
    if isinstance(width, numbers.Integral):
        return int(width)
    return tuple(int(w) for w in width)


def depth_widths(width: int | Sequence[int], depth: int, *, exact: bool = False) -> list[int]:
    """Children kept per depth: an int W for every depth, or per-depth widths ``(w1, w2, ...)``
    whose last value repeats down to ``depth`` (``(32, 12)`` = 32 at depth 1, 12 below); a list
    longer than ``depth`` is cut. Every width must be >= 1.

    ``exact=True`` (what the ops pass on): ``[W] * depth`` for an int, per-depth widths exactly as
    given and unchecked (the op checks that there is one per depth and its range)."""
    canonical = canonical_width(width)
    if exact:
        return [canonical] * depth if isinstance(canonical, int) else list(canonical)
    widths = [canonical] if isinstance(canonical, int) else list(canonical)
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be >= 1 (an int or a non-empty sequence), got {width!r}")
    return (widths + [widths[-1]] * depth)[:depth]


def parse_width(text: str) -> int | tuple[int, ...]:
    """``"12"`` -> 12, ``"32,12"`` -> (32, 12) (the command-line form of a width)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"a width is W or w1,w2,... (integers), got {text!r}") from None
    depth_widths(values, 1)  # validates
    return values[0] if len(values) == 1 else values
