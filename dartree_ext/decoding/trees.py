"""The draft tree builders of the block-drafter methods, one function per kind of tree
(:attr:`Method.tree <dartree_ext.decoding.methods.Method.tree>` names it), over one drafter pass.

Each builder takes a :class:`TreeRequest` (the drafter's pass and the tree's settings) and
returns a :class:`~dartree_ext.tree.Tree` whose node 0 is each row's root. A new method that
grows its tree a new way adds a builder here and an entry in :mod:`.methods`.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from .. import ops
from .._widths import depth_widths
from ..tree import Tree, build_dartree, candidates, seq_heap, supertree_as_tree


@dataclasses.dataclass(frozen=True)
class TreeRequest:
    """One drafter pass and how to grow a tree from it: ``hidden [B, D, H]`` and ``base_logits
    [B, D, V]`` (over a draft vocabulary ``vocab int64[V']``: its target ids), ``root int64[B]``;
    B, W, K and beta; ``scored``: the nodes need scores to be cut by (``budget="auto"``);
    ``cap``: build only what the best ``cap`` nodes need; ``head`` and ``project``: the
    correction head and how its ``z`` is computed."""

    hidden: torch.Tensor | None
    base_logits: torch.Tensor
    root: torch.Tensor
    vocab: torch.Tensor | None
    budget: int
    width: int | tuple
    K: int
    depth_bonus: float
    scored: bool = False
    cap: int | None = None
    head: object = None
    project: Callable | None = None

    def ids(self, i: torch.Tensor) -> torch.Tensor:
        return i if self.vocab is None else self.vocab[i]

    @property
    def k(self) -> int:
        return min(self.K, self.base_logits.shape[-1])

    def root_state(self) -> torch.Tensor:
        head = self.head
        return torch.zeros(self.root.shape[0], head.w_s.shape[1], dtype=head.w_s.dtype, device=self.root.device)


def plain_tree(root: torch.Tensor) -> Tree:
    """The root alone: a plain decoding step."""
    batch, device = root.shape[0], root.device  # (not chain_tree: every round of `ar` builds one)
    return Tree(tokens=root[:, None].clone(), parents=torch.full((batch, 1), -1, dtype=torch.int32, device=device),
                depths=torch.zeros(batch, 1, dtype=torch.int32, device=device),
                scores=torch.zeros(batch, 1, device=device),
                num_nodes=torch.ones(batch, dtype=torch.int32, device=device))


def chain_tree(root: torch.Tensor, tokens: torch.Tensor, scores: torch.Tensor) -> Tree:
    """A chain: ``root int64[B]`` then ``tokens int64[B, D]`` below it, each node the child of the one
    before; ``scores [B, D + 1]``."""
    batch, n = root.shape[0], tokens.shape[1] + 1
    steps = torch.arange(n, device=root.device, dtype=torch.int32).expand(batch, n)
    return Tree(tokens=torch.cat([root[:, None], tokens.to(root.device)], 1), parents=(steps - 1).contiguous(),
                depths=steps.contiguous(), scores=scores,
                num_nodes=torch.full((batch,), n, dtype=torch.int32, device=root.device))


def top1_chain(base_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each depth's most likely draft token ``int64[B, D]`` and the chain's path log-probabilities
    ``[B, D + 1]`` (0 at the root, then the cumulative top-1 log-probability): the scores the
    calibrated estimate cuts a chain by, greedy or sampled."""
    top = torch.log_softmax(base_logits.float(), -1).max(-1)
    root = torch.zeros(base_logits.shape[0], 1, device=base_logits.device)
    return top.indices, torch.cat([root, top.values.cumsum(1)], 1)


def _chain(r: TreeRequest) -> Tree:
    """The drafter's top-1 token at every position (scored by path log-probability when cut by cost)."""
    if r.scored:
        tokens, scores = top1_chain(r.base_logits)
        return chain_tree(r.root, r.ids(tokens), scores.to(r.root.device))
    batch, n = r.root.shape[0], r.base_logits.shape[1] + 1
    return chain_tree(r.root, r.ids(r.base_logits.argmax(-1)), torch.zeros(batch, n, device=r.root.device))


def _corrected_chain(r: TreeRequest) -> Tree:
    """The correction head's best token at every position, along the chain."""
    head = r.head
    cand_ids, cand_base = candidates(r.base_logits, r.k)
    sup = ops.build_supertree(head, head.project(r.hidden).contiguous(), r.ids(cand_ids).contiguous(),
                              cand_base.to(head.w_s.dtype).contiguous(), r.root_state(), [1] * r.base_logits.shape[1],
                              0.0, validate=False)
    return supertree_as_tree(*sup, r.root)


def _ddtree(r: TreeRequest) -> Tree:
    """DDTree: best-first over the drafter's per-position top-K log-probabilities."""
    budget = r.budget if r.cap is None else min(r.budget, r.cap)
    logprobs, top = torch.topk(torch.log_softmax(r.base_logits.float(), -1), r.k, dim=-1)
    return Tree(*ops.ddtree_heap(logprobs.contiguous(), r.ids(top).contiguous(), r.root, budget, validate=False))


def _dartree(r: TreeRequest, fixed: bool = False) -> Tree:
    """DARTree: grown depth by depth (W kept per depth, K candidates), pruned to B by one top-B;
    ``fixed``: ``budget // depth`` nodes per depth, no pruning."""
    budget, width = r.budget, r.width
    if not fixed and r.cap is not None and r.cap < budget:
        budget = r.cap  # the best cap nodes (depth bonus <= 0: among each depth's best cap)
        if r.depth_bonus <= 0:
            width = tuple(min(w, r.cap) for w in depth_widths(width, r.base_logits.shape[1]))
    return build_dartree(r.head, r.hidden, r.base_logits, r.root, r.root_state(), k=r.k, width=width, budget=budget,
                         depth_bonus=r.depth_bonus, fixed=fixed, vocab=r.vocab, z=r.project(r.hidden))


def _seq_heap(r: TreeRequest) -> Tree:
    """The sequential best-first heap baseline over the correction head's scores."""
    head = r.head
    cand_ids, cand_base = candidates(r.base_logits, r.k)
    return seq_heap(head, head.project(r.hidden), r.ids(cand_ids), cand_base.to(head.w_s.dtype), r.root,
                    r.root_state(), r.budget, r.depth_bonus)


BUILDERS: dict[str, Callable[[TreeRequest], Tree]] = {
    "chain": _chain, "corrected_chain": _corrected_chain, "ddtree": _ddtree, "dartree": _dartree,
    "dartree_fixed": lambda r: _dartree(r, fixed=True), "seq_heap": _seq_heap,
}
