"""One decoding round, phase by phase, as functions of the decoder (what outlives a call), the
call's :class:`~dartree_ext.decoding.state.Session` and its :class:`~dartree_ext.decoding.state.Batch`
of unfinished rows:

* :func:`prefill`: every prompt but its last token into a new cache; the drafter's context;
* :func:`draft_pass`: the drafter pass from each row's last committed token (the root); for the
  EAGLE-3 methods, the drafter's whole dynamic tree (:mod:`~dartree_ext.decoding.eagle`);
* :func:`propose`: the method's draft tree from it (the ops), cut to the chosen size with
  ``budget="auto"`` or at the verification head's predicted first rejection with ``early_exit``;
  with ``lookup``, each row's context-lookup (or corpus) continuation grafted in as one more branch;
* :func:`verify`: ``tree_attention_mask`` + positions, one target forward over root + tree, the
  target's token at every node (argmax, or a sample at T > 0), ``verify_tree``: a frozen
  :class:`~dartree_ext.decoding.state.Verdict`;
* :func:`commit`: the accepted path enters the KV cache (``compact_kv_`` on every layer) and its
  target hidden states the drafter's context; the bonus token is the next root;
* :func:`retire`: the round's tokens and stats per request; finished requests leave the batch.

:func:`decode_round` runs them in that order, each between the ``enter`` and ``exit`` of the
call's :class:`~dartree_ext.decoding.state.PhaseHook` when one is given (``generate(..., hook=...)``).

Cache layout: slot ``j`` of request ``b`` holds a committed token for ``pad[b] <= j < length[b]``
(prompts are left-padded); the last committed token (the *root*) is not in the cache yet, it
is node 0 of the next tree. Slots past ``length[b]`` are stale and hidden by the mask.
"""
from __future__ import annotations

import dataclasses
import time
import warnings

import torch

from .. import ops
from ..models.drafter import DraftOutput
from ..sampling import check_drawable, speculative_tokens, target_tokens_from_logits, undrawable_row
from ..tree import Tree, prune
from .cache import compact_cache_, crop_cache_
from .eagle import eagle3_draft
from .hf import additive_mask, cache_length, new_cache
from .lookup import ChainGraft, new_nodes
from .sampled import children_and_q, sampled_chain
from .state import Batch, Session, Verdict, context_vectors
from .trees import plain_tree


def decode_round(dec, run: Session, state: Batch) -> int:
    """One round for every unfinished row (draft -> tree -> verify -> commit -> retire), timed
    for the call's sizing; the tokens it emitted."""
    start = time.perf_counter()
    state.begin_round(cache_length(state.cache))
    draft = observed("draft", draft_pass, dec, run, state)
    tree, chosen = observed("tree", propose, dec, run, state, draft)
    predicted = run.sizing.predict(tree, state.cache_len, draft is not None)
    verify_start = time.perf_counter()
    verdict = observed("verify", verify, dec, run, state, tree)
    verify_end = time.perf_counter()
    run.sizing.observe(tree, state.cache_len, draft is not None, verify_start - start, verify_end - verify_start)
    observed("commit", commit, dec, run, state, tree, verdict, chosen)
    observed("retire", retire, dec, run, state, tree, verdict, chosen)
    end = run.tick("bookkeeping")
    dec.running_costs.observe_overhead(1e3 * (end - verify_end))
    tokens = sum(verdict.accepted) + len(verdict.accepted)
    run.stats.check_prediction(predicted, tokens, 1e3 * (end - start))
    return tokens


def observed(phase: str, fn, dec, run: Session, state, *args):
    """``fn(dec, run, state, *args)`` between the call's hook's ``enter`` and ``exit`` (directly
    without a hook)."""
    hook = run.hook
    if hook is None:
        return fn(dec, run, state, *args)
    hook.enter(phase, state)
    result = fn(dec, run, state, *args)
    hook.exit(phase, state, result)
    return result


def leading_at_least(prob: torch.Tensor, threshold: float) -> torch.Tensor:
    """Per row of ``prob [B, D]``, how many leading positions have ``prob >= threshold``."""
    return (prob >= threshold).int().cumprod(1).sum(1)


