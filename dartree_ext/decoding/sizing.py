"""How big each round's tree is: :class:`FixedBudget` (the method's tree at ``budget`` nodes,
every round) or :class:`AutoBudget` (``budget="auto"``: each round's tree cut to the size that
maximises expected tokens per millisecond under the measured cost model).

An :class:`AutoBudget` is one ``generate`` call's sizing state (the back-off after plain steps,
the recent sizes and depths, the call's acceptance level); what it learns that outlives the call
is passed in: the calibrator (per method and regime, on the decoder) and the
:class:`RunningCosts` (the cost model's corrections from measured rounds). The decoder asks it,
each round, in this order: :meth:`~AutoBudget.rests` (does the drafter rest?),
:meth:`~AutoBudget.draft_positions` and :meth:`~AutoBudget.build_cap` (how much to draft and
build), :meth:`~AutoBudget.choose` (the cut), :meth:`~AutoBudget.predict_round`, then after
verification :meth:`~AutoBudget.observe_round`, :meth:`~AutoBudget.calibrate` and
:meth:`~AutoBudget.record`.
"""
from __future__ import annotations

import logging
import math

import numpy as np
import torch

from ..tree import Tree, prune
from .calibration import AcceptanceCalibrator, AcceptanceLevel, DepthCalibrator
from .cost import CostModel, choose_size, running_average
from .lookup import LookupStats, new_nodes
from .stopping import Backoff
from .trees import plain_tree

log = logging.getLogger(__name__)

CALIBRATION_PRIOR_TRIALS = 32.0  # a drafter's saved calibration counts at most this many trials per bin
RUNNING_WEIGHT = 0.2  # a new round's weight in the running costs
OVERHEAD_WEIGHT = 0.1  # ... and in the running bookkeeping ms
RECENT_ROUNDS = 16
# a round that probes the drafter after plain steps drafts at most this many positions and builds
# at most this many nodes; the next round grows if the probe's tree paid
PROBE_DEPTH, PROBE_CAP = 4, 16


class RunningCosts:
    """The cost model's corrections measured as rounds run, kept across calls: the bookkeeping
    ms, the drafter pass plus tree ms, and the ratio of each round's verification to the cost
    curve's figure (each a running average; ``None``: no round seen yet)."""

    def __init__(self) -> None:
        self.overhead_ms: float | None = None
        self.verify_scale: float | None = None
        self.drafted_ms: float | None = None

    def observe_overhead(self, ms: float) -> None:
        self.overhead_ms = running_average(self.overhead_ms, ms, OVERHEAD_WEIGHT)


class Learned:
    """What a decoder learns across its calls, per regime (``"greedy"``: T = 0, ``"sample"``,
    ``"sampled_draft"``; acceptance differs): node-acceptance calibrators and the lookup
    branch's statistics."""

    def __init__(self, method: str, drafter=None, calibrator: AcceptanceCalibrator | DepthCalibrator | None = None):
        if calibrator is not None and not isinstance(calibrator, DepthCalibrator):
            calibrator = DepthCalibrator([calibrator])  # one calibrator for every depth
        self.method, self.drafter, self.given = method, drafter, calibrator
        self.calibrators: dict[str, DepthCalibrator] = {}
        self._lookup: dict[str, LookupStats] = {}

    def calibrator(self, regime: str) -> DepthCalibrator:
        """The regime's calibrator, per depth class (:class:`DepthCalibrator`), started from the
        drafter's saved counts for this method (``calibration.json``, capped at
        :data:`CALIBRATION_PRIOR_TRIALS` per bin; counts saved without depths start every class)
        when it has them, else from the default prior. A calibrator given to the decoder serves
        every depth (an ``AcceptanceCalibrator``) or as it is (a ``DepthCalibrator``)."""
        if self.given is not None:
            return self.given
        if regime not in self.calibrators:
            saved = (getattr(self.drafter, "calibration", None) or {}).get(f"{self.method}@{regime}")
            cal = DepthCalibrator.fresh()
            if saved is not None:
                try:
                    cal = DepthCalibrator.from_state(saved, max_trials=CALIBRATION_PRIOR_TRIALS)
                except ValueError as e:
                    log.warning("ignoring the drafter's calibration for %s@%s: %s", self.method, regime, e)
            self.calibrators[regime] = cal
        return self.calibrators[regime]

    def lookup_stats(self, regime: str) -> LookupStats:
        """The regime's :class:`LookupStats` (``"greedy"``, ``"sample"``, ``"corpus-greedy"``,
        ``"corpus-sample"``)."""
        if regime not in self._lookup:
            self._lookup[regime] = LookupStats(regime=regime)
        return self._lookup[regime]


