"""Per-round tree size from a measured cost model and calibrated acceptance.

A round costs ``t_draft + t_tree + t_verify(n, L)`` (``n`` draft nodes verified over a cache of
``L`` tokens) and yields ``1 + E[accepted(n)]`` tokens. :func:`choose_size` picks the ``n`` that
maximises the ratio; ``n = 0`` is a plain decoding step (no draft: ``1 / t_verify(0, L)``).

* :class:`CostModel`: the measured (or user-given) costs. ``verify_ms[i][j]`` is the target
  forward over ``nodes[j] + 1`` tokens after a cache of ``contexts[i]`` tokens;
  :func:`measure_cost_model` times it on the machine at hand (each tree size back to back with a
  plain step, repeated over all points in a new random order each pass; the plain step's fastest
  time plus the median of each size's differences, fitted non-decreasing by least squares; CUDA
  events on a GPU) and
  :func:`cached_cost_model` keeps it on disk, keyed by everything that changes it (model
  config, dtype, device model, threads, torch and library versions).
* :class:`AcceptanceCalibrator`: P(node accepted | its tree score), per score bin, learned online
  from the rounds actually verified. ``E[accepted(n)]`` of the best ``n`` nodes (best-first, so
  every prefix is a valid tree) is the sum of their probabilities.
"""
from __future__ import annotations

import bisect
import dataclasses
import hashlib
import inspect
import json
import logging
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)

COST_MODEL_VERSION = 12  # 2: set-ups with few_rows_linear; 3: its bf16 kernel widens 32 at a time, drafter patched too;
# 4: grouped-query attention without copied keys/values (dartree_ext.attention); 5: the drafter pass
# timed with its context's keys and values kept, as the decoder keeps them; 6: the fastest repetition of
# each point (not the median), and the curve fitted non-decreasing (pooled, not raised to a noisy maximum);
# 7: the points of all contexts timed in a new random order each repetition (not in ascending order);
# 8: attention over few rows by the row-invariant CPU kernel (ops.few_rows_attention);
# 9: few_rows also runs the RMSNorms, rotary embedding and SwiGLU through the per-row ops (dartree_ext.row_layers);
# 10: silu_mul on vector selects (an AVX-512 build; no denormal arm): a row's activation 3-5x cheaper
# 11: each tree size timed in pairs with a plain step, the median of the differences (fit_curve)
# 12: few_rows_linear in bfloat16 prefetches in every pass over a weight block: 7+ rows cheaper
# (which few_rows_linear path runs, avx512 / avx2 / generic, is part of the key itself)
TreeBuilder = Callable[..., object]  # (hidden, base_logits, root, vocab) -> Tree
DEFAULT_NODES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_CONTEXTS = (64, 512)
CURVE_FITS = ("paired", "fastest")  # see fit_curve
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


