"""Drafting a dynamic tree with an :class:`~dartree_ext.models.eagle3.Eagle3Drafter` (EAGLE-2 style).

Step 1 runs the drafter on the root (index = the root, hidden = the fused target features of
the last committed token). Step ``d > 1`` runs it on the frontier: the ``width`` best nodes
(cumulative drafter log-probability) among those added at step ``d - 1``, each attending to the
committed context and to its own draft path (the keys of its expanded ancestors, root included),
with the hidden state its parent's run produced. Every run adds its ``children`` most probable
tokens as nodes. At the end all drafted nodes are reranked to the budget by
:func:`~dartree_ext.tree.prune` (``select_top_b``: scores never increase along a path, so the
kept set is the global top-B and prefix-closed). With ``early_exit=p`` a row stops before the
step whose best frontier node the verification head gives a probability below ``p``.
``early_exit`` may instead be a stop rule (:data:`StopRule`), called before each step's children
are added; benchmarks use it for the oracle exit at the true first rejection.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Union

import torch

from ..tree import Tree

StopRule = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``rule(step, root, position, paths) -> bool[R]``: stop a row before step ``step``'s children
are added. ``root int64[R]`` and ``position int64[R]`` as given to :func:`draft_eagle3_tree`;
``paths int64[R, C, step]``: the tokens below the root of every candidate child of this step
(its frontier node's path, then the child), ``C = frontier width x children``."""


@dataclasses.dataclass
class _Frontier:
    """The nodes one drafter run takes as queries, per row: ``F`` of them."""

    nodes: torch.Tensor    # int64[R, F]: node indices
    tokens: torch.Tensor   # int64[R, F]
    hidden: torch.Tensor   # [R, F, H]: the hidden input (the parent's run output)
    scores: torch.Tensor   # float32[R, F]
    ancestors: torch.Tensor  # bool[R, F, E]: expanded nodes on the path (before this run)
    paths: torch.Tensor | None  # int64[R, F, d - 1]: the tokens below the root, this node's included
                                # (kept for a stop rule only)


def _gather_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[r, idx[r, j]]`` for ``x [R, N, ...]``, ``idx int64[R, J]``."""
    return x.gather(1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:]))


def draft_eagle3_tree(drafter, root: torch.Tensor, position: torch.Tensor, context: torch.Tensor,
                      context_kv: torch.Tensor, past_valid: torch.Tensor, last_slot: torch.Tensor, *, steps: int,
                      width: int, children: int, early_exit: Union[float, StopRule, None] = None) -> Tree:
    """All drafted nodes of every row (root first, parents before children, ``num_nodes`` per row;
    not yet cut to a budget). ``root int64[R]`` at ``position int64[R]``; the committed context:
    ``context [R, S, 2H]`` (:meth:`Eagle3Drafter.project_context` per slot), its keys and values
    ``context_kv [R, S, 2, kv_heads, head_dim]``, ``past_valid bool[R, S]``, ``last_slot int64[R]``
    (the slot of the last committed token, -1 when a row has none). ``early_exit``: the
    verification head's threshold ``p``, or a :data:`StopRule`."""
    rows, device = root.shape[0], root.device
    frontier, ctx_visible, ctx_k, ctx_v = _root_frontier(drafter, root, context, context_kv, past_valid, last_slot)
    exp_k = exp_v = ctx_k[:, :, :0]
    tokens, parents, depths, scores = [root[:, None]], [root.new_full((rows, 1), -1)], [root.new_zeros(rows, 1)], \
        [torch.zeros(rows, 1, device=device)]
    count = 1
    num_nodes = torch.full((rows,), -1, dtype=torch.int64, device=device)  # -1: still drafting
    rule = early_exit if callable(early_exit) else None  # a stop rule reads the candidates' paths
    for d in range(1, steps + 1):
        f = frontier.nodes.shape[1]
        visible = torch.cat([ctx_visible[:, None].expand(-1, f, -1), frontier.ancestors,
                             torch.eye(f, dtype=torch.bool, device=device).expand(rows, -1, -1)], 2)
        pos = (position - 2 + d)[:, None].expand(-1, f)
        out, k, v = drafter.layer(frontier.hidden, drafter.embed(frontier.tokens), pos,
                                  torch.cat([ctx_k, exp_k], 2), torch.cat([ctx_v, exp_v], 2), visible)
        exp_k, exp_v = torch.cat([exp_k, k], 2), torch.cat([exp_v, v], 2)
        anc = torch.cat([frontier.ancestors, torch.eye(f, dtype=torch.bool, device=device).expand(rows, -1, -1)], 2)
        normed, logits = drafter.head(out)
        c = min(children, logits.shape[-1])
        logp, ids = torch.log_softmax(logits.float(), -1).topk(c, dim=-1)        # [R, F, c]
        child_tokens = drafter.vocab_ids(ids).reshape(rows, f * c)
        child_paths = None if rule is None else \
            torch.cat([frontier.paths.repeat_interleave(c, 1), child_tokens[..., None]], 2)
        if early_exit is not None:  # stop a row here: its draft ends before this step's children
            if rule is not None:
                stop = rule(d, root, position, child_paths).to(device=device, dtype=torch.bool)
            else:  # the best frontier node's path predicted rejected
                stop = torch.sigmoid(drafter.verification_head(normed[:, 0]).float()) < early_exit
            num_nodes = torch.where((num_nodes < 0) & stop, count, num_nodes)
            if bool((num_nodes >= 0).all()):
                break
        child_scores = (frontier.scores[..., None] + logp).reshape(rows, f * c)
        tokens.append(child_tokens)
        parents.append(frontier.nodes.repeat_interleave(c, 1))
        depths.append(root.new_full((rows, f * c), d))
        scores.append(child_scores)
        if d == steps:
            count += f * c
            break
        best = child_scores.topk(min(width, f * c), dim=-1).indices                 # next frontier
        src = best // c
        frontier = _Frontier(nodes=count + best, tokens=tokens[-1].gather(1, best), hidden=_gather_rows(out, src),
                             scores=child_scores.gather(1, best), ancestors=_gather_rows(anc, src),
                             paths=None if rule is None else _gather_rows(child_paths, best))
        count += f * c
    num_nodes = torch.where(num_nodes < 0, count, num_nodes)
    return _as_tree(tokens, parents, depths, scores, count, num_nodes)


