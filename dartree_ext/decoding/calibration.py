"""Node acceptance, calibrated online: the automatic budget's ``E[accepted(n)]``.

* :class:`AcceptanceCalibrator`: P(node accepted | its tree score), per score bin, learned online
  from the rounds actually verified (isotonic in the score). ``E[accepted(n)]`` of the best ``n``
  nodes (best-first, so every prefix is a valid tree) is the sum of their probabilities.
* :class:`DepthCalibrator`: one such calibrator per depth class (a node's score means more or
  less at different depths), saved with a drafter as ``calibration.json``.
* :class:`AcceptanceLevel`: a running correction of a calibration's level, per depth, from what
  the rounds accept.
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence

import numpy as np
import torch

log = logging.getLogger(__name__)


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