def isotonic(values: Sequence[float], weights: Sequence[float] | None = None,
             increasing: bool = True) -> list[float]:
    """The least-squares fit to ``values`` that never decreases (``increasing``) or never
    increases, each value weighted by ``weights`` (1 each by default): adjacent violators are
    pooled into their weighted mean."""
    if weights is None:
        weights = [1.0] * len(values)
    if len(weights) != len(values):
        raise ValueError(f"isotonic: {len(values)} values but {len(weights)} weights")
    sign = 1.0 if increasing else -1.0
    blocks: list[list[float]] = []  # [value * sign, weight, count]
    for v, w in zip(values, weights):
        blocks.append([sign * float(v), float(w), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [sign * v for v, _, n in blocks for _ in range(int(n))]


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


def _on_host(values, dtype) -> np.ndarray:
    """A tensor (any device) or array-like as a NumPy array of ``dtype``."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype)


class AcceptanceCalibrator:
    """P(a draft node is accepted | its tree score), learned online.

    A node's score is its path log-probability under the drafter (with the correction head and
    depth bonus for DARTree), so ``exp(score)`` is an uncalibrated acceptance probability. Scores
    are binned (upper edges in ``bins``, log space); each bin keeps accepted / verified counts and
    starts from a Beta prior of weight ``prior_weight`` centred on ``exp`` of the bin's midpoint:
    optimistic for low scores (drafters are over-confident there), so a cold start tries trees
    and learns, rather than settling on plain decoding with nothing observed. The estimate is made
    non-increasing from the best bin to the worst (isotonic regression, each bin weighted by its
    evidence), so a higher score never predicts less.
    """

    DEFAULT_BINS = (-0.05, -0.1, -0.2, -0.35, -0.5, -0.75, -1.0, -1.5, -2.0, -2.5, -3.0, -4.0, -5.0, -7.0, -10.0)

    def __init__(self, bins: Sequence[float] = DEFAULT_BINS, prior_weight: float = 4.0) -> None:
        edges = sorted(bins, reverse=True)
        if not edges or edges[0] >= 0 or len(set(edges)) != len(edges):
            raise ValueError(f"bins must be distinct negative log-probabilities, got {list(bins)}")
        if prior_weight <= 0:
            raise ValueError(f"prior_weight must be > 0, got {prior_weight}")
        self.edges = torch.tensor(edges, dtype=torch.float32)  # descending upper edges
        self._ascending = np.asarray(edges[::-1], dtype=np.float32)
        self._ascending_list = self._ascending.tolist()  # (float32 values, as bins_np compares)
        upper = torch.cat([torch.zeros(1), self.edges])
        lower = torch.cat([self.edges, self.edges[-1:] - 2.0])
        self.prior = ((upper + lower) / 2).exp().clamp(1e-4, 0.999)  # bin i covers (edges[i], upper[i]]
        self.prior_weight = float(prior_weight)
        self.hits = torch.zeros(len(upper), dtype=torch.float64)
        self.trials = torch.zeros(len(upper), dtype=torch.float64)
        self._updates = 0  # counts in-place updates (the cached probabilities' key)

    def bins_np(self, scores: np.ndarray) -> np.ndarray:
        """Bin index of each score (0 = the best bin; NaN falls in the worst), as a NumPy array.
        The decoder's per-round calls go through NumPy: a round's few dozen scores cost a few
        microseconds here, where the same steps as torch calls cost tens of them each."""
        s = np.nan_to_num(np.asarray(scores, dtype=np.float32), nan=-1e30)
        # the number of upper edges >= s: s <= edges[i] for the first (edges >= s) bins
        return len(self._ascending) - np.searchsorted(self._ascending, s, side="left")

    def bin_of(self, scores: torch.Tensor) -> torch.Tensor:
        """Bin index of each score (0 = the best bin)."""
        return torch.from_numpy(self.bins_np(_on_host(scores, np.float32)))

    def probabilities_np(self) -> np.ndarray:
        """P(accepted) per bin (best bin first), as a read-only float32 NumPy array, kept until
        the counts change."""
        self.probabilities_list()
        return self.__dict__["_probs"][4]

    def probabilities_list(self) -> tuple[float, ...]:
        """P(accepted) per bin (best bin first), as a tuple, kept until the counts change; in
        plain Python (see :meth:`bin_list`)."""
        cached = self.__dict__.get("_probs")  # (updates, hits, trials, list, array)
        if cached is not None and cached[0] == self._updates and cached[1] is self.hits and cached[2] is self.trials:
            return cached[3]
        w = self.prior_weight
        prior = self.__dict__.get("_prior_list")
        if prior is None or prior[0] is not self.prior:
            prior = (self.prior, self.prior.double().tolist())
            self.__dict__["_prior_list"] = prior
        hits, trials = self.hits.tolist(), self.trials.tolist()
        p = [(h + w * q) / (t + w) for h, t, q in zip(hits, trials, prior[1])]
        # non-increasing from the best bin to the worst, each bin weighted by its evidence
        fitted = isotonic(p, [t + w for t in trials], increasing=False)
        probs = np.asarray(fitted, dtype=np.float32)
        probs.flags.writeable = False  # the cached array itself is returned
        fitted = tuple(probs.tolist())  # (the float32 values, as the array has them; immutable: it is cached)
        self.__dict__["_probs"] = (self._updates, self.hits, self.trials, fitted, probs)
        return fitted

    def bin_list(self, scores: Sequence[float]) -> list[int]:
        """:meth:`bins_np` for a list of Python floats, in plain Python (a round's few dozen
        scores: the interpreter's own code paths are warm right after the target's forward, where a
        library's are cold and each call costs tens of microseconds)."""
        edges, last = self._ascending_list, len(self._ascending)
        return [last - bisect.bisect_left(edges, s) if s == s else last for s in scores]

    def update_bins(self, bins: Sequence[int], accepted: Sequence[bool]) -> None:
        """:meth:`update` for nodes given by their bins (:meth:`bin_list`), in plain Python."""
        if not len(bins):
            return
        trials, hits = self.trials.numpy(), self.hits.numpy()
        for b, a in zip(bins, accepted):
            trials[b] += 1.0
            if a:
                hits[b] += 1.0
        self._updates += 1

    def probabilities(self) -> torch.Tensor:
        """P(accepted) per bin (best bin first)."""
        return torch.from_numpy(self.probabilities_np().copy())

    def predict_np(self, scores: np.ndarray) -> np.ndarray:
        """P(accepted) for each score (same shape, float32 NumPy)."""
        return self.probabilities_np()[self.bins_np(scores)]

    def predict(self, scores: torch.Tensor) -> torch.Tensor:
        """P(accepted) for each score (same shape, float32, CPU)."""
        return torch.from_numpy(self.predict_np(_on_host(scores, np.float32)))

    def update(self, scores: torch.Tensor | np.ndarray, accepted: torch.Tensor | np.ndarray) -> None:
        """``scores`` of the verified draft nodes and whether each was on the accepted path
        (torch tensors or NumPy arrays)."""
        idx = self.bins_np(_on_host(scores, np.float32)).reshape(-1)
        n = len(self.trials)
        self.trials.numpy()[:] += np.bincount(idx, minlength=n)
        self.hits.numpy()[:] += np.bincount(idx, weights=_on_host(accepted, np.float64).reshape(-1), minlength=n)
        self._updates += 1

    def state_dict(self) -> dict:
        return {"bins": self.edges.tolist(), "hits": self.hits.tolist(), "trials": self.trials.tolist()}

    @classmethod
    def from_state(cls, state: dict, max_trials: float | None = None,
                   prior_weight: float = 4.0) -> "AcceptanceCalibrator":
        """A calibrator starting from saved counts (:meth:`state_dict`, e.g. a drafter's
        ``calibration.json``), each bin's counts scaled down to at most ``max_trials`` so that
        what this run observes soon outweighs them."""
        try:
            cal = cls(bins=state["bins"], prior_weight=prior_weight)
            hits = torch.tensor(state["hits"], dtype=torch.float64)
            trials = torch.tensor(state["trials"], dtype=torch.float64)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a calibration state ({e})") from None
        if hits.shape != cal.hits.shape or trials.shape != cal.trials.shape or bool((hits < 0).any()) \
                or bool((hits > trials).any()):
            raise ValueError("a calibration state needs one hits <= trials pair per bin")
        if max_trials is not None:
            scale = (max_trials / trials.clamp(min=1e-9)).clamp(max=1.0)
            hits, trials = hits * scale, trials * scale
        cal.hits, cal.trials = hits, trials
        return cal


class DepthCalibrator:
    """One :class:`AcceptanceCalibrator` per depth class: depth 1, 2, ..., and every depth from
    ``len(classes)`` on in the last. A node's path score already falls with depth, but not by what
    acceptance does: on MT-Bench at T = 1 a score-only calibration predicted 1.01x the accepted
    depth-1 nodes, 1.09x at depth 2 and 2x at depth 3 (`docs/results/round_overhead_zen4.md`).
    Every class shares the score bins, so one lookup gives every node's probability."""

    def __init__(self, classes: Sequence[AcceptanceCalibrator]) -> None:
        if not classes:
            raise ValueError("DepthCalibrator needs at least one calibrator")
        if any(not torch.equal(c.edges, classes[0].edges) for c in classes):
            raise ValueError("every depth class must use the same score bins")
        self.classes = list(classes)

    @classmethod
    def fresh(cls, depths: int = 3) -> "DepthCalibrator":
        return cls([AcceptanceCalibrator() for _ in range(depths)])

    @classmethod
    def from_state(cls, state: dict, max_trials: float | None = None, depths: int = 3) -> "DepthCalibrator":
        """From :meth:`state_dict` (``{"by_depth": [...]}``), or from one
        :meth:`AcceptanceCalibrator.state_dict`, which then starts every depth class."""
        states = state.get("by_depth") if isinstance(state, dict) else None
        if states is None:
            states = [state] * depths
        if not isinstance(states, list) or not states:
            raise ValueError("not a calibration state (by_depth must be a non-empty list)")
        return cls([AcceptanceCalibrator.from_state(s, max_trials=max_trials) for s in states])

    def state_dict(self) -> dict:
        return {"by_depth": [c.state_dict() for c in self.classes]}

    @property
    def trials(self) -> torch.Tensor:
        """Verified nodes per depth class and bin ``[classes, bins]``."""
        return torch.stack([c.trials for c in self.classes])

    @property
    def hits(self) -> torch.Tensor:
        return torch.stack([c.hits for c in self.classes])

    def _class_of(self, depths: np.ndarray) -> np.ndarray:
        return np.clip(np.asarray(depths, dtype=np.int64), 1, len(self.classes)) - 1

    def predict_np(self, scores: np.ndarray, depths: np.ndarray) -> np.ndarray:
        """P(accepted) for each (score, depth) (float32 NumPy, the shape of ``scores``)."""
        probs = np.stack([c.probabilities_np() for c in self.classes])
        return probs[self._class_of(depths), self.classes[0].bins_np(scores)]

    def predict_list(self, scores: Sequence[float], depths: Sequence[int]) -> list[float]:
        """:meth:`predict_np` for lists, in plain Python (see :meth:`AcceptanceCalibrator.bin_list`)."""
        last = len(self.classes) - 1
        tables = [c.probabilities_list() for c in self.classes]
        bins = self.classes[0].bin_list(scores)
        return [tables[min(max(d, 1) - 1, last)][b] for b, d in zip(bins, depths)]

    def update_list(self, scores: Sequence[float], accepted: Sequence[bool], depths: Sequence[int]) -> None:
        """:meth:`update` for lists, in plain Python."""
        last = len(self.classes) - 1
        bins = self.classes[0].bin_list(scores)
        per_class: dict[int, tuple[list[int], list[bool]]] = {}
        for b, a, d in zip(bins, accepted, depths):
            entry = per_class.setdefault(min(max(d, 1) - 1, last), ([], []))
            entry[0].append(b)
            entry[1].append(a)
        for c, (b, a) in per_class.items():
            self.classes[c].update_bins(b, a)

    def update(self, scores: np.ndarray, accepted: np.ndarray, depths: np.ndarray) -> None:
        """Verified nodes' scores, whether each was accepted, and their depths (>= 1)."""
        scores, accepted = np.asarray(scores, dtype=np.float32).reshape(-1), np.asarray(accepted).reshape(-1)
        cls = self._class_of(depths).reshape(-1)
        for c in np.unique(cls).tolist():
            here = cls == c
            self.classes[c].update(scores[here], accepted[here])


class AcceptanceLevel:
    """How this decoding call's drafts fare against the calibration: one factor ``g`` by which a
    node's calibrated probability ``p`` at depth ``d`` becomes ``min(p * g**d, p_max)``.

    The calibration is learned over many prompts (and the drafter's saved counts come from
    training-like ones), so on a prompt unlike them it can be far off: on a haiku the shipped
    drafter's calibrated trees expected twice the draft tokens that were accepted. ``g`` is fitted
    to the recent rounds by moments: the expected hits of the nodes seen, ``sum_d S_d g**d``, equal
    the hits ``H`` (``S_d``: the calibrated probabilities summed over the nodes seen at depth
    ``d``), both discounted by ``decay`` per round so that a hard stretch is forgotten, plus
    ``prior`` pseudo-tokens at ``g = 1`` (no evidence: ``g = 1``). A factor per depth step
    matches how acceptance compounds along a path. ``g`` stays within ``bounds``.
    """

    def __init__(self, decay: float = 0.8, prior: float = 2.0, bounds: tuple[float, float] = (0.25, 2.0),
                 p_max: float = 0.98) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"decay must be in [0, 1), got {decay}")
        if prior <= 0:
            raise ValueError(f"prior must be > 0, got {prior}")
        if not 0.0 < bounds[0] <= 1.0 <= bounds[1]:
            raise ValueError(f"bounds must satisfy 0 < low <= 1 <= high, got {bounds}")
        if not 0.0 < p_max <= 1.0:
            raise ValueError(f"p_max must be in (0, 1], got {p_max}")
        self.decay, self.prior, self.bounds, self.p_max = float(decay), float(prior), bounds, float(p_max)
        self.expected: list[float] = [0.0]  # S_d, index d (0 unused)
        self.hits = 0.0
        self.factor = 1.0

    def update(self, probs: torch.Tensor, depths: torch.Tensor, hits: torch.Tensor) -> None:
        """One round's evidence: the calibrated probabilities of the nodes it checked, their depths
        (>= 1) and whether each was accepted."""
        depths, probs, hits = _on_host(depths, np.int64), _on_host(probs, np.float64), _on_host(hits, np.float64)
        depths = depths.reshape(-1)
        if depths.size == 0:
            return
        if int(depths.min()) < 1:
            raise ValueError("node depths must be >= 1 (the root is not a draft)")
        per_depth = np.bincount(depths, weights=probs.reshape(-1)).tolist()
        keep = self.decay
        self.expected = [keep * v for v in self.expected] + [0.0] * max(0, len(per_depth) - len(self.expected))
        for d, v in enumerate(per_depth):
            self.expected[d] += v
        self.hits = keep * self.hits + float(hits.sum())
        self.factor = self._solve()

    def _solve(self) -> float:
        target = self.hits + self.prior

        def expected(g: float) -> float:  # increasing in g
            return self.prior * g + sum(v * g ** d for d, v in enumerate(self.expected) if d)

        lo, hi = self.bounds
        if expected(lo) >= target:
            return lo
        if expected(hi) <= target:
            return hi
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if expected(mid) < target else (lo, mid)
        return 0.5 * (lo + hi)

    def scale(self, probs: torch.Tensor | np.ndarray, depths: torch.Tensor | np.ndarray) -> torch.Tensor | np.ndarray:
        """``min(probs * factor**depths, p_max)`` (``probs`` where the factor is 1); NumPy arrays
        in, a NumPy array out."""
        if self.factor == 1.0:
            return probs
        if isinstance(probs, np.ndarray):
            return np.minimum(probs * np.power(probs.dtype.type(self.factor), depths.astype(probs.dtype)),
                              probs.dtype.type(self.p_max))
        return (probs * torch.pow(torch.tensor(self.factor, dtype=probs.dtype), depths.to(probs.dtype))).clamp(
            max=self.p_max)


# measuring -------------------------------------------------------------------------------------
def cache_dir() -> str:
    root = os.environ.get("DARTREE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dartree_ext")
    return os.path.join(root, "cost")


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name


def cpu_bf16_native() -> bool:
    """Whether this CPU has bf16 arithmetic (AMX or avx512_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def model_digest(model: torch.nn.Module) -> str:
    """A short hash of a model's full config: the architecture part of a cached measurement's key."""
    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    return hashlib.sha256(cfg.encode()).hexdigest()[:16]


def _transformers_version() -> str:
    """The installed transformers' version ("" without it): its modeling code is part of every
    forward a curve times (transformers 5.25 wraps the rotary embedding in a module, for one)."""
    try:
        import transformers
    except ImportError:
        return ""
    return transformers.__version__


def cost_key(target: torch.nn.Module, drafter: torch.nn.Module | None, device: torch.device | str,
             nodes: Sequence[int], contexts: Sequence[int], methods: Sequence[str]) -> dict:
    """What a measured cost model depends on; a change in any of it is a different cache entry."""
    from .. import __version__, build_info
    from ..attention import attention_kind
    from ..linear import linear_kind
    from ..row_layers import row_layers_used
    few_rows = linear_kind(target) == "few_rows" or (drafter is not None and linear_kind(drafter) == "few_rows")
    param = next(target.parameters())
    dcfg = json.dumps(drafter.config.to_dict(), sort_keys=True) if drafter is not None and hasattr(
        drafter, "config") and hasattr(drafter.config, "to_dict") else ""
    dparam = next(drafter.parameters()).dtype if drafter is not None and any(True for _ in drafter.parameters()) \
        else None
    return {
        "version": COST_MODEL_VERSION, "dartree_ext": __version__, "torch": torch.__version__,
        "transformers": _transformers_version(),
        "model": model_digest(target), "drafter": hashlib.sha256(dcfg.encode()).hexdigest()[:16],
        "dtype": str(param.dtype).replace("torch.", ""), "drafter_dtype": str(dparam).replace("torch.", ""),
        "device": device_name(device), "threads": torch.get_num_threads() if torch.device(device).type == "cpu" else 0,
        "nodes": list(nodes), "contexts": list(contexts), "methods": sorted(methods),
        "attention": attention_kind(target),
        **({"linear": "few_rows"} if linear_kind(target) == "few_rows" else {}),
        **({"row_layers": True} if row_layers_used(target) else {}),
        **({"drafter_linear": "few_rows"} if drafter is not None and linear_kind(drafter) == "few_rows" else {}),
        **({"few_rows_linear": build_info().get("few_rows_linear")} if few_rows else {}),
    }


def _key_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{digest}.json")


def _drop_last(cache, count: int) -> None:
    """Remove the last ``count`` entries of every layer of a DynamicCache."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :-count, :]
        layer.values = layer.values[..., :-count, :]


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)