def _root_frontier(drafter, root, context, context_kv, past_valid, last_slot):
    """Step 1's frontier (the root, its hidden input the last committed token's fused features,
    zeros for a row with none) and the committed context as every run sees it: which slots are
    visible (not the root's own, whose key comes fresh), its keys and values ``[R, heads, S, D]``."""
    rows, device, h = root.shape[0], root.device, drafter.config.hidden_size
    has_ctx = last_slot >= 0
    if context.shape[1]:
        last = _gather_rows(context, last_slot.clamp(min=0)[:, None])[:, 0, :h]
    else:
        last = context.new_zeros(rows, h)
    slot = torch.arange(context.shape[1], device=device)
    ctx_visible = past_valid & (slot[None] != last_slot[:, None])
    ctx_k, ctx_v = context_kv[:, :, 0].transpose(1, 2), context_kv[:, :, 1].transpose(1, 2)
    frontier = _Frontier(nodes=root.new_zeros(rows, 1), tokens=root[:, None],
                         hidden=torch.where(has_ctx[:, None], last, 0)[:, None],
                         scores=torch.zeros(rows, 1, device=device),
                         ancestors=torch.zeros(rows, 1, 0, dtype=torch.bool, device=device),
                         paths=root.new_zeros(rows, 1, 0))
    return frontier, ctx_visible, ctx_k, ctx_v


def _as_tree(tokens: list, parents: list, depths: list, scores: list, count: int, num_nodes: torch.Tensor) -> Tree:
    """The drafted nodes' per-step pieces as one :class:`Tree`, nodes past ``num_nodes`` padding."""
    tokens, scores = torch.cat(tokens, 1)[:, :count], torch.cat(scores, 1)[:, :count]
    live = torch.arange(count, device=tokens.device)[None] < num_nodes[:, None]
    return Tree(tokens=torch.where(live, tokens, 0), parents=torch.where(live, torch.cat(parents, 1)[:, :count], -1)
                .to(torch.int32), depths=torch.where(live, torch.cat(depths, 1)[:, :count], -1).to(torch.int32),
                scores=torch.where(live, scores, float("-inf")), num_nodes=num_nodes.to(torch.int32))


def eagle3_draft(drafter, state, *, width: int, children: int, early_exit: float | None,
                 steps: int | None = None) -> Tree:
    """:func:`draft_eagle3_tree` for every row of a decoder batch ``state`` (its context, keys and
    values per committed slot; ``steps`` steps, default the drafter's ``num_steps``)."""
    n = state.cache_len
    last_slot = torch.where(state.length > state.pad, state.length - 1, -1)
    return draft_eagle3_tree(drafter, state.root, state.position, state.context[:, :n], state.context_kv[0][:, :n],
                             state.past_valid, last_slot, steps=steps or drafter.config.num_steps, width=width,
                             children=children, early_exit=early_exit)