class FixedBudget:
    """A fixed budget: every round drafts every position and builds the method's whole tree."""

    auto = False
    skip = backoff = 0
    chosen_expected = 0.0

    def rests(self) -> bool:
        return False

    def predict(self, tree: Tree, context: int, drafted: bool) -> None:
        return None

    def observe(self, tree: Tree, context: int, drafted: bool, draft_tree_s: float, verify_s: float) -> None:
        pass

    def draft_positions(self, full: int) -> int:
        return full

    def build_cap(self) -> None:
        return None


class AutoBudget:
    """``budget="auto"`` for one call of ``method``: trees built with at most ``budget`` nodes
    (``max_budget``), cut by ``cost_model`` (corrected by ``costs``), node acceptance from
    ``calibrator`` (``estimator="adaptive"``: scaled by the call's level)."""

    auto = True

    def __init__(self, method: str, budget: int, cost_model: CostModel, calibrator: DepthCalibrator,
                 estimator: str = "score", costs: RunningCosts | None = None,
                 lookup_stats: LookupStats | None = None) -> None:
        self.method, self.budget, self.cost_model = method, budget, cost_model
        self.calibrator, self.estimator = calibrator, estimator
        self.costs = RunningCosts() if costs is None else costs
        self.lookup_stats = LookupStats() if lookup_stats is None else lookup_stats
        self.level = AcceptanceLevel()  # estimator="adaptive"
        self.pause = Backoff()  # the drafter's rest after plain steps
        self.recent_depths: list[int] = []
        self.recent_sizes: list[int] = []
        self.chosen_expected = 0.0  # E[accepted] of the round's chosen nodes (graft included)

    def expected_accepted(self, tree: Tree, accept_prob: torch.Tensor | None = None) -> torch.Tensor:
        """``E[n]`` = expected accepted draft tokens of each row's best ``n`` nodes, summed over
        the rows, for ``n = 0 .. N - 1`` (best-first by score, the order :func:`prune` keeps).
        A node's probability is its calibrated score, or with ``accept_prob [B, D]`` (the
        verification head's) ``accept_prob[depth - 1]`` times its path probability relative to
        the best node of its depth."""
        if accept_prob is None:
            return torch.tensor(self.expected_list(tree), dtype=torch.float32)
        scores = tree.scores[:, 1:].float()
        valid = torch.arange(1, tree.tokens.shape[1], device=scores.device)[None] < tree.num_nodes[:, None]
        scores = torch.where(valid, scores, float("-inf"))
        # the verification head's probabilities: on the tree's device, then one transfer
        depth = tree.depths[:, 1:].long().clamp(min=0)
        best = torch.full((scores.shape[0], int(depth.max()) + 1), float("-inf"), device=scores.device)
        best = best.scatter_reduce(1, depth, scores, "amax")
        rel = torch.where(valid, (scores - best.gather(1, depth)).exp(), 0.0)
        at_depth = torch.cat([torch.ones_like(accept_prob[:, :1]), accept_prob.float()], 1)
        p = (at_depth.gather(1, depth.clamp(max=at_depth.shape[1] - 1)) * rel).clamp(max=1.0)
        p, scores = torch.where(valid, p, 0.0).cpu(), scores.cpu()
        order = scores.argsort(dim=1, descending=True, stable=True)
        return torch.cat([torch.zeros(1), p.gather(1, order).cumsum(1).sum(0)])

    def expected_list(self, tree: Tree) -> list[float]:
        """:meth:`expected_accepted` from calibrated scores, as a list, on the host in plain Python
        (a round's few dozen nodes: right after the target's forward a library's code paths are
        cold, and each NumPy or torch call costs tens of microseconds)."""
        scores, depths, num = _host_lists(tree, tree.scores, tree.depths)
        width = tree.tokens.shape[1]
        total = [0.0] * width
        factor = self.level.factor if self.estimator == "adaptive" else 1.0
        for row_scores, row_depths, n in zip(scores, depths, num):
            s, d = row_scores[1:n], row_depths[1:n]
            p = self.calibrator.predict_list(s, d)
            if factor != 1.0:
                p_max = self.level.p_max
                p = [min(v * factor ** max(k, 0), p_max) for v, k in zip(p, d)]
            # best first (ties in node order, NaN as -inf); nodes without a drafter score (-inf) add nothing
            order = sorted(range(len(s)), key=lambda j: s[j] if s[j] == s[j] else -math.inf, reverse=True)
            acc = 0.0
            for i, j in enumerate(order, start=1):
                if s[j] > -math.inf:
                    acc += p[j]
                total[i] += acc
            for i in range(len(s) + 1, width):
                total[i] += acc
        return total

    def choose_tree(self, tree: Tree, context: int, accept_prob: torch.Tensor | None = None) -> tuple[Tree, int]:
        """``budget="auto"``: the tree cut to its best ``n`` nodes (``n`` chosen by the cost
        model; the root alone for ``n = 0``) and ``n``. ``accept_prob``: as in
        :meth:`expected_accepted`."""
        expected = self.expected_list(tree) if accept_prob is None else self.expected_accepted(tree, accept_prob).tolist()
        batch = tree.tokens.shape[0]
        overhead, scale, drafted = self.running_costs()
        n, _ = choose_size(expected, self.cost_model, self.method, context, batch, overhead, scale, drafted)
        self.chosen_expected = float(expected[n])
        if n == 0:
            return plain_tree(tree.tokens[:, 0]), 0
        if n < tree.tokens.shape[1] - 1:
            tree = prune(tree, n)
        return tree, n

    def predict(self, tree: Tree, context: int, drafted: bool) -> tuple[float, float] | None:
        """:meth:`predict_round` for the tree about to be verified (``None`` for the root alone)."""
        rows, width = tree.tokens.shape
        return self.predict_round(rows, width, context, drafted) if width > 1 else None

    def observe(self, tree: Tree, context: int, drafted: bool, draft_tree_s: float, verify_s: float) -> None:
        """:meth:`observe_round` for the tree just verified."""
        self.observe_round(tree.tokens.shape[0], tree.tokens.shape[1], context, drafted, draft_tree_s, verify_s)

    def predict_round(self, rows: int, width: int, context: int, drafted: bool) -> tuple[float, float]:
        """What the chooser expects of a round about to verify ``rows`` trees of ``width`` columns
        over ``context`` cache slots: (tokens, ms)."""
        overhead, scale, drafted_ms = self.running_costs()
        ms = scale * self.cost_model.verify(rows * width - 1, context) + overhead
        if drafted:
            ms += drafted_ms
        return rows + self.chosen_expected, ms

    def running_costs(self) -> tuple[float, float, float]:
        """``(overhead ms, verify scale, drafter pass + tree ms)`` as the chooser prices a round.
        A measured cost model (``overhead_ms`` None) is corrected by the rounds as they run: the
        bookkeeping, the drafter pass plus tree construction, and the ratio of each round's
        verification to the curve's figure, each a running average
        (:meth:`observe_round`), so a cost model measured in a fast or slow minute of a shared
        machine, or missing a cost of the real round, does not skew the choice. A given cost
        model (``overhead_ms`` set, e.g. :meth:`CostModel.from_curve`) is taken as it is."""
        cost = self.cost_model
        modelled = cost.draft_ms + cost.tree(self.method)
        if cost.overhead_ms is not None:
            return cost.overhead_ms, 1.0, modelled
        return (self.costs.overhead_ms or 0.0, 1.0 if self.costs.verify_scale is None else self.costs.verify_scale,
                modelled if self.costs.drafted_ms is None else self.costs.drafted_ms)

    def observe_round(self, rows: int, width: int, context: int, drafted: bool, draft_tree_s: float,
                      verify_s: float) -> None:
        """Fold one round's measured times into the running costs (:meth:`running_costs`):
        ``drafted`` (the drafter ran) rounds give the drafter pass plus tree construction
        (``draft_tree_s``); every round gives its verification time over the curve's figure for
        its width (clamped to 1/3..3, so one stall cannot swing it)."""
        cost, costs = self.cost_model, self.costs
        if cost is None or cost.overhead_ms is not None:
            return
        modelled = cost.verify(rows * width - 1, context)
        ratio = min(3.0, max(1 / 3, 1e3 * verify_s / modelled))
        costs.verify_scale = running_average(costs.verify_scale, ratio, RUNNING_WEIGHT)
        if drafted:
            costs.drafted_ms = running_average(costs.drafted_ms, 1e3 * draft_tree_s, RUNNING_WEIGHT)

    def build_cap(self) -> int | None:
        """budget="auto": the nodes a round's tree is built with, twice the largest size chosen
        in the last rounds plus 4 (``None``, the full ``max_budget``, until 4 rounds have been
        seen). The chooser then looks at no more nodes than that. The best ``n <= cap`` nodes are
        the same as those of the full build: for ``ddtree`` the heap pops them first, and for
        ``dartree`` (depth bonus <= 0, so a child never outscores its parent) they are among the
        best ``cap`` of each depth, so a width of ``cap`` per depth keeps them. It spares the
        expansion work of nodes no round is going to verify. A probe of the drafter after plain
        steps builds :data:`PROBE_CAP` nodes at most."""
        if self.backoff:  # a probe after plain steps
            return min(self.budget, PROBE_CAP)
        if len(self.recent_sizes) < 4:
            return None
        return min(self.budget, 2 * max(self.recent_sizes) + 4)

    def draft_positions(self, full: int) -> int:
        """budget="auto": draft positions to build trees from: 2 deeper than the deepest tree
        chosen in the last rounds (all of them until 4 rounds have been seen), so the search
        can still grow; a deeper tree is never cut below what was chosen lately. A probe after
        plain steps drafts :data:`PROBE_DEPTH` positions at most."""
        if self.backoff:  # a probe after plain steps
            return min(full, PROBE_DEPTH)
        if len(self.recent_depths) < 4:
            return full
        return max(1, min(full, max(self.recent_depths) + 2))

    def lookup_steps(self, tree: Tree, chains: list[list[int]], ngrams: list[int], added: list[list[int]],
                      chosen: int | None, context: int, new: list[list[bool]] | None = None,
                      sources: list[LookupStats] | None = None) -> int:
        """How many continuation tokens to graft (0..longest chain): the step maximising
        ``(rows + E[accepted]) / round ms``, where a grafted token adds its path's acceptance
        probability (:class:`LookupStats`) unless the drafter's tree already had it, and the
        round's cost grows with the widest row."""
        cost, rows = self.cost_model, len(chains)
        overhead, scale, drafted_ms = self.running_costs()
        base_width = tree.tokens.shape[1]
        fixed = (drafted_ms if chosen else 0.0) + overhead
        num = tree.num_nodes.tolist()
        new = [new_nodes(a) for a in added] if new is None else new  # (_new_nodes of each row's added)
        sources = [self.lookup_stats] * rows if sources is None else sources  # each row's continuation's statistics
        probs = [src.path_probs(n, len(c), fresh) if c else [] for c, n, fresh, src in zip(chains, ngrams, new, sources)]
        expected = rows + self.chosen_expected
        best_steps, best_rate, best_expected = 0, expected / (fixed + scale * cost.verify(rows * base_width - 1, context)), expected
        for d in range(1, max(len(c) for c in chains) + 1):
            for b, c in enumerate(chains):
                if d <= len(probs[b]) and new[b][d - 1]:  # a new node (within the learned depths)
                    expected += probs[b][d - 1]
            width = max(base_width, max(num[b] + (added[b][min(d, len(added[b])) - 1] if added[b] else 0)
                                        for b in range(rows)))
            rate = expected / (fixed + scale * cost.verify(rows * width - 1, context))
            if rate > best_rate * (1 + 1e-9):
                best_steps, best_rate, best_expected = d, rate, expected
        self.chosen_expected = best_expected - rows  # the round's prediction now includes the graft
        return best_steps

    def choose(self, tree: Tree, context: int, accept_prob: torch.Tensor | None) -> tuple[Tree, int]:
        """:meth:`choose_tree` on a drafted tree, and the back-off after a plain step (``n = 0``:
        no tree pays; the drafter rests 1, 2, 4, ... rounds)."""
        tree, chosen = self.choose_tree(tree, context, accept_prob)
        if chosen == 0:
            self.pause.lost()
        else:
            self.pause.paid()  # record() keeps the verified tree's depth
        return tree, chosen

    def record(self, chosen: int, deepest: int) -> None:
        """A verified drafted round: its size and depth, for the next rounds' build cap and
        drafted positions."""
        self.recent_depths = (self.recent_depths + [deepest])[-RECENT_ROUNDS:]
        self.recent_sizes = (self.recent_sizes + [chosen])[-RECENT_ROUNDS:]

    def rests(self) -> bool:
        """Whether the drafter rests this round (the back-off after a plain step)."""
        return self.pause.rests()

    @property
    def skip(self) -> int:
        """Rounds the drafter still rests."""
        return self.pause.skip

    @property
    def backoff(self) -> int:
        """The current rest's length (0: the last drafted round paid)."""
        return self.pause.backoff

    @backoff.setter
    def backoff(self, value: int) -> None:
        self.pause.backoff = value

    def calibrate(self, tree: Tree, accept_nodes: torch.Tensor) -> None:
        """Feed the verified draft nodes (accepted or not) to the calibrator."""
        scores, depths, path, num = _host_lists(tree, tree.scores, tree.depths, accept_nodes)
        batch_scores, batch_depths, batch_hits = [], [], []
        for row_scores, row_depths, row_path, n in zip(scores, depths, path, num):
            on_path = {int(j) for j in row_path if j >= 0}
            for j in range(1, n):
                if row_scores[j] > -math.inf:  # not the grafted lookup nodes: they have no drafter score
                    batch_scores.append(row_scores[j])
                    batch_depths.append(row_depths[j])
                    batch_hits.append(j in on_path)
        self.learn(batch_scores, batch_depths, batch_hits)

    def calibrate_unverified(self, tree: Tree, target_first: torch.Tensor) -> None:
        """A round that verified no draft still tells which depth-1 nodes were right (the
        target's token after the root): feed those, so a pessimistic calibration can recover."""
        scores, depths, parents, tokens, num = _host_lists(tree, tree.scores, tree.depths, tree.parents,
                                                                tree.tokens)
        right = target_first.tolist()
        batch_scores, batch_depths, batch_hits = [], [], []
        for b, n in enumerate(num):
            for j in range(1, n):
                if parents[b][j] == 0:
                    batch_scores.append(scores[b][j])
                    batch_depths.append(depths[b][j])
                    batch_hits.append(tokens[b][j] == right[b])
        self.learn(batch_scores, batch_depths, batch_hits)

    def learn(self, scores: list[float], depths: list[int], hits: list[bool]) -> None:
        """The checked draft nodes' scores, depths (>= 1) and whether each was accepted, to the
        calibrator (and, ``estimator="adaptive"``, to the call's level, against what the
        calibration predicted for them before this round)."""
        if not scores:
            return
        if self.estimator == "adaptive":
            predicted = self.calibrator.predict_list(scores, depths)
            self.level.update(np.asarray(predicted, dtype=np.float64), np.asarray(depths, dtype=np.int64),
                               np.asarray(hits, dtype=np.float64))
        self.calibrator.update_list(scores, hits, depths)


def _host_lists(tree: Tree, *columns: torch.Tensor) -> list:
    """``columns`` (each ``[B, N]``) as nested Python lists, then ``tree.num_nodes`` as a
    list; on a GPU in one transfer (float64 holds every int32 / float32 value exactly)."""
    if tree.tokens.device.type == "cpu":
        return [c.tolist() for c in columns] + [tree.num_nodes.tolist()]
    n = tree.tokens.shape[1]
    host = torch.cat([c.double() for c in columns] + [tree.num_nodes[:, None].double()], 1).cpu()
    out = [host[:, i * n:(i + 1) * n].tolist() for i in range(len(columns))]
    kinds = [c.dtype.is_floating_point for c in columns]
    out = [rows if floating else [[int(v) for v in row] for row in rows] for rows, floating in zip(out, kinds)]
    return out + [[int(v) for v in host[:, -1].tolist()]]