def _vocab_size(model: torch.nn.Module) -> int:
    cfg = model.config
    return int(cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size)


def _curve_samples(target: torch.nn.Module, need_hidden: bool, nodes: list[int], contexts: list[int], reps: int,
                   progress: bool, timer: _Timer, gen: torch.Generator) -> list[dict[int, list[tuple[float, float]]]]:
    """Per context: ``{n: [(plain ms, tree ms), ...]}``, ``reps`` pairs for each ``n > 0`` in ``nodes``:
    the target forward over the root alone and over root + ``n`` nodes, timed back to back (see
    :func:`measure_cost_model`)."""
    from transformers import DynamicCache

    from .. import ops
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    vocab = _vocab_size(target)
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    points = [(c, n) for c in range(len(contexts)) for n in nodes if n > 0]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(points) * (reps + 1) * 2, desc="cost model: target", unit="fwd")
    caches, pasts = [], []
    for ctx in contexts:
        cache = DynamicCache(config=target.config)
        if ctx > 0:
            ids = torch.randint(0, vocab, (1, ctx), generator=gen).to(device)
            target(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        caches.append(cache)
        pasts.append(torch.ones(1, ctx, dtype=torch.bool, device=device))

    def time_point(c: int, n: int) -> float:
        ctx, cache = contexts[c], caches[c]
        parents = (torch.arange(n + 1, dtype=torch.int32) - 1)[None].to(device)
        mask = ops.tree_attention_mask(parents, torch.tensor([n + 1], dtype=torch.int32, device=device),
                                       pasts[c], dtype)
        ids = torch.randint(0, vocab, (1, n + 1), generator=gen).to(device)
        pos = torch.arange(ctx, ctx + n + 1, device=device)[None]

        def fwd():
            target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                   output_hidden_states=need_hidden, **{cache_kw: cache})

        ms = timer(fwd)
        _drop_last(cache, n + 1)
        if bar is not None:
            bar.update(1)
        return ms

    pairs: list[dict[int, list[tuple[float, float]]]] = [{n: [] for n in nodes if n > 0} for _ in contexts]
    for rep in range(reps + 1):  # the first pass warms up
        # every point of every context in a new random order each pass (a slow spell of the machine,
        # or a forward slowed by the one before it, falls on different points each time), each point
        # a plain step and the tree back to back, which goes first flipping from pass to pass: the
        # machine's speed drifts by more than a few nodes cost, and alike over both forwards of a pair
        for i in torch.randperm(len(points), generator=gen).tolist():
            c, n = points[i]
            if (rep + i) % 2:  # each point's order flips from pass to pass; half the points each way a pass
                plain = time_point(c, 0)
                tree = time_point(c, n)
            else:
                tree = time_point(c, n)
                plain = time_point(c, 0)
            if rep:
                pairs[c][n].append((plain, tree))
    if bar is not None:
        bar.close()
    return pairs