def prefill(dec, run: Session, prompts: list[torch.Tensor]) -> Batch:
    """Every prompt but its last token (the first root) into a new cache, left-padded; the
    drafter's context from the prompts' target features."""
    device, batch = run.device, len(prompts)
    prefix = max(p.numel() for p in prompts) - 1
    pad = torch.tensor([prefix - (p.numel() - 1) for p in prompts], dtype=torch.int64, device=device)
    state = Batch(active=torch.arange(batch, device=device), pad=pad,
                   length=torch.full((batch,), prefix, dtype=torch.int64, device=device),
                   root=torch.stack([p[-1] for p in prompts]), cache=new_cache(dec.target),
                   host_length=[prefix] * batch)
    if prefix > 0:
        ids = torch.full((batch, prefix), run.pad_id, dtype=torch.int64, device=device)
        for b, p in enumerate(prompts):
            ids[b, int(pad[b]):] = p[:-1]
        slot = torch.arange(prefix, device=device)
        visible = (slot[None, :, None] >= slot[None, None, :]) & (slot[None, None, :] >= pad[:, None, None])
        visible |= torch.eye(prefix, dtype=torch.bool, device=device)  # pad rows see themselves: no NaN
        mask = additive_mask(visible, run.dtype)
        out = dec.target(input_ids=ids, attention_mask=mask[:, None], position_ids=(slot - pad[:, None]).clamp(min=0),
                          use_cache=True, output_hidden_states=run.drafting, logits_to_keep=1,
                          **{dec.cache_kw: state.cache})
        if run.drafting:
            state.context = context_vectors(dec.drafter, dec.spec.eagle3,
                                            dec.drafter.target_features(out.hidden_states),
                                            torch.cat([ids[:, 1:], state.root[:, None]], 1))
            if dec.keep_context_kv:
                state.context_kv = dec.drafter.context_kv(state.context, (slot - pad[:, None]).clamp(min=0))
    run.tick("prefill")
    return state


def flush_context(dec, run: Session, state: Batch) -> None:
    """The queued slots' context vectors, made and written (:meth:`Batch.flush_context`)."""
    state.flush_context(dec.drafter, dec.spec.eagle3, dec.keep_context_kv)


def draft_pass(dec, run: Session, state: Batch) -> DraftOutput | Tree | None:
    """The drafter pass from every row's root (``None`` without a drafter, or while a plain
    step's back-off skips it); with the verification head in use, its acceptance
    probabilities too. The EAGLE-3 methods draft their whole dynamic tree here
    (:func:`~dartree_ext.decoding.eagle.eagle3_draft`, not yet cut to the budget)."""
    draft = None
    if run.drafting and not run.sizing.rests():
        if state.pending:
            observed("context", flush_context, dec, run, state)
        state.ensure_context(dec.drafter, dec.keep_context_kv)
        if dec.spec.eagle3:  # with budget="auto", only the steps recent trees reached + 2 (AutoBudget.draft_positions)
            steps = dec.drafter.config.num_steps
            draft = eagle3_draft(dec.drafter, state, width=dec.width, children=min(dec.K, dec.width),
                                 early_exit=dec.early_exit, steps=run.sizing.draft_positions(steps))
            run.tick("draft")
            return draft
        slot = torch.arange(state.cache_len, device=run.device)
        kw = {}
        if state.context_kv is not None:
            kw["context_kv"] = [kv[:, :state.cache_len] for kv in state.context_kv]
        if dec.auto:  # only the positions a tree is built from: recent chosen depths + 2 (AutoBudget.draft_positions)
            kw["positions"] = run.sizing.draft_positions(dec.drafter.config.block_size - 1)
        draft = dec.drafter(state.root, state.position, state.context[:, :state.cache_len],
                             (slot[None] - state.pad[:, None]).clamp(min=0), state.past_valid, **kw)
        if dec.uses_vh and draft.hidden.shape[1]:
            draft = dataclasses.replace(draft, accept_prob=torch.sigmoid(dec.drafter.verification_head(draft.hidden).float()))
    run.tick("draft")
    return draft


def propose(dec, run: Session, state: Batch, draft: DraftOutput | None) -> tuple[Tree, int | None]:
    """The round's tree and, with ``budget="auto"``, the draft nodes chosen (0: a plain step);
    with ``lookup``, each row's context continuation grafted in."""
    run.sizing.chosen_expected = 0.0  # choose_tree sets it: E[accepted] of the drafter's chosen nodes
    if not dec.spec.drafts:  # plain decoding, or the lookup branch alone
        tree, chosen = plain_tree(state.root), (0 if dec.auto else None)
    else:
        tree, chosen = drafted_tree(dec, run, state, draft)
    if dec.lookup and state.draft_q is None:  # (a grafted branch would give a node a second child)
        tree = observed("lookup", graft_lookup, dec, run, state, tree, chosen)
        run.tick("tree")
    return tree, chosen


