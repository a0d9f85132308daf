"""Speculative decoding of a HuggingFace causal LM with draft trees, lossless at any temperature.

``generate`` prefills the prompts (``_prefill``), then runs rounds until every request is done.
One round, for every unfinished request at once (each with its own tree and acceptance):

* ``_draft``: the drafter pass from each row's last committed token (the root); for the
  EAGLE-3 methods, the drafter's whole dynamic tree (:mod:`~dartree_ext.decoding.eagle`);
* ``_tree``: the method's draft tree from it (the ops), cut to the chosen size with
  ``budget="auto"`` or at the verification head's predicted first rejection with ``early_exit``;
  with ``lookup``, each row's context-lookup (or ``corpus``) continuation grafted in as one more branch;
* ``_verify``: ``tree_attention_mask`` + positions, one target forward over root + tree, the
  target's token at every node (argmax, or a sample at T > 0), ``verify_tree``;
* ``_commit``: the accepted path enters the KV cache (``compact_kv_`` on every layer) and its
  target hidden states the drafter's context; the bonus token is the next root;
* ``_retire``: the round's tokens and stats per request; finished requests leave the batch.

Cache layout: slot ``j`` of request ``b`` holds a committed token for ``pad[b] <= j < length[b]``
(prompts are left-padded); the last committed token (the *root*) is not in the cache yet, it
is node 0 of the next tree. Slots past ``length[b]`` are stale and hidden by the mask.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging
import time
import warnings
from collections.abc import Sequence
from typing import Iterable

import torch

from .. import ops
from ..linear import linear_as
from ..models import BlockDrafter
from ..models.drafter import DraftOutput
from ..models.eagle3 import Eagle3Drafter
from ..sampling import speculative_tokens, target_tokens_from_logits
from ..tree import Tree, prune
from .cache import compact_cache_, crop_cache_
from .config import CORPUS_OFF, DecodingConfig, DecodingConfigWarning, resolve
from .cost import AcceptanceCalibrator, CostModel, DepthCalibrator
from .profiling import cached_cost_model
from .eagle import StopRule, eagle3_draft
from .hf import additive_mask, cache_length, check_prompts, new_cache
from .lookup import ChainGraft, CorpusIndex, LookupStats, new_nodes
from .methods import Method, method as method_entry
from .methods import ALL_METHODS, AUTO_METHODS, DRAFTERLESS, EAGLE3_METHODS, METHODS  # noqa: F401 (re-exported)
from .sampled import DraftQ, children_and_q, sampled_chain  # noqa: F401 (DraftQ re-exported)
from .sizing import AutoBudget, FixedBudget, Learned, RunningCosts
from .state import (PHASES, Batch, DecodingStats, GenerationOutput, RequestStats,  # noqa: F401 (re-exported)
                    Session, Verdict, context_vectors)
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


def _leading_at_least(prob: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per row of ``prob [B, D]``, how many leading positions have ``prob >= threshold``."""
    return (prob >= threshold).int().cumprod(1).sum(1)


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
        self._eagle3 = spec.eagle3
        self._vh_used = spec.drafts and not spec.eagle3 and (
            self.early_exit is not None or (self.auto and self.estimator == "vh"))
        self.target, self.drafter, self.method = target, drafter, spec.name
        # the drafter's keys/values of its context, kept per slot instead of recomputed per round
        self._context_kv = callable(getattr(drafter, "context_kv", None))
        self._defer_context = True  # queue the context while the drafter rests (tests turn it off)
        self.width, self.K, self.depth_bonus = config.width, config.K, config.depth_bonus
        self.sync_timing = sync_timing
        self.cost_model = cost_model
        self.learned = Learned(spec.name, drafter, calibrator)  # calibrators and lookup statistics, across calls
        self.lookup_stats = self.learned.lookup_stats("greedy")
        self.corpus_stats = self.learned.lookup_stats("corpus-greedy")
        self._costs = RunningCosts()  # the cost model's corrections, kept across calls
        self.sizing = self._sizing_for(0.0)  # the latest call's (a new one per generate call)
        self._head = drafter.export_head(dtype=drafter.dtype) if drafter is not None and spec.head else None
        params = inspect.signature(target.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

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
                          self._costs, self.learned.lookup_stats("greedy" if temperature == 0 else "sample"))

    def _ensure_cost_model(self) -> None:
        if self.auto and self.cost_model is None:
            self.cost_model = cached_cost_model(  # auto: trees built at max_budget nodes
                self.target, self.drafter, methods=[self.method], progress=True,
                tree_builders=None if self._eagle3 else {self.method: self.build_tree})

    # generation -----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, max_new_tokens: int = 64,
                 temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
                 stop_token_ids: Iterable[int] | None = None, generator: torch.Generator | None = None,
                 progress: bool = False) -> GenerationOutput:
        """Decode ``max_new_tokens`` tokens (or until a stop token) for each prompt of
        ``input_ids int64[B, L]`` (``attention_mask`` marks the real tokens; any padding side).

        ``temperature == 0`` is greedy; ``> 0`` samples with ``top_k`` / ``top_p`` (HF's
        warpers) using ``generator``. Returns ``sequences`` = ``input_ids`` followed by the
        generated tokens (right-padded with the pad token), as HF ``generate`` does, and stats.
        """
        prompts = check_prompts(self.target, input_ids, attention_mask, max_new_tokens, temperature)
        run = self._session(prompts, max_new_tokens, stop_token_ids,
                            dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator))
        state = self._prefill(run, prompts)
        bar = _progress_bar(progress, len(prompts) * max_new_tokens, f"generate ({self.method})")
        while state.rows:
            bar.update(self._round(run, state))
        bar.close()
        return GenerationOutput(sequences=run.sequences(input_ids), stats=run.stats)

    def _round(self, run: Session, state: Batch) -> int:
        """One round for every unfinished row (draft -> tree -> verify -> commit -> retire), timed
        for the call's sizing; the tokens it emitted."""
        start = time.perf_counter()
        state.begin_round(cache_length(state.cache))
        draft = self._draft(run, state)
        tree, chosen = self._tree(run, state, draft)
        predicted = run.sizing.predict(tree, state.cache_len, draft is not None)
        verify_start = time.perf_counter()
        verdict = self._verify(run, state, tree)
        verify_end = time.perf_counter()
        run.sizing.observe(tree, state.cache_len, draft is not None, verify_start - start, verify_end - verify_start)
        self._commit(run, state, tree, verdict, chosen, draft)
        self._retire(run, state, tree, verdict, chosen)
        end = run.tick("bookkeeping")
        self._costs.observe_overhead(1e3 * (end - verify_end))
        tokens = sum(verdict.accepted) + len(verdict.accepted)
        run.stats.check_prediction(predicted, tokens, 1e3 * (end - start))
        return tokens

    def _session(self, prompts: list[torch.Tensor], max_new_tokens: int, stop_token_ids, sampling: dict) -> Session:
        """A new call's :class:`~dartree_ext.decoding.state.Session`: its sizing (the calibrator
        of its regime), its lookup statistics, and the corpus if it is consulted at this
        temperature."""
        temperature = sampling["temperature"]
        self._ensure_cost_model()
        self.sizing = self._sizing_for(temperature)
        self.lookup_stats = self.learned.lookup_stats("greedy" if temperature == 0 else "sample")
        self.corpus_stats = self.learned.lookup_stats("corpus-greedy" if temperature == 0 else "corpus-sample")
        corpus = self.corpus if temperature == 0 or self.corpus_sampling else None
        if self.corpus is not None and corpus is None and self._warn_corpus:
            warnings.warn("the corpus is not consulted at temperature > 0 (a sampled answer follows it too rarely to "
                          "pay for the lookups); corpus_sampling=True consults it anyway", DecodingConfigWarning,
                          stacklevel=3)
        return Session(self, prompts, max_new_tokens, set(int(t) for t in (stop_token_ids or ())), sampling,
                       self.sizing, corpus, self.lookup_stats, self.corpus_stats)

    def _prefill(self, run: Session, prompts: list[torch.Tensor]) -> Batch:
        """Every prompt but its last token (the first root) into a new cache, left-padded; the
        drafter's context from the prompts' target features."""
        device, batch = run.device, len(prompts)
        prefix = max(p.numel() for p in prompts) - 1
        pad = torch.tensor([prefix - (p.numel() - 1) for p in prompts], dtype=torch.int64, device=device)
        state = Batch(active=torch.arange(batch, device=device), pad=pad,
                       length=torch.full((batch,), prefix, dtype=torch.int64, device=device),
                       root=torch.stack([p[-1] for p in prompts]), cache=new_cache(self.target),
                       host_length=[prefix] * batch)
        if prefix > 0:
            ids = torch.full((batch, prefix), run.pad_id, dtype=torch.int64, device=device)
            for b, p in enumerate(prompts):
                ids[b, int(pad[b]):] = p[:-1]
            slot = torch.arange(prefix, device=device)
            visible = (slot[None, :, None] >= slot[None, None, :]) & (slot[None, None, :] >= pad[:, None, None])
            visible |= torch.eye(prefix, dtype=torch.bool, device=device)  # pad rows see themselves: no NaN
            mask = additive_mask(visible, run.dtype)
            out = self.target(input_ids=ids, attention_mask=mask[:, None], position_ids=(slot - pad[:, None]).clamp(min=0),
                              use_cache=True, output_hidden_states=run.drafting, logits_to_keep=1,
                              **{self._cache_kw: state.cache})
            if run.drafting:
                state.context = context_vectors(self.drafter, self._eagle3,
                                                self.drafter.target_features(out.hidden_states),
                                                torch.cat([ids[:, 1:], state.root[:, None]], 1))
                if self._context_kv:
                    state.context_kv = self.drafter.context_kv(state.context, (slot - pad[:, None]).clamp(min=0))
        run.tick("prefill")
        return state

    def _flush_context(self, state: Batch) -> None:
        """The queued slots' context vectors, made and written (:meth:`Batch.flush_context`)."""
        state.flush_context(self.drafter, self._eagle3, self._context_kv)

    def _draft(self, run: Session, state: Batch) -> DraftOutput | Tree | None:
        """The drafter pass from every row's root (``None`` without a drafter, or while a plain
        step's back-off skips it); with the verification head in use, its acceptance
        probabilities too. The EAGLE-3 methods draft their whole dynamic tree here
        (:func:`~dartree_ext.decoding.eagle.eagle3_draft`, not yet cut to the budget)."""
        draft = None
        if run.drafting and not run.sizing.rests():
            if state.pending:
                self._flush_context(state)
            state.ensure_context(self.drafter, self._context_kv)
            if self._eagle3:  # with budget="auto", only the steps recent trees reached + 2 (AutoBudget.draft_positions)
                steps = self.drafter.config.num_steps
                draft = eagle3_draft(self.drafter, state, width=self.width, children=min(self.K, self.width),
                                     early_exit=self.early_exit, steps=run.sizing.draft_positions(steps))
                run.tick("draft")
                return draft
            slot = torch.arange(state.cache_len, device=run.device)
            kw = {}
            if state.context_kv is not None:
                kw["context_kv"] = [kv[:, :state.cache_len] for kv in state.context_kv]
            if self.auto:  # only the positions a tree is built from: recent chosen depths + 2 (AutoBudget.draft_positions)
                kw["positions"] = run.sizing.draft_positions(self.drafter.config.block_size - 1)
            draft = self.drafter(state.root, state.position, state.context[:, :state.cache_len],
                                 (slot[None] - state.pad[:, None]).clamp(min=0), state.past_valid, **kw)
            if self._vh_used and draft.hidden.shape[1]:
                draft.accept_prob = torch.sigmoid(self.drafter.verification_head(draft.hidden).float())
        run.tick("draft")
        return draft

    def _tree(self, run: Session, state: Batch, draft: DraftOutput | None) -> tuple[Tree, int | None]:
        """The round's tree and, with ``budget="auto"``, the draft nodes chosen (0: a plain step);
        with ``lookup``, each row's context continuation grafted in."""
        run.sizing.chosen_expected = 0.0  # choose_tree sets it: E[accepted] of the drafter's chosen nodes
        if not self.spec.drafts:  # plain decoding, or the lookup branch alone
            tree, chosen = self.plain_tree(state.root), (0 if self.auto else None)
        else:
            tree, chosen = self._drafted_tree(run, state, draft)
        if self.lookup and state.draft_q is None:  # (a grafted branch would give a node a second child)
            tree = self._graft_lookup(run, state, tree, chosen)
            run.tick("tree")
        return tree, chosen

    def _graft_lookup(self, run: Session, state: Batch, tree: Tree, chosen: int | None) -> Tree:
        """``tree`` with every row's context continuation grafted in (:class:`ChainGraft`); with
        ``budget="auto"``, the continuations are cut at the step (the same for every row) that
        maximises expected tokens per ms under the cost model."""
        chains, ngrams, sources = run.propose_continuations(state.active.tolist(), self.lookup)
        graft = ChainGraft(tree, chains)
        new = [new_nodes(a) for a in graft.added]
        steps = None
        if self.auto and any(chains):
            steps = run.sizing.lookup_steps(tree, chains, ngrams, graft.added, chosen, state.cache_len, new, sources)
            chains = [c[:steps] for c in chains]
        state.chains, state.ngrams, state.drafted, state.chain_new = chains, ngrams, tree.num_nodes.tolist(), new
        state.chain_stats = sources
        return graft.tree(steps)

    def _drafted_tree(self, run: Session, state: Batch, draft: DraftOutput | Tree | None) -> tuple[Tree, int | None]:
        """The drafter's tree (see :meth:`_tree`)."""
        if isinstance(draft, Tree):  # EAGLE-3: every drafted node, reranked to the budget
            tree = prune(draft, self.budget)
            width = int(tree.num_nodes.max())  # early exit: no padding columns for the target to run
            tree = Tree(*(t[:, :width].contiguous() for t in (tree.tokens, tree.parents, tree.depths, tree.scores)),
                        tree.num_nodes)
            chosen = None
            if self.auto:  # (the head's early exit kept no step: a plain step, no back-off)
                tree, chosen = (tree, 0) if width == 1 else self._choose(run, state, tree, None)
            run.tick("tree")
            return tree, chosen
        if run.drafting and draft is None:
            run.tick("tree")
            return self.plain_tree(state.root), 0
        hidden = base_logits = vocab = prob = cut = None
        if draft is not None:
            hidden, base_logits, vocab, prob = draft.hidden, draft.base_logits, draft.vocab, draft.accept_prob
            keep = hidden.shape[1]
            if self.early_exit is not None:  # up to the predicted first rejection
                cut = _leading_at_least(prob, self.early_exit)
                keep = min(keep, int(cut.max()))
            if keep == 0:
                run.tick("tree")
                return self.plain_tree(state.root), (0 if self.auto else None)
            hidden, base_logits = hidden[:, :keep], base_logits[:, :keep]
            prob = None if prob is None else prob[:, :keep]
        cap = run.sizing.build_cap()
        if self.sampled_draft and run.sampling["temperature"] > 0:
            tree, state.draft_q = sampled_chain(base_logits, state.root, vocab, run.sampling)
        else:
            tree = self.build_tree(hidden, base_logits, state.root, vocab, **({} if cap is None else {"cap": cap}))
        if cut is not None and self.spec.chain:  # chains: each row its own cut
            num = torch.minimum(tree.num_nodes, (cut + 1).to(tree.num_nodes.dtype))
            live = torch.arange(tree.tokens.shape[1], device=num.device)[None] < num[:, None]
            tree = dataclasses.replace(tree, num_nodes=num, depths=torch.where(live, tree.depths, -1))
        chosen = None
        if self.auto:
            tree, chosen = self._choose(run, state, tree, prob if self.estimator == "vh" else None)
        run.tick("tree")
        return tree, chosen

    @staticmethod
    def _choose(run: Session, state: Batch, tree: Tree, accept_prob: torch.Tensor | None) -> tuple[Tree, int]:
        """``budget="auto"``: the call's cut of a drafted tree (the full tree kept for calibration)."""
        state.full_tree = tree
        return run.sizing.choose(tree, state.cache_len, accept_prob)

    def _verify(self, run: Session, state: Batch, tree: Tree) -> Verdict:
        """One target forward over root + tree (tree-attention mask); the target's token at every
        node; the longest accepted path and the bonus token of every row."""
        mask = ops.tree_attention_mask(tree.parents, tree.num_nodes, state.past_valid, run.dtype)
        positions = state.position[:, None] + tree.depths.clamp(min=0).long()
        out = self.target(input_ids=tree.tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                          output_hidden_states=run.drafting, **{self._cache_kw: state.cache})
        if state.draft_q is not None and tree.tokens.shape[1] > 1:
            child, q = children_and_q(tree, state.draft_q, out.logits.shape[-1])
            target_tokens = speculative_tokens(out.logits, child, q, **run.sampling)
        else:
            target_tokens = target_tokens_from_logits(out.logits, **run.sampling)
        accept_nodes, accept_len, bonus = ops.verify_tree(tree.tokens, tree.parents, tree.num_nodes, target_tokens)
        verdict = Verdict(accept_nodes, accept_len, bonus, target_tokens, out.hidden_states if run.drafting else None)
        verdict.fetch(tree)
        run.tick("verify")
        return verdict

    def _commit(self, run: Session, state: Batch, tree: Tree, verdict: Verdict, chosen: int | None,
                draft: DraftOutput | None) -> None:
        """The accepted path (root + accepted nodes) enters the cache and the drafter's context;
        the bonus token becomes the next root; the calibrator learns from the verified nodes."""
        device = run.device
        width = max(verdict.accepted) + 1
        if width == 1:  # every row keeps its root alone (a plain step, or no draft accepted)
            lengths = torch.ones_like(verdict.accept_len)
            nodes, in_path = torch.zeros_like(state.length)[:, None], None
        else:
            lengths = (verdict.accept_len + 1).to(torch.int32)
            nodes = verdict.accept_nodes[:, :width].long()
            in_path = torch.arange(width, device=device)[None] < lengths[:, None]
            nodes = torch.where(in_path, nodes, nodes.gather(1, (lengths.long() - 1)[:, None]))
        in_place = width == 1 and all(n == state.cache_len for n in state.host_length)  # the root is where it goes
        state.host_length = [n + a + 1 for n, a in zip(state.host_length, verdict.accepted)]
        new_length = max(state.host_length)
        if in_place:
            crop_cache_(state.cache, new_length)
        else:
            compact_cache_(state.cache, (state.cache_len + nodes).contiguous(), state.length.contiguous(), lengths,
                           new_length=new_length)
        if run.drafting:
            feats = self.drafter.target_features(verdict.hidden_states)  # only the chosen layers, then the path
            feats = feats[:, :1] if width == 1 else feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1]))
            nxt = None
            if self._eagle3:  # the token after each path slot (the bonus after the last)
                nxt = torch.cat([tree.tokens.gather(1, nodes)[:, 1:], verdict.bonus[:, None]], 1)
                nxt = torch.where(torch.arange(width, device=device)[None] >= (lengths.long() - 1)[:, None],
                                  verdict.bonus[:, None], nxt)
            state.stage_context(feats, nxt, in_path)
            if run.sizing.skip == 0 or not self._defer_context:  # the drafter runs next round: no wait
                self._flush_context(state)
        if self.auto and chosen:
            run.sizing.calibrate(tree, verdict.accept_nodes)
        elif self.auto and chosen == 0 and state.full_tree is not None and state.draft_q is None:
            # (a sampled chain is accepted by speculative sampling, not by equality with the target's
            # sample: a plain round has nothing to teach its calibration; probes do)
            run.sizing.calibrate_unverified(state.full_tree, verdict.target_tokens[:, 0])
        state.length = state.length + lengths
        state.root = verdict.bonus

    def _retire(self, run: Session, state: Batch, tree: Tree, verdict: Verdict, chosen: int | None) -> None:
        """Record the round's tokens and stats per request; drop the rows that are done (stop
        token, ``max_new_tokens``, or the target's context)."""
        stats = run.stats
        accepted, bonus, paths, sizes = verdict.accepted, verdict.bonus_tokens, verdict.paths, verdict.sizes
        if not self.spec.plain:
            stats.nodes_per_depth.update(d for row in verdict.depths for d in row if d > 0)
            if self.auto and chosen:
                drafted = state.drafted or [len(row) for row in verdict.depths]
                deepest = max(d for row, n in zip(verdict.depths, drafted) for d in row[:n])
                run.sizing.record(chosen, deepest)
        if run.drafting and chosen == 0:
            stats.plain_rounds += state.rows
        if state.chains is not None:
            run.learn_continuations(state, accepted, paths)
        keep = []
        for row, req in enumerate(state.active.tolist()):
            rs, a = stats.requests[req], accepted[row]
            rs.accepted.append(a)
            stats.tree_nodes.append(sizes[row])
            done = run.emit(req, paths[row][1:a + 1] + [bonus[row]])
            if done:
                rs.finish_reason = done
            else:
                keep.append(row)
        if len(keep) < state.rows:
            state.keep(torch.tensor(keep, dtype=torch.int64, device=run.device))

    # helpers --------------------------------------------------------------------------------