def fit_curve(nodes: Sequence[int], pairs: Mapping[int, Sequence[tuple[float, float]]],
              fit: str = "paired") -> list[float]:
    """A verification curve over ``nodes`` (``nodes[0] == 0``) from :func:`_curve_samples`'s pairs.

    * ``"paired"``: the plain step's fastest repetition, plus for each ``n`` the median of its
      pairs' differences (a stall inflates one forward of a pair, a slow minute both), fitted
      non-decreasing (:func:`isotonic`);
    * ``"fastest"``: the fastest repetition of each point on its own (noise only adds time), fitted
      non-decreasing; the plain step's over every pair, so with more samples than each size (its
      differences lean high)."""
    if fit not in CURVE_FITS:
        raise ValueError(f"cost model: fit must be one of {CURVE_FITS}, got {fit!r}")
    if len(nodes) < 2 or nodes[0] != 0:
        raise ValueError(f"cost model: need nodes starting at 0 with a tree size after it, got {list(nodes)}")
    missing = [n for n in nodes[1:] if not pairs.get(n)]
    if missing:
        raise ValueError(f"cost model: no pairs timed for tree sizes {missing}")
    plains = [p for n in nodes[1:] for p, _ in pairs[n]]
    if fit == "fastest":
        return isotonic([min(plains)] + [min(t for _, t in pairs[n]) for n in nodes[1:]])
    base = min(plains)
    extra = isotonic([0.0] + [statistics.median(t - p for p, t in pairs[n]) for n in nodes[1:]])
    return [base + max(e, 0.0) for e in extra]