def graft_lookup(dec, run: Session, state: Batch, tree: Tree, chosen: int | None) -> Tree:
    """``tree`` with every row's context continuation grafted in (:class:`ChainGraft`); with
    ``budget="auto"``, the continuations are cut at the step (the same for every row) that
    maximises expected tokens per ms under the cost model."""
    chains, ngrams, sources = run.propose_continuations(state.active.tolist(), dec.lookup)
    graft = ChainGraft(tree, chains)
    new = [new_nodes(a) for a in graft.added]
    steps = None
    if dec.auto and any(chains):
        steps = run.sizing.lookup_steps(tree, chains, ngrams, graft.added, chosen, state.cache_len, new, sources)
        chains = [c[:steps] for c in chains]
    state.chains, state.ngrams, state.drafted, state.chain_new = chains, ngrams, tree.num_nodes.tolist(), new
    state.chain_stats = sources
    return graft.tree(steps)


def drafted_tree(dec, run: Session, state: Batch, draft: DraftOutput | Tree | None) -> tuple[Tree, int | None]:
    """The drafter's tree (see :func:`propose`)."""
    if draft is not None and not _finite_draft(draft.scores if isinstance(draft, Tree) else draft.base_logits):
        run.tick("tree")
        return plain_tree(state.root), (0 if dec.auto else None)
    if isinstance(draft, Tree):  # EAGLE-3: every drafted node, reranked to the budget
        tree = prune(draft, dec.budget)
        width = int(tree.num_nodes.max())  # early exit: no padding columns for the target to run
        tree = Tree(*(t[:, :width].contiguous() for t in (tree.tokens, tree.parents, tree.depths, tree.scores)),
                    tree.num_nodes)
        chosen = None
        if dec.auto:  # (the head's early exit kept no step: a plain step, no back-off)
            tree, chosen = (tree, 0) if width == 1 else _choose(run, state, tree, None)
        run.tick("tree")
        return tree, chosen
    if run.drafting and draft is None:
        run.tick("tree")
        return plain_tree(state.root), 0
    hidden = base_logits = vocab = prob = cut = None
    if draft is not None:
        hidden, base_logits, vocab, prob = draft.hidden, draft.base_logits, draft.vocab, draft.accept_prob
        keep = hidden.shape[1]
        if dec.early_exit is not None:  # up to the predicted first rejection
            cut = leading_at_least(prob, dec.early_exit)
            keep = min(keep, int(cut.max()))
        if keep == 0:
            run.tick("tree")
            return plain_tree(state.root), (0 if dec.auto else None)
        hidden, base_logits = hidden[:, :keep], base_logits[:, :keep]
        prob = None if prob is None else prob[:, :keep]
    cap = run.sizing.build_cap()
    if dec.sampled_draft and run.sampling["temperature"] > 0:
        tree, state.draft_q = sampled_chain(base_logits, state.root, vocab, run.sampling)
    else:
        tree = dec.build_tree(hidden, base_logits, state.root, vocab, **({} if cap is None else {"cap": cap}))
    if cut is not None and dec.spec.chain:  # chains: each row its own cut
        num = torch.minimum(tree.num_nodes, (cut + 1).to(tree.num_nodes.dtype))
        live = torch.arange(tree.tokens.shape[1], device=num.device)[None] < num[:, None]
        tree = dataclasses.replace(tree, num_nodes=num, depths=torch.where(live, tree.depths, -1))
    chosen = None
    if dec.auto:
        tree, chosen = _choose(run, state, tree, prob if dec.estimator == "vh" else None)
    run.tick("tree")
    return tree, chosen


def _finite_draft(scores: torch.Tensor) -> bool:
    """Whether the drafter's scores are free of NaN; if not, a warning, and the round verifies no
    draft (a plain step: the output stays the target's)."""
    if not bool(scores.isnan().any()):
        return True
    warnings.warn("the drafter's scores hold a NaN: this round verifies no draft (a plain decoding step; the "
                  "output is still the target's)", RuntimeWarning, stacklevel=2)
    return False


