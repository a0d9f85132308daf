"""Per-round tree size from a measured cost model and calibrated acceptance.

A round costs ``t_draft + t_tree + t_verify(n, L)`` (``n`` draft nodes verified over a cache of
``L`` tokens) and yields ``1 + E[accepted(n)]`` tokens. :func:`choose_size` picks the ``n`` that
maximises the ratio; ``n = 0`` is a plain decoding step (no draft: ``1 / t_verify(0, L)``).

* :class:`CostModel`: the measured (or user-given) costs. ``verify_ms[i][j]`` is the target
  forward over ``nodes[j] + 1`` tokens after a cache of ``contexts[i]`` tokens;
  :func:`~dartree_ext.decoding.profiling.measure_cost_model` times it on the machine at hand (each tree size back to back with a
  plain step, repeated over all points in a new random order each pass; the plain step's fastest
  time plus the median of each size's differences, fitted non-decreasing by least squares; CUDA
  events on a GPU) and
  :func:`~dartree_ext.decoding.profiling.cached_cost_model` keeps it on disk, keyed by everything that changes it (model
  config, dtype, device model, threads, torch and library versions).
* Node acceptance (``E[accepted(n)]``): :mod:`~dartree_ext.decoding.calibration`.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence

log = logging.getLogger(__name__)

MAX_SKIP_ROUNDS = 16  # the longest run of plain steps between two drafts after losing ones


def _check_curve(name: str, xs: Sequence[float], ys: Sequence[float]) -> None:
    if len(xs) != len(ys) or not xs:
        raise ValueError(f"{name}: need one time per point, got {len(xs)} points and {len(ys)} times")
    if any(b <= a for a, b in zip(xs, xs[1:])):
        raise ValueError(f"{name}: points must be strictly increasing, got {list(xs)}")
    if any(not math.isfinite(y) or y <= 0 for y in ys):
        raise ValueError(f"{name}: times must be finite and > 0, got {list(ys)}")
    if any(b < a for a, b in zip(ys, ys[1:])):
        raise ValueError(f"{name}: a cost curve must not decrease with more nodes, got {list(ys)} at {list(xs)}")


def running_average(old: float | None, new: float, weight: float) -> float:
    """``new`` at the first observation (``old`` None), then ``old`` moved by ``weight`` towards it."""
    return new if old is None else (1 - weight) * old + weight * new


def next_backoff(backoff: int, cap: int = MAX_SKIP_ROUNDS) -> int:
    """The plain steps to take after a draft that did not pay, when the last back-off was
    ``backoff``: 1 the first time, then doubling while drafting keeps losing, at most ``cap``."""
    return min(cap, max(1, 2 * backoff))


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear, extrapolated linearly past the last point (never below the last value)."""
    if x <= xs[0]:
        return ys[0]
    i = bisect.bisect_right(xs, x) - 1
    if i >= len(xs) - 1:
        if len(xs) == 1:
            return ys[-1]
        slope = max(0.0, (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
        return ys[-1] + slope * (x - xs[-1])
    a, b = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - a) / (b - a)


@dataclasses.dataclass
class CostModel:
    """Round costs in milliseconds. ``verify_ms[i][j]``: target forward over ``nodes[j] + 1``
    tokens (root + ``nodes[j]`` draft nodes) after ``contexts[i]`` cached tokens; ``draft_ms``:
    one drafter pass; ``tree_ms``: tree construction per method (0 where absent)."""

    nodes: list[int]
    contexts: list[int]
    verify_ms: list[list[float]]
    draft_ms: float = 0.0
    tree_ms: dict[str, float] = dataclasses.field(default_factory=dict)
    meta: dict = dataclasses.field(default_factory=dict)
    overhead_ms: float | None = None  # per round besides the model; None: the decoder measures it as it runs

    def __post_init__(self) -> None:
        if not self.nodes or self.nodes[0] != 0:
            raise ValueError(f"cost model: nodes must start at 0 (a plain decoding step), got {self.nodes}")
        _check_curve("cost model contexts", self.contexts, [1.0] * len(self.contexts))
        if len(self.verify_ms) != len(self.contexts):
            raise ValueError(f"cost model: one verify curve per context, got {len(self.verify_ms)} curves for "
                             f"{len(self.contexts)} contexts")
        for c, row in zip(self.contexts, self.verify_ms):
            _check_curve(f"cost model verify curve at context {c}", self.nodes, row)
        if self.draft_ms < 0 or any(v < 0 for v in self.tree_ms.values()) or (self.overhead_ms or 0) < 0:
            raise ValueError("cost model: draft, tree and overhead times must be >= 0")

    @classmethod
    def from_curve(cls, curve: dict[int, float] | Sequence[tuple[int, float]], draft_ms: float = 0.0,
                   tree_ms: dict[str, float] | float = 0.0, overhead_ms: float | None = 0.0) -> "CostModel":
        """A user's own curve ``{nodes: verify ms}`` (independent of the context length), e.g.
        from a serving engine's profiler. It must include ``0`` and not decrease. The per-round
        overhead is taken as given (``None``: measured by the decoder as it runs)."""
        items = sorted(curve.items() if isinstance(curve, dict) else curve)
        nodes, ms = [int(n) for n, _ in items], [float(t) for _, t in items]
        if isinstance(tree_ms, (int, float)):
            tree_ms = {"*": float(tree_ms)}
        return cls(nodes=nodes, contexts=[0], verify_ms=[ms], draft_ms=float(draft_ms), tree_ms=dict(tree_ms),
                   meta={"source": "user"}, overhead_ms=overhead_ms)

    @property
    def max_nodes(self) -> int:
        return self.nodes[-1]

    def verify(self, n: float, context: float = 0.0) -> float:
        """Target forward time (ms) for ``n`` draft nodes after ``context`` cached tokens."""
        rows = [_interp(self.nodes, row, n) for row in self.verify_ms]
        if len(rows) == 1:
            return rows[0]
        return max(rows[0], _interp(self.contexts, rows, context))

    def verify_upto(self, n_max: int, context: float = 0.0) -> list[float]:
        """``[verify(n, context) for n in range(n_max + 1)]``: each curve interpolated over the
        nodes once (cached), then across contexts per ``n`` as :meth:`verify` does (a round's
        tree-size choice reads every ``n``)."""
        tables = self.__dict__.get("_tables")
        if tables is None or len(tables[0]) <= n_max:
            size = max(n_max + 1, self.max_nodes + 1)
            tables = [[_interp(self.nodes, row, n) for n in range(size)] for row in self.verify_ms]
            self.__dict__["_tables"] = tables  # derived from the fields, not one of them
        if len(tables) == 1:
            return tables[0][:n_max + 1]
        return [max(tables[0][n], _interp(self.contexts, [t[n] for t in tables], context)) for n in range(n_max + 1)]

    def tree(self, method: str) -> float:
        return self.tree_ms.get(method, self.tree_ms.get("*", 0.0))

    def round_ms(self, method: str, n: int, context: float = 0.0, batch: int = 1) -> float:
        """One round: no draft for ``n = 0``; ``batch`` rows verify ``batch * (n + 1)`` tokens,
        costed as one row of ``batch * (n + 1) - 1`` nodes (the weights are read once)."""
        verify = self.verify(batch * (n + 1) - 1, context)
        return verify if n == 0 else self.draft_ms + self.tree(method) + verify

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CostModel":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in fields})

    def save(self, path: str) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> "CostModel":
        with open(path) as f:
            return cls.from_dict(json.load(f))


# choosing n --------------------------------------------------------------------------------------
def choose_size(expected: Sequence[float], cost: CostModel, method: str = "*", context: float = 0.0,
                batch: int = 1, overhead_ms: float = 0.0, verify_scale: float = 1.0,
                drafted_ms: float | None = None) -> tuple[int, float]:
    """``(n, tokens per ms)`` maximising ``(batch + E(n)) / (round_ms(n) + overhead_ms)`` over
    ``n = 0..len(expected)-1``, where ``expected[n]`` = expected accepted draft tokens of the best
    ``n`` nodes summed over the batch (``expected[0] = 0``) and ``overhead_ms`` is what every
    round costs besides the model (the decoder's bookkeeping). ``verify_scale`` multiplies the
    verification curve and ``drafted_ms`` replaces the drafter pass plus tree construction (what
    the decoder measures as it runs: :class:`~dartree_ext.decoding.SpeculativeDecoder`). Ties go
    to the smaller ``n``."""
    if len(expected) == 0 or abs(float(expected[0])) > 1e-9:
        raise ValueError("expected[0] must be 0 (no draft nodes accept nothing)")
    if not verify_scale > 0 or (drafted_ms is not None and drafted_ms < 0):
        raise ValueError(f"need verify_scale > 0 and drafted_ms >= 0, got {verify_scale}, {drafted_ms}")
    verify = cost.verify_upto(batch * len(expected) - 1, context)
    best_n, best_rate = 0, batch / (verify_scale * verify[batch - 1] + overhead_ms)
    fixed = (cost.draft_ms + cost.tree(method) if drafted_ms is None else drafted_ms) + overhead_ms
    for n in range(1, len(expected)):
        rate = (batch + float(expected[n])) / (fixed + verify_scale * verify[batch * (n + 1) - 1])
        if rate > best_rate * (1 + 1e-9):
            best_n, best_rate = n, rate
    return best_n, best_rate
