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
* :class:`AcceptanceCalibrator`: P(node accepted | its tree score), per score bin, learned online
  from the rounds actually verified. ``E[accepted(n)]`` of the best ``n`` nodes (best-first, so
  every prefix is a valid tree) is the sum of their probabilities.
"""
from __future__ import annotations

import bisect
import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence

import numpy as np
import torch

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


# measuring and caching live in .profiling; their public names are importable from here too
from .profiling import (  # noqa: E402,F401
    DEFAULT_CONTEXTS, DEFAULT_NODES, cache_dir, cached_cost_model, choose_dtype, choose_forward, cost_key,
    cpu_bf16_native, device_name, fit_curve, forward_ms, measure_cost_model, model_digest, resolve_forward)