def _drafter_times(target: torch.nn.Module, drafter: torch.nn.Module, contexts: list[int], methods: Sequence[str],
                   tree_builders: Mapping[str, TreeBuilder] | None, reps: int, timer: _Timer,
                   gen: torch.Generator) -> tuple[float, dict[str, float]]:
    """The drafter pass's ms and each method's tree construction ms (see :func:`measure_cost_model`)."""
    device = next(target.parameters()).device
    vocab = _vocab_size(target)
    tree_ms = {}
    ctx = contexts[-1] if contexts[-1] > 0 else 64
    hidden_size = drafter.config.hidden_size
    wdtype = drafter.dtype
    context = torch.randn(1, ctx, hidden_size, generator=gen).to(device=device, dtype=wdtype)
    cpos = torch.arange(ctx, device=device)[None]
    cmask = torch.ones(1, ctx, dtype=torch.bool, device=device)
    root = torch.randint(0, vocab, (1,), generator=gen).to(device)
    rpos = torch.tensor([ctx], device=device)
    out = None
    # the decoder keeps each committed slot's drafter keys and values (computed once per slot, when
    # it is committed), so a round's pass projects only its block: time it so
    kw = {"context_kv": drafter.context_kv(context, cpos)} if callable(getattr(drafter, "context_kv", None)) else {}

    def draft():
        nonlocal out
        out = drafter(root, rpos, context, cpos, cmask, **kw)

    draft()
    draft_ms = min(timer(draft) for _ in range(reps))
    for method in methods:
        build = (tree_builders or {}).get(method)
        if method == "ar" or build is None:
            continue
        build(out.hidden, out.base_logits, root, out.vocab)
        tree_ms[method] = min(timer(lambda: build(out.hidden, out.base_logits, root, out.vocab)) for _ in range(reps))
    return draft_ms, tree_ms


