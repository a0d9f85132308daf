"""Draft-tree construction on top of the ops: DARTree (fixed and pruned) and the sequential
heap baseline it approximates.

* :func:`build_dartree`: candidates (top-K of the drafter's base logits per position), the
  supertree (:func:`dartree_ext.ops.build_supertree`), then one global top-B
  (:func:`dartree_ext.ops.select_top_b`); ``fixed=True`` is DARTree (fixed): B / D children per
  depth and no pruning.
* :func:`seq_heap`: node-wise best-first search with corrected scores, one head call per popped
  node -- the exact search DARTree approximates (the paper's "Sequential Correction w. Heap").

The head they read is :class:`dartree_ext.head.CorrectionHeadWeights`; ``depth_widths`` and
``parse_width`` (how a width is read) live in ``dartree_ext._widths`` and are importable from here.
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import torch

from . import ops
from ._widths import depth_widths, parse_width  # noqa: F401  (parse_width: re-exported for the command lines)
from .head import CorrectionHeadWeights, corrected_logprobs, gru_update


@dataclasses.dataclass
class Tree:
    """A draft tree in the shared layout: node 0 is the root, parents before children."""

    tokens: torch.Tensor     # int64[B, N]
    parents: torch.Tensor    # int32[B, N]
    depths: torch.Tensor     # int32[B, N]
    scores: torch.Tensor     # float32[B, N]
    num_nodes: torch.Tensor  # int32[B]


def candidates(base_logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-K token ids of the drafter's base logits per position and their logits."""
    values, ids = torch.topk(base_logits, k, dim=-1)
    return ids, values


def supertree_as_tree(tokens: torch.Tensor, parents: torch.Tensor, depths: torch.Tensor, scores: torch.Tensor,
                      root_tokens: torch.Tensor, padded: bool = True) -> Tree:
    """Prepend the root and drop padding (depth -1), keeping depth-major order (topological).
    ``padded=False`` promises there is none (``build_supertree`` pads a depth only when its
    parents have fewer than its width of candidates in all: K < W): the root is prepended and
    the parents shifted, nothing moves."""
    batch, m = tokens.shape
    if not padded:
        root_col = torch.zeros(batch, 1, dtype=torch.int32, device=tokens.device)
        return Tree(tokens=torch.cat([root_tokens[:, None], tokens], 1),
                    parents=torch.cat([root_col - 1, parents + 1], 1),  # -1 (the root) becomes 0
                    depths=torch.cat([root_col, depths], 1),
                    scores=torch.cat([root_col.to(scores.dtype), scores], 1),
                    num_nodes=torch.full((batch,), m + 1, dtype=torch.int32, device=tokens.device))
    valid = depths >= 0
    # stable order: valid nodes first, in their original order
    order = torch.sort((~valid).int(), dim=1, stable=True).indices
    new_index = torch.empty_like(order).scatter_(1, order, torch.arange(m, device=order.device).expand(batch, -1)
                                                 .contiguous())
    num_valid = valid.sum(1)
    p_old = torch.gather(parents.long(), 1, order)
    p_new = torch.where(p_old >= 0, torch.gather(new_index, 1, p_old.clamp(min=0)) + 1, 0)
    keep = torch.arange(m, device=order.device)[None, :] < num_valid[:, None]
    root_col = torch.zeros(batch, 1, dtype=torch.long, device=order.device)
    return Tree(
        tokens=torch.cat([root_tokens[:, None], torch.where(keep, torch.gather(tokens, 1, order), 0)], 1),
        parents=torch.cat([root_col - 1, torch.where(keep, p_new, -1)], 1).to(torch.int32),
        depths=torch.cat([root_col, torch.where(keep, torch.gather(depths.long(), 1, order), -1)], 1).to(torch.int32),
        scores=torch.cat([root_col.float(), torch.where(keep, torch.gather(scores, 1, order), float("-inf"))], 1),
        num_nodes=(num_valid + 1).to(torch.int32),
    )


def prune(tree: Tree, budget: int) -> Tree:
    """Keep the root plus the ``budget`` best nodes (heap semantics, Lemma 1 fast path)."""
    keep, new_parents, num_kept = ops.select_top_b(tree.parents, tree.scores, tree.num_nodes, budget, validate=False)
    present = keep >= 0
    index = keep.long().clamp(min=0)
    return Tree(tokens=torch.where(present, torch.gather(tree.tokens, 1, index), 0), parents=new_parents,
                depths=torch.where(present, torch.gather(tree.depths, 1, index), -1),
                scores=torch.where(present, torch.gather(tree.scores, 1, index), float("-inf")), num_nodes=num_kept)


