"""Speculative decoding of a HuggingFace causal LM with draft trees, lossless at any temperature.

:class:`SpeculativeDecoder` holds what outlives a call: the target, the drafter, the resolved
:class:`~dartree_ext.decoding.config.DecodingConfig`, the method's tree builder and what the
automatic budget learns across calls. ``generate`` starts a
:class:`~dartree_ext.decoding.state.Session` (the call's own state), prefills the prompts and runs
:func:`~dartree_ext.decoding.phases.decode_round` until every request is done: the round's
phases are functions in :mod:`~dartree_ext.decoding.phases`.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
from collections.abc import Sequence
from typing import Iterable

import torch

from .. import ops
from ..linear import linear_as
from ..models import BlockDrafter
from ..models.eagle3 import Eagle3Drafter
from ..tree import Tree
from . import phases
from .config import CORPUS_OFF, DecodingConfig, DecodingConfigWarning, resolve
from .calibration import AcceptanceCalibrator, DepthCalibrator
from .cost import CostModel
from .eagle import StopRule
from .hf import check_prompts
from .lookup import CorpusIndex
from .methods import AUTO_METHODS, EAGLE3_METHODS, METHODS, Method  # noqa: F401 (AUTO_METHODS, METHODS re-exported)
from .methods import method as method_entry
from .profiling import cached_cost_model
from .sizing import AutoBudget, FixedBudget, Learned, RunningCosts
from .state import DecodingStats, GenerationOutput, PhaseHook, RequestStats, Session  # noqa: F401 (re-exported)
from .trees import BUILDERS, TreeRequest, plain_tree

log = logging.getLogger(__name__)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(progress: bool, total: int, desc: str):
    """A tqdm bar of ``total`` tokens when ``progress``, else one that does nothing."""
    if not progress:
        return _NoBar()
    from tqdm.auto import tqdm
    return tqdm(total=total, desc=desc, unit="tok")


def left_pad(prompts, pad_id: int = 0, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids int64[B, L], attention_mask int64[B, L])`` for token-id lists of different
    lengths, padded on the left (what :meth:`SpeculativeDecoder.generate` and HF expect)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        if len(p):
            ids[b, width - len(p):] = torch.as_tensor(p, dtype=torch.int64)
            mask[b, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def drafter_fits(method: str, drafter) -> bool:
    """Whether ``method`` decodes with ``drafter``'s kind: the EAGLE-3 methods with an
    :class:`Eagle3Drafter`, the other drafting methods with a block drafter (``ar`` and ``lookup``
    with anything)."""
    spec = method_entry(method)
    if not spec.drafts or drafter is None:
        return True
    return spec.eagle3 == isinstance(drafter, Eagle3Drafter)


def _check_drafter_kind(spec: Method, drafter, width, K: int) -> None:
    """The EAGLE-3 methods take an :class:`Eagle3Drafter` (at most ``ops.MAX_TREE_NODES``
    drafted nodes a round), the other drafting methods a block drafter."""
    if not spec.drafts or drafter is None:
        return
    if spec.eagle3 and not isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"method {spec.name!r} needs an Eagle3Drafter, got {type(drafter).__name__}")
    if not spec.eagle3 and isinstance(drafter, Eagle3Drafter):
        raise ValueError(f"method {spec.name!r} needs a block drafter; an Eagle3Drafter decodes with "
                         f"{' or '.join(EAGLE3_METHODS)}")
    if spec.eagle3:
        c, steps = min(K, width), drafter.config.num_steps
        drafted = 1 + c + (steps - 1) * width * c
        if drafted > ops.MAX_TREE_NODES:
            raise ValueError(f"method {spec.name!r} with width={width}, K={K} and {steps} steps drafts up to {drafted} "
                             f"nodes a round; the tree ops take at most {ops.MAX_TREE_NODES}: lower width or K")


class SpeculativeDecoder:
    """Speculative decoding of ``target`` with ``drafter`` by ``method`` (one of
    :data:`~dartree_ext.decoding.methods.REGISTRY`'s entries; :data:`METHODS` take a block
    drafter or none, :data:`EAGLE3_METHODS` an :class:`~dartree_ext.models.eagle3.Eagle3Drafter`).

    The settings are those of :class:`~dartree_ext.decoding.config.DecodingConfig` (``None``:
    the method's default; :meth:`from_config` takes a config), resolved by
    :func:`~dartree_ext.decoding.config.resolve`, which fills the defaults and reports each
    setting given that the method does not read (a
    :class:`~dartree_ext.decoding.config.DecodingConfigWarning` naming it) or refuses it. The
    default budget is ``"auto"``; ``width`` 12, ``K`` 64, ``depth_bonus`` -0.2, ``max_budget`` 64.

    * ``budget`` = draft nodes per tree (B, root excluded) for ``ddtree``, ``dartree``,
      ``dartree_fixed`` (``budget // depth`` per depth), ``seq_heap`` and the EAGLE-3 methods;
      ``width`` = W, kept per depth by ``dartree`` (or per-depth widths ``(w1, w2, ...)``), the
      frontier per step of the EAGLE-3 methods; ``K`` = candidates per position; ``depth_bonus``
      = beta.
    * ``budget="auto"``: each round's tree cut to the size that pays under ``cost_model``
      (measured once per machine, model and dtype and cached when not given), node acceptance
      from ``calibrator`` (default: per depth, from the drafter's ``calibration.json``), a plain
      step and a back-off when no tree pays (:class:`~dartree_ext.decoding.sizing.AutoBudget`).
    * ``early_exit=p``: draft up to the verification head's predicted first rejection
      (``eagle3_vh``: 0.5, or a :data:`~dartree_ext.decoding.eagle.StopRule`); ``estimator``
      ``"score"`` / ``"adaptive"`` / ``"vh"``: where ``budget="auto"`` reads node acceptance.
    * ``lookup=L``: up to ``L`` tokens of the request's own context (or of ``corpus``, a
      :class:`~dartree_ext.decoding.lookup.CorpusIndex`, at T = 0 unless ``corpus_sampling``)
      grafted into every tree as one more branch; method ``lookup`` is that branch alone.
    * ``sampled_draft=True`` (``chain``, T > 0): the chain drawn from the drafter, verified by
      speculative sampling (:mod:`~dartree_ext.decoding.sampled`).

    Per-call state lives in the call's :class:`~dartree_ext.decoding.state.Session`; the decoder
    keeps what outlives a call (calibrators, lookup statistics, the cost model's running
    corrections) and, for inspection, the latest call's sizing (:attr:`sizing`). The detail of
    every setting: ``docs/decoding.md``.
    """

    def __init__(self, target: torch.nn.Module, drafter: BlockDrafter | Eagle3Drafter | None = None,
                 method: str = "dartree", budget: int | str | None = None, width: int | Sequence[int] | None = None,
                 K: int | None = None, depth_bonus: float | None = None, sync_timing: bool = True,
                 cost_model: CostModel | None = None, max_budget: int | None = None,
                 calibrator: AcceptanceCalibrator | DepthCalibrator | None = None, early_exit: float | StopRule | None = None,
                 estimator: str | None = None, lookup: int | None = None, sampled_draft: bool | None = None,
                 corpus: CorpusIndex | None = None, corpus_sampling: bool | None = None) -> None:
        if corpus is not None and not isinstance(corpus, CorpusIndex):
            raise TypeError(f"corpus must be a CorpusIndex, got {type(corpus).__name__}")
        config = DecodingConfig(method=method, budget=budget, width=width, K=K, depth_bonus=depth_bonus,
                                early_exit=early_exit, estimator=estimator, lookup=lookup,
                                corpus=CORPUS_OFF if corpus is None else "given", corpus_sampling=corpus_sampling,
                                sampled_draft=sampled_draft, max_budget=max_budget)
        self._setup(target, drafter, resolve(config), corpus, cost_model, calibrator, sync_timing)

    @classmethod
    def from_config(cls, target: torch.nn.Module, drafter: BlockDrafter | Eagle3Drafter | None,
                    config: DecodingConfig, corpus: CorpusIndex | None = None, cost_model: CostModel | None = None,
                    calibrator: AcceptanceCalibrator | DepthCalibrator | None = None,
                    sync_timing: bool = True) -> "SpeculativeDecoder":
        """A decoder for ``config`` (:class:`~dartree_ext.decoding.config.DecodingConfig`, resolved
        here; ``config.corpus`` names where ``corpus`` came from: without a ``corpus`` index, none is
        used). ``config.temperature`` and the other sampling settings are :meth:`generate`'s."""
        if config.compile:
            raise ValueError("a compiled config decodes with StaticRound.from_config, not SpeculativeDecoder")
        if corpus is not None and not isinstance(corpus, CorpusIndex):
            raise TypeError(f"corpus must be a CorpusIndex, got {type(corpus).__name__}")
        if corpus is None:
            config = dataclasses.replace(config, corpus=CORPUS_OFF)
        dec = cls.__new__(cls)
        dec._setup(target, drafter, resolve(config), corpus, cost_model, calibrator, sync_timing)
        return dec

    def _setup(self, target, drafter, config: DecodingConfig, corpus, cost_model, calibrator, sync_timing) -> None:
        """Set up a decoder for a resolved ``config``."""
        spec = self.spec = config.spec
        self.config = config
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise TypeError(f"cost_model must be a CostModel, got {type(cost_model).__name__}")
        _check_drafter_kind(spec, drafter, config.width, config.K)
        self.auto = config.auto
        self.budget = config.max_budget if config.budget == "auto" else config.budget
        self.lookup = config.lookup
        self.corpus = corpus if config.corpus != CORPUS_OFF else None  # (a corpus continuation is a lookup branch)
        self.corpus_sampling = config.corpus_sampling
        self._warn_corpus = config.corpus not in ("auto", CORPUS_OFF)  # a corpus the user named
        if not spec.drafts:
            drafter = None  # not used: no drafter pass, no drafter context
        else:
            if drafter is None:
                raise ValueError(f"method {spec.name!r} needs a drafter")
            drafter.attach(target)  # raises on a target mismatch
        self.early_exit, self.estimator, self.sampled_draft = config.early_exit, config.estimator, config.sampled_draft
        self.uses_vh = spec.drafts and not spec.eagle3 and (
            self.early_exit is not None or (self.auto and self.estimator == "vh"))
        self.target, self.drafter, self.method = target, drafter, spec.name
        # the drafter's keys/values of its context, kept per slot instead of recomputed per round
        # (False: projected anew every round), and the context of committed slots queued while
        # the drafter rests (False: made every round); both only for tests and ablations
        self.keep_context_kv = callable(getattr(drafter, "context_kv", None))
        self.defer_context = True
        self.width, self.K, self.depth_bonus = config.width, config.K, config.depth_bonus
        self.sync_timing = sync_timing
        self.cost_model = cost_model
        self.learned = Learned(spec.name, drafter, calibrator)  # calibrators and lookup statistics, across calls
        self.running_costs = RunningCosts()  # the cost model's corrections, kept across calls
        self.sizing = self._sizing_for(0.0)  # the latest call's (a new one per generate call)
        self._head = drafter.export_head(dtype=drafter.dtype) if drafter is not None and spec.head else None
        params = inspect.signature(target.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    # trees ----------------------------------------------------------------------------------
    def build_tree(self, hidden: torch.Tensor | None, base_logits: torch.Tensor | None,
                   root: torch.Tensor, vocab: torch.Tensor | None = None, cap: int | None = None) -> Tree:
        """This decoder's draft tree for one drafter pass (``hidden [B, D', H]``,
        ``base_logits [B, D', V]``, ``root int64[B]``; with a draft vocabulary, ``base_logits
        [B, D', V']`` and ``vocab int64[V']`` its target ids). ``cap``: build only what the best
        ``cap`` nodes need (see :meth:`AutoBudget.build_cap <dartree_ext.decoding.sizing.AutoBudget.build_cap>`)."""
        spec = self.spec
        if spec.tree is None:
            return plain_tree(root)
        return BUILDERS[spec.tree](TreeRequest(hidden, base_logits, root, vocab, budget=self.budget, width=self.width,
                                               K=self.K, depth_bonus=self.depth_bonus, scored=self.auto,
                                               cap=cap if spec.capped else None, head=self._head,
                                               project=self._project))

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        """The correction head's ``z = W_z H + b1``, run the way the drafter's own linear layers
        run (``few_rows_linear`` where the drafter is set up for it: the kernel the drafter's pass
        has just used, where a library GEMM's code would be cold), else as
        :meth:`CorrectionHeadWeights.project`."""
        head = self._head
        layer = getattr(self.drafter, "context_proj", None)
        if layer is None:
            return head.project(hidden)
        return linear_as(layer, hidden.to(head.w_z.dtype), head.w_z, head.b1, fallback=lambda: head.project(hidden))

    @staticmethod
    def plain_tree(root: torch.Tensor) -> Tree:
        """The root alone: a plain decoding step."""
        return plain_tree(root)

    def expected_accepted(self, tree: Tree, accept_prob: torch.Tensor | None = None) -> torch.Tensor:
        """:meth:`AutoBudget.expected_accepted <dartree_ext.decoding.sizing.AutoBudget.expected_accepted>`
        under this decoder's calibration."""
        return self.sizing.expected_accepted(tree, accept_prob)

    def choose_tree(self, tree: Tree, context: int, accept_prob: torch.Tensor | None = None) -> tuple[Tree, int]:
        """``budget="auto"``: :meth:`AutoBudget.choose_tree <dartree_ext.decoding.sizing.AutoBudget.choose_tree>`."""
        return self.sizing.choose_tree(tree, context, accept_prob)

    @property
    def cost_model(self) -> CostModel | None:
        """The cost model trees are sized by (``budget="auto"``; measured at the first call when
        not given)."""
        return self._cost_model

    @cost_model.setter
    def cost_model(self, value: CostModel | None) -> None:
        self._cost_model = value
        if isinstance(getattr(self, "sizing", None), AutoBudget):
            self.sizing.cost_model = value

    @property
    def calibrator(self) -> DepthCalibrator | None:
        """The calibration the latest call's trees are cut by (``budget="auto"``)."""
        return getattr(self.sizing, "calibrator", None)

    @calibrator.setter
    def calibrator(self, value: DepthCalibrator) -> None:
        self.sizing.calibrator = value

    def _sizing_for(self, temperature: float) -> AutoBudget | FixedBudget:
        """One call's sizing: a fixed budget, or ``budget="auto"`` with the calibrator of the
        call's regime (sampled chains are accepted by another rule than fixed drafts: their own)."""
        if not self.auto:
            return FixedBudget()
        regime = "greedy" if temperature == 0 else "sampled_draft" if self.sampled_draft else "sample"
        return AutoBudget(self.method, self.budget, self.cost_model, self.learned.calibrator(regime), self.estimator,
                          self.running_costs, self.learned.lookup_stats("greedy" if temperature == 0 else "sample"))

    def _ensure_cost_model(self) -> None:
        if self.auto and self.cost_model is None:
            self.cost_model = cached_cost_model(  # auto: trees built at max_budget nodes
                self.target, self.drafter, methods=[self.method], progress=True,
                tree_builders=None if self.spec.eagle3 else {self.method: self.build_tree})

    # generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids: Iterable[int] | None = None, generator: torch.Generator | None = None,
                 progress: bool = False, hook: PhaseHook | None = None) -> GenerationOutput:
        """Decode ``max_new_tokens`` tokens (or until a stop token) for each prompt of
        ``input_ids int64[B, L]`` (``attention_mask`` marks the real tokens; any padding side).

        ``temperature == 0`` is greedy; ``> 0`` samples with ``top_k`` / ``top_p`` (HF's
        warpers) using ``generator``. Returns ``sequences`` = ``input_ids`` followed by the
        generated tokens (right-padded with the pad token), as HF ``generate`` does, and stats.
        ``progress``: a bar of tokens; ``hook``: a :class:`~dartree_ext.decoding.state.PhaseHook`
        that sees every phase (:mod:`~dartree_ext.decoding.phases`) of the call.
        """
        prompts = check_prompts(self.target, input_ids, attention_mask, max_new_tokens, temperature)
        run = self._session(prompts, max_new_tokens, stop_token_ids,
                            dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator), hook)
        if hook is not None:
            hook.enter("prefill", None)
        state = phases.prefill(self, run, prompts)
        if hook is not None:
            hook.exit("prefill", state, state)
        bar = _progress_bar(progress, len(prompts) * max_new_tokens, f"generate ({self.method})")
        while state.rows:
            bar.update(phases.decode_round(self, run, state))
        bar.close()
        return GenerationOutput(sequences=run.sequences(input_ids), stats=run.stats)

    def _session(self, prompts: list[torch.Tensor], max_new_tokens: int, stop_token_ids, sampling: dict,
                 hook: PhaseHook | None) -> Session:
        """A new call's :class:`~dartree_ext.decoding.state.Session`: its sizing (the calibrator
        of its regime), its lookup statistics, and the corpus if it is consulted at this
        temperature."""
        temperature = sampling["temperature"]
        self._ensure_cost_model()
        self.sizing = self._sizing_for(temperature)
        corpus = self.corpus if temperature == 0 or self.corpus_sampling else None
        if self.corpus is not None and corpus is None and self._warn_corpus:
            warnings.warn("the corpus is not consulted at temperature > 0 (a sampled answer follows it too rarely to "
                          "pay for the lookups); corpus_sampling=True consults it anyway", DecodingConfigWarning,
                          stacklevel=3)
        return Session(self, prompts, max_new_tokens, set(int(t) for t in (stop_token_ids or ())), sampling,
                       self.sizing, corpus, hook)