@torch.no_grad()
def measure_cost_model(target: torch.nn.Module, drafter: torch.nn.Module | None = None,
                       methods: Sequence[str] = ("dartree",), nodes: Sequence[int] = DEFAULT_NODES,
                       contexts: Sequence[int] = DEFAULT_CONTEXTS, reps: int = 10, progress: bool = False,
                       tree_builders: Mapping[str, TreeBuilder] | None = None, fit: str = "paired") -> CostModel:
    """Time this machine: the target forward over root + ``n`` nodes (an additive tree mask, a
    cache of each context length, hidden states out, as a decoding round runs it), the drafter
    pass and each method's tree construction: ``tree_builders[method](hidden, base_logits, root,
    vocab)`` (a :meth:`SpeculativeDecoder.build_tree <dartree_ext.decoding.SpeculativeDecoder.build_tree>`
    at ``max(nodes)`` nodes; methods without a builder get no tree time). Each repetition times
    every (context, n > 0) point once, in a new random order (the machine's speed drifts, and a
    forward can slow the next), as a pair: the plain step and the tree back to back, which goes
    first flipping from one repetition to the next. ``fit`` (:func:`fit_curve`) makes the curve of the pairs: ``"paired"`` (the
    default) adds the median of each size's differences to the plain step's fastest time, so a
    slow minute, which slows both forwards of a pair, does not move it; ``"fastest"`` keeps the
    fastest time of each point on its own. Either is fitted non-decreasing (:func:`isotonic`).
    ``bench/cost_curve.py`` compares the fits over repeated measurements. An EAGLE-3 drafter's
    drafting (several sequential drafter steps, as many as the decoder's rounds need) is not
    timed here: ``draft_ms`` stays 0 and the decoder prices it by its own drafted rounds
    (:meth:`SpeculativeDecoder._running_costs <dartree_ext.decoding.SpeculativeDecoder>`)."""
    from ..models.eagle3 import Eagle3Drafter
    nodes, contexts = sorted(set(int(n) for n in nodes) | {0}), sorted(set(int(c) for c in contexts))
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    timer = _Timer(device)
    gen = torch.Generator().manual_seed(0)
    if fit not in CURVE_FITS:
        raise ValueError(f"cost model: fit must be one of {CURVE_FITS}, got {fit!r}")
    if len(nodes) < 2 or reps < 1:
        raise ValueError(f"cost model: need a tree size besides 0 (each is timed against a plain step) and reps >= 1, "
                         f"got nodes {nodes} and reps {reps}")
    pairs = _curve_samples(target, drafter is not None, nodes, contexts, reps, progress, timer, gen)
    verify = [fit_curve(nodes, p, fit) for p in pairs]
    draft_ms, tree_ms = 0.0, {}
    if drafter is not None and not isinstance(drafter, Eagle3Drafter):
        draft_ms, tree_ms = _drafter_times(target, drafter, contexts, methods, tree_builders, reps, timer, gen)
    meta = {"device": device_name(device), "dtype": str(dtype).replace("torch.", ""), "reps": reps,
            "fit": fit,
            "threads": torch.get_num_threads() if device.type == "cpu" else 0, "torch": torch.__version__,
            "bf16_native": cpu_bf16_native() if device.type == "cpu" else None,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return CostModel(nodes=nodes, contexts=contexts, verify_ms=verify, draft_ms=draft_ms, tree_ms=tree_ms, meta=meta)


def cached_cost_model(target: torch.nn.Module, drafter: torch.nn.Module | None = None,
                      methods: Sequence[str] = ("dartree",), nodes: Sequence[int] = DEFAULT_NODES,
                      contexts: Sequence[int] = DEFAULT_CONTEXTS, reps: int = 10, refresh: bool = False,
                      progress: bool = False, tree_builders: Mapping[str, TreeBuilder] | None = None) -> CostModel:
    """:func:`measure_cost_model`, measured once per key (:func:`cost_key`) and kept in
    ``$DARTREE_CACHE/cost/`` (default ``~/.cache/dartree_ext/cost``); ``refresh=True`` re-measures."""
    device = next(target.parameters()).device
    key = cost_key(target, drafter, device, nodes, contexts, methods)
    path = _key_path(key)
    if not refresh and os.path.isfile(path):
        try:
            model = CostModel.load(path)
            if model.meta.get("key") == key:
                return model
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring an unreadable cost model %s (%s)", path, e)
    log.info("measuring the cost model for %s on %s (once; cached in %s)", key["dtype"], key["device"], path)
    model = measure_cost_model(target, drafter, methods, nodes, contexts, reps, progress, tree_builders)
    model.meta["key"] = key
    model.save(path)
    return model


# choosing the dtype --------------------------------------------------------------------------------
@torch.no_grad()
def forward_ms(model: torch.nn.Module, tokens: int, reps: int, context: int = 64) -> float:
    """Median time (ms) of ``model``'s forward over ``tokens`` new tokens after ``context`` cached ones
    (random ids; each of ``reps`` repetitions on a fresh cache, after one warm-up)."""
    from transformers import DynamicCache
    param = next(model.parameters())
    timer = _Timer(param.device)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (1, context), generator=gen).to(param.device)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(param.device)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    samples = []
    for rep in range(reps + 1):
        cache = DynamicCache(config=model.config)
        model(input_ids=ctx, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        ms = timer(lambda: model(input_ids=ids, use_cache=True, **{cache_kw: cache}))
        if rep:
            samples.append(ms)
    return statistics.median(samples)


def choose_forward(model: torch.nn.Module, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                   linears: Sequence[str] = ("torch", "few_rows"), tokens: Sequence[int] = (1, 9), reps: int = 5,
                   refresh: bool = False) -> tuple[torch.dtype, str, dict]:
    """The fastest target set-up on this machine: a dtype of ``dtypes`` and how the linear layers
    run (``"torch"``, or ``"few_rows"``: :func:`dartree_ext.linear.use_few_rows_linear`), by the
    sum of the forward times over ``tokens`` new tokens (a plain step and a small tree), measured
    on copies of ``model`` (every set-up in turn, ``reps`` times; the median) and cached like the
    cost model. Off the CPU: torch's linear, and
    bfloat16 (if a candidate) without measuring. Returns ``(dtype, linear, {"<dtype>[+few_rows]": ms})``."""
    from .. import __version__, build_info
    from ..attention import attention_kind
    from ..linear import LINEAR_KINDS
    param = next(model.parameters())
    if not dtypes or not linears:
        raise ValueError("choose_forward needs at least one dtype and one linear")
    for kind in linears:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linears must be among {', '.join(LINEAR_KINDS)}, got {kind!r}")
    if param.device.type != "cpu":
        linears = ("torch",)
        if torch.bfloat16 in dtypes:
            return torch.bfloat16, "torch", {}
    key = {"kind": "dtype", "version": COST_MODEL_VERSION, "dartree_ext": __version__, "torch": torch.__version__,
           "model": model_digest(model), "device": device_name(param.device),
           "threads": torch.get_num_threads(), "candidates": [str(c) for c in dtypes], "tokens": list(tokens),
           "attention": attention_kind(model)}
    if list(linears) != ["torch"]:
        key["linears"] = list(linears)
        key["few_rows_linear"] = build_info().get("few_rows_linear")
    path = _key_path(key)
    times = None if refresh else _read_choice(path, key)
    if times is None:
        times = _time_setups(model, dtypes, linears, tokens, reps)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"key": key, "ms": times}, f)
    best = min(times, key=times.get)
    name, _, kind = best.partition("+")
    return getattr(torch, name), (kind or "torch"), times