def _choose(run: Session, state: Batch, tree: Tree, accept_prob: torch.Tensor | None) -> tuple[Tree, int]:
    """``budget="auto"``: the call's cut of a drafted tree (the full tree kept for calibration)."""
    state.full_tree = tree
    return run.sizing.choose(tree, state.cache_len, accept_prob)


def verify(dec, run: Session, state: Batch, tree: Tree) -> Verdict:
    """One target forward over root + tree (tree-attention mask); the target's token at every
    node; the longest accepted path and the bonus token of every row."""
    mask = ops.tree_attention_mask(tree.parents, tree.num_nodes, state.past_valid, run.dtype, validate=False)
    positions = state.position[:, None] + tree.depths.clamp(min=0).long()
    out = dec.target(input_ids=tree.tokens, attention_mask=mask, position_ids=positions, use_cache=True,
                      output_hidden_states=run.drafting, **{dec.cache_kw: state.cache})
    target_tokens = _target_tokens(run, state, tree, out.logits)
    accept_nodes, accept_len, bonus = ops.verify_tree(tree.tokens, tree.parents, tree.num_nodes, target_tokens,
                                                     validate=False)
    verdict = Verdict.read(tree, accept_nodes, accept_len, bonus, target_tokens,
                           out.hidden_states if run.drafting else None)
    run.tick("verify")
    return verdict


def _target_tokens(run: Session, state: Batch, tree: Tree, logits: torch.Tensor) -> torch.Tensor:
    """The target's token at every node. Logits no token can be drawn from (a NaN, or all -inf)
    stop the call with a ``ValueError`` naming the request, its round and the node: any token
    emitted from them would not be the target's."""
    try:
        if state.draft_q is not None and tree.tokens.shape[1] > 1:
            check_drawable(logits)
            child, q = children_and_q(tree, state.draft_q, logits.shape[-1])
            return speculative_tokens(logits, child, q, **run.sampling)
        return target_tokens_from_logits(logits, **run.sampling)
    except ValueError as error:
        bad = undrawable_row(logits)
        if bad is None:
            raise
        row, node = divmod(bad[0], logits.shape[1])
        request = int(state.active[row])
        stats = run.stats.requests[request]
        raise ValueError(f"the target's logits for request {request} (round {stats.rounds + 1}, after "
                         f"{stats.new_tokens} new tokens) at tree node {node} {bad[1]}: the target's output is not "
                         "defined there, so decoding stops (check the model's dtype and weights)") from error


def commit(dec, run: Session, state: Batch, tree: Tree, verdict: Verdict, chosen: int | None) -> None:
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
        feats = dec.drafter.target_features(verdict.hidden_states)  # only the chosen layers, then the path
        feats = feats[:, :1] if width == 1 else feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1]))
        nxt = None
        if dec.spec.eagle3:  # the token after each path slot (the bonus after the last)
            nxt = torch.cat([tree.tokens.gather(1, nodes)[:, 1:], verdict.bonus[:, None]], 1)
            nxt = torch.where(torch.arange(width, device=device)[None] >= (lengths.long() - 1)[:, None],
                              verdict.bonus[:, None], nxt)
        state.stage_context(feats, nxt, in_path)
        if run.sizing.skip == 0 or not dec.defer_context:  # the drafter runs next round: no wait
            observed("context", flush_context, dec, run, state)
    if dec.auto and chosen:
        run.sizing.calibrate(tree, verdict.accept_nodes)
    elif dec.auto and chosen == 0 and state.full_tree is not None and state.draft_q is None:
        # (a sampled chain is accepted by speculative sampling, not by equality with the target's
        # sample: a plain round has nothing to teach its calibration; probes do)
        run.sizing.calibrate_unverified(state.full_tree, verdict.target_tokens[:, 0])
    state.length = state.length + lengths
    state.root = verdict.bonus


def retire(dec, run: Session, state: Batch, tree: Tree, verdict: Verdict, chosen: int | None) -> None:
    """Record the round's tokens and stats per request; drop the rows that are done (stop
    token, ``max_new_tokens``, or the target's context)."""
    stats = run.stats
    accepted, bonus, paths, sizes = verdict.accepted, verdict.bonus_tokens, verdict.paths, verdict.sizes
    if not dec.spec.plain:
        stats.nodes_per_depth.update(d for row in verdict.depths for d in row if d > 0)
        if dec.auto and chosen:
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