def build_dartree(head: CorrectionHeadWeights, drafter_hidden: torch.Tensor, base_logits: torch.Tensor,
                  root_tokens: torch.Tensor, root_state: torch.Tensor, k: int = 64,
                  width: int | Sequence[int] = 12, budget: int = 64, depth_bonus: float = -0.2,
                  fixed: bool = False, vocab: torch.Tensor | None = None, z: torch.Tensor | None = None) -> Tree:
    """DARTree for one drafter pass: ``drafter_hidden [B, D, H]``, ``base_logits [B, D, V]``,
    ``root_tokens int64[B]``, ``root_state [B, G]``. Returns at most ``budget + 1`` nodes per
    request (root included). ``width``: W for every depth, or per-depth widths
    (:func:`depth_widths`). ``fixed=True``: ``budget // D`` children per depth, no pruning.
    ``vocab int64[V']``: ``base_logits`` are over a draft vocabulary whose entry ``i`` is target
    token ``vocab[i]``. ``z``: ``head.project(drafter_hidden)`` when the caller has it (computed
    its own way, e.g. through the drafter's linear set-up)."""
    depth = drafter_hidden.shape[1]
    if depth < 1:
        raise ValueError("drafter_hidden must have at least one position (dim 1)")
    if k < 1 or budget < 0:
        raise ValueError(f"need k >= 1 and budget >= 0, got k={k}, budget={budget}")
    widths = [max(1, budget // depth)] * depth if fixed else depth_widths(width, depth)
    k = min(k, base_logits.shape[-1])
    cand_ids, cand_base = candidates(base_logits, k)
    if vocab is not None:
        cand_ids = vocab[cand_ids]
    if z is None:
        z = head.project(drafter_hidden)
    supertree = ops.build_supertree(head, z.contiguous(), cand_ids.contiguous(),
                                    cand_base.to(head.w_s.dtype).contiguous(),
                                    root_state.to(head.w_s.dtype).contiguous(), widths, depth_bonus, validate=False)
    tree = supertree_as_tree(*supertree, root_tokens, padded=k < max(widths))
    return tree if fixed else prune(tree, budget)


def seq_heap(head: CorrectionHeadWeights, z: torch.Tensor, cand_ids: torch.Tensor, cand_base: torch.Tensor,
             root_tokens: torch.Tensor, root_state: torch.Tensor, budget: int = 64,
             depth_bonus: float = -0.2) -> Tree:
    """Node-wise best-first search with corrected scores: pop the best node, compute its state
    and its K children's corrected scores (one head call), push them; stop at ``budget`` nodes.
    Sequential by nature (the cost DARTree avoids). Ties go to the earlier push."""
    batch, depth, k = cand_ids.shape
    slots = budget + 1
    out = Tree(tokens=torch.zeros(batch, slots, dtype=torch.int64), parents=torch.full((batch, slots), -1,
                                                                                         dtype=torch.int32),
               depths=torch.full((batch, slots), -1, dtype=torch.int32),
               scores=torch.full((batch, slots), float("-inf")), num_nodes=torch.zeros(batch, dtype=torch.int32))
    for b in range(batch):
        tokens, parents, depths, scores = [int(root_tokens[b])], [-1], [0], [0.0]
        states = [root_state[b].float()]
        frontier: list = []
        seq = 0

        def push_children(node: int) -> None:
            nonlocal seq
            d = depths[node]
            if d >= depth:
                return
            logq = corrected_logprobs(head, z[b:b + 1, d], cand_ids[b:b + 1, d], cand_base[b:b + 1, d],
                                                states[node][None, None, :])[0, 0]
            child_scores = (scores[node] + logq + depth_bonus).tolist()
            for c in range(k):
                heapq.heappush(frontier, (-child_scores[c], seq, node, c))
                seq += 1

        push_children(0)
        while frontier and len(tokens) <= budget:
            neg_score, _, parent, c = heapq.heappop(frontier)
            d = depths[parent]
            token = int(cand_ids[b, d, c])
            tokens.append(token)
            parents.append(parent)
            depths.append(d + 1)
            scores.append(-neg_score)
            states.append(gru_update(head, torch.tensor([token], device=z.device), states[parent][None])[0])
            push_children(len(tokens) - 1)
        n = len(tokens)
        out.tokens[b, :n] = torch.tensor(tokens)
        out.parents[b, :n] = torch.tensor(parents, dtype=torch.int32)
        out.depths[b, :n] = torch.tensor(depths, dtype=torch.int32)
        out.scores[b, :n] = torch.tensor(scores)
        out.num_nodes[b] = n
    return out