def _read_choice(path: str, key: dict) -> dict | None:
    """The cached forward times of :func:`choose_forward` for ``key``, or ``None``."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        return saved["ms"] if saved.get("key") == key else None
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring an unreadable dtype choice %s (%s)", path, e)
        return None


def _time_setups(model, dtypes, linears, tokens, reps) -> dict:
    """Median forward ms of every (dtype, linear) set-up, each timed once per repetition in turn
    (so the machine's drift touches all alike), on copies of ``model`` in the other dtypes;
    ``model``'s own linear set-up is restored."""
    import copy

    from ..linear import DEFAULT_MAX_ROWS, few_rows_max_rows, linear_kind, set_linear
    param = next(model.parameters())
    original, max_rows = linear_kind(model), few_rows_max_rows(model)
    samples: dict[str, list[float]] = {}
    try:
        trials = [(dtype, model if param.dtype == dtype else copy.deepcopy(model).to(dtype)) for dtype in dtypes]
        for _ in range(reps):
            for dtype, trial in trials:
                for kind in linears:
                    set_linear(trial, kind)
                    name = str(dtype).replace("torch.", "") + ("+few_rows" if kind == "few_rows" else "")
                    samples.setdefault(name, []).append(sum(forward_ms(trial, n, 1) for n in tokens))
    finally:
        set_linear(model, original, max_rows or DEFAULT_MAX_ROWS)
    return {name: statistics.median(values) for name, values in samples.items()}


def resolve_forward(model: torch.nn.Module, dtype: str | torch.dtype = "auto",
                    linear: str = "auto") -> tuple[torch.nn.Module, torch.dtype, str, dict]:
    """Apply the target set-up a command line asks for: ``dtype`` (``"auto"``, a dtype name or a
    ``torch.dtype``) and ``linear`` (``"auto"`` or one of ``LINEAR_KINDS``). Each ``"auto"`` is
    :func:`choose_forward`'s pick (measured once, cached); off the CPU the linear layers are
    torch's. ``model`` is moved to the dtype in place. Returns ``(model, dtype, linear, ms)``
    with ``ms`` the measured forward times (``{}`` when nothing was measured)."""
    from ..linear import LINEAR_KINDS, set_linear
    if linear != "auto" and linear not in LINEAR_KINDS:
        raise ValueError(f"linear must be 'auto' or one of {', '.join(LINEAR_KINDS)}, got {linear!r}")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
        dtype = getattr(torch, dtype)
    if next(model.parameters()).device.type != "cpu":
        linear = "torch"
    ms: dict = {}
    if dtype == "auto" or linear == "auto":
        dtypes = (torch.float32, torch.bfloat16) if dtype == "auto" else (dtype,)
        dtype, linear, ms = choose_forward(model, dtypes, LINEAR_KINDS if linear == "auto" else (linear,))
    model = model.to(dtype)
    set_linear(model, linear)
    return model, dtype, linear, ms


def choose_dtype(model: torch.nn.Module, candidates: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                 tokens: Sequence[int] = (1, 9), reps: int = 3, refresh: bool = False) -> tuple[torch.dtype, dict]:
    """The fastest of ``candidates`` for this model on this machine with torch's linear layers
    (:func:`choose_forward` with ``linears=("torch",)``). Returns ``(dtype, {dtype name: ms})``."""
    dtype, _, times = choose_forward(model, candidates, ("torch",), tokens, reps, refresh)
    return dtype, times
