"""Draft-tree construction on top of the ops: DARTree (fixed and pruned) and the sequential
heap baseline it approximates.

* :func:`build_dartree`: candidates (top-K of the drafter's base logits per position), the
  supertree (:func:`dartree_ext.ops.build_supertree`), then one global top-B
  (:func:`dartree_ext.ops.select_top_b`); ``fixed=True`` is DARTree (fixed): B / D children per
  depth and no pruning.
* :func:`seq_heap`: node-wise best-first search with corrected scores, one head call per popped
  node -- the exact search DARTree approximates (the paper's "Sequential Correction w. Heap").
"""
from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import torch

from . import ops, reference
from ._widths import width_list


@dataclasses.dataclass
class GRUCorrectionHead:
    """The Domino-style GRU causal-correction head, in the layout the expand ops read.

    corrected logits at position d for a branch with state s:
    ``L_d + fc2(SiLU(W_z H_d + b1 + w_s s))``; the state after a token t is
    ``GRUCell(E[t], s)``, whose input gates ``E[t] W_ih^T + b_ih`` are precomputed for the whole
    vocabulary in ``gru_table`` (so the kernels never multiply by W_ih).
    """

    w_z: torch.Tensor         # [E, H]: drafter hidden -> head
    b1: torch.Tensor | None   # [E]
    w_s: torch.Tensor         # [E, G]: state -> head
    fc2_weight: torch.Tensor  # [V, E]
    fc2_bias: torch.Tensor | None  # [V]
    gru_table: torch.Tensor   # [V, 3G]
    w_hh: torch.Tensor        # [3G, G]
    b_hh: torch.Tensor | None  # [3G]

    @classmethod
    def from_modules(cls, embedding: torch.nn.Embedding, gru: torch.nn.GRUCell, w_z: torch.nn.Linear,
                     w_s: torch.nn.Linear, fc2: torch.nn.Linear) -> "GRUCorrectionHead":
        """Gather the tensors from modules: ``w_z: H -> E`` (its bias is b1), ``w_s: G -> E`` (no
        bias), ``fc2: E -> V``, ``gru: GRUCell(embedding_dim, G)``."""
        with torch.no_grad():
            table = embedding.weight @ gru.weight_ih.T
            if gru.bias_ih is not None:
                table = table + gru.bias_ih
            return cls(w_z=w_z.weight.detach(), b1=None if w_z.bias is None else w_z.bias.detach(),
                       w_s=w_s.weight.detach(), fc2_weight=fc2.weight.detach(),
                       fc2_bias=None if fc2.bias is None else fc2.bias.detach(), gru_table=table.detach(),
                       w_hh=gru.weight_hh.detach(), b_hh=None if gru.bias_hh is None else gru.bias_hh.detach())

    @classmethod
    def random(cls, vocab: int, hidden: int, e: int, g: int, *, dtype: torch.dtype = torch.float32,
               device: str | torch.device = "cpu", seed: int = 0, bias: bool = True) -> "GRUCorrectionHead":
        """A randomly initialised head (tests and benchmarks)."""
        gen = torch.Generator().manual_seed(seed)

        def rand(*shape, scale):
            return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)

        return cls(w_z=rand(e, hidden, scale=hidden ** -0.5), b1=rand(e, scale=0.1) if bias else None,
                   w_s=rand(e, g, scale=g ** -0.5), fc2_weight=rand(vocab, e, scale=e ** -0.5),
                   fc2_bias=rand(vocab, scale=0.1) if bias else None, gru_table=rand(vocab, 3 * g, scale=0.5),
                   w_hh=rand(3 * g, g, scale=g ** -0.5), b_hh=rand(3 * g, scale=0.1) if bias else None)

    def project(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        """z = W_z H + b1 for drafter hidden states [..., H] -> [..., E], in the head's dtype."""
        z = drafter_hidden.to(self.w_z.dtype) @ self.w_z.T
        return z if self.b1 is None else z + self.b1


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
                      root_tokens: torch.Tensor) -> Tree:
    """Prepend the root and drop padding (depth -1), keeping depth-major order (topological)."""
    batch, m = tokens.shape
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
    keep, new_parents, num_kept = ops.select_top_b(tree.parents, tree.scores, tree.num_nodes, budget)
    present = keep >= 0
    index = keep.long().clamp(min=0)
    return Tree(tokens=torch.where(present, torch.gather(tree.tokens, 1, index), 0), parents=new_parents,
                depths=torch.where(present, torch.gather(tree.depths, 1, index), -1),
                scores=torch.where(present, torch.gather(tree.scores, 1, index), float("-inf")), num_nodes=num_kept)


def depth_widths(width: int | Sequence[int], depth: int) -> list[int]:
    """Children kept per depth: an int W for every depth, or per-depth widths ``(w1, w2, ...)``
    whose last value repeats down to ``depth`` (``(32, 12)`` = 32 at depth 1, 12 below); a list
    longer than ``depth`` is cut. Every width must be >= 1."""
    widths = width_list(width, 1)
    if not widths or min(widths) < 1:
        raise ValueError(f"widths must be >= 1 (an int or a non-empty sequence), got {width!r}")
    return (widths + [widths[-1]] * depth)[:depth]


def parse_width(text: str) -> int | tuple[int, ...]:
    """``"12"`` -> 12, ``"32,12"`` -> (32, 12) (the command-line form of a width)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"a width is W or w1,w2,... (integers), got {text!r}") from None
    depth_widths(values, 1)  # validates
    return values[0] if len(values) == 1 else values


def build_dartree(head: GRUCorrectionHead, drafter_hidden: torch.Tensor, base_logits: torch.Tensor,
                  root_tokens: torch.Tensor, root_state: torch.Tensor, k: int = 64,
                  width: int | Sequence[int] = 12, budget: int = 64, depth_bonus: float = -0.2,
                  fixed: bool = False, vocab: torch.Tensor | None = None) -> Tree:
    """DARTree for one drafter pass: ``drafter_hidden [B, D, H]``, ``base_logits [B, D, V]``,
    ``root_tokens int64[B]``, ``root_state [B, G]``. Returns at most ``budget + 1`` nodes per
    request (root included). ``width``: W for every depth, or per-depth widths
    (:func:`depth_widths`). ``fixed=True``: ``budget // D`` children per depth, no pruning.
    ``vocab int64[V']``: ``base_logits`` are over a draft vocabulary whose entry ``i`` is target
    token ``vocab[i]``."""
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
    z = head.project(drafter_hidden)
    supertree = ops.build_supertree(head, z.contiguous(), cand_ids.contiguous(),
                                    cand_base.to(head.w_s.dtype).contiguous(),
                                    root_state.to(head.w_s.dtype).contiguous(), widths, depth_bonus)
    tree = supertree_as_tree(*supertree, root_tokens)
    return tree if fixed else prune(tree, budget)


def seq_heap(head: GRUCorrectionHead, z: torch.Tensor, cand_ids: torch.Tensor, cand_base: torch.Tensor,
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
            logq = reference.corrected_logprobs(head, z[b:b + 1, d], cand_ids[b:b + 1, d], cand_base[b:b + 1, d],
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
            states.append(reference.gru_update(head, torch.tensor([token], device=z.device), states[parent][None])[0])
            push_children(len(tokens) - 1)
        n = len(tokens)
        out.tokens[b, :n] = torch.tensor(tokens)
        out.parents[b, :n] = torch.tensor(parents, dtype=torch.int32)
        out.depths[b, :n] = torch.tensor(depths, dtype=torch.int32)
        out.scores[b, :n] = torch.tensor(scores)
        out.num_nodes[b] = n
    return out
