"""``sampled_draft``: a chain drawn from the drafter's distributions at T > 0, verified by
speculative sampling (:func:`~dartree_ext.sampling.speculative_tokens`)."""
from __future__ import annotations

import dataclasses

import torch

from ..sampling import sample_from_probs
from ..tree import Tree
from .trees import chain_tree, top1_chain


@dataclasses.dataclass
class DraftQ:
    """``sampled_draft``: the distributions a chain's tokens were drawn from, ``q float32[B, D, V']``
    (row ``d``: depth ``d + 1``), over the draft vocabulary ``vocab int64[V']`` (its target ids;
    ``None``: the target's vocabulary). Spread over the target's vocabulary only for the nodes
    verified (:func:`children_and_q`)."""
    q: torch.Tensor
    vocab: torch.Tensor | None = None


def sampled_chain(base_logits: torch.Tensor, root: torch.Tensor, vocab: torch.Tensor | None,
                  sampling: dict) -> tuple[Tree, DraftQ]:
    """``sampled_draft`` at T > 0: a chain whose token at each depth is drawn from the drafter's
    distribution there (``softmax(base_logits / temperature)``, block-parallel, so each
    depth's distribution is known whatever was drawn before it), and those distributions over
    the draft vocabulary (:class:`DraftQ`; :func:`~dartree_ext.decoding.phases.verify` accepts each token with
    :func:`~dartree_ext.sampling.speculative_tokens`).

    Its scores are the top-1 chain's (cumulative log-probability of each depth's most likely
    token), not the drawn tokens': ``budget="auto"`` cuts the chain by its scores, and a cut
    that looked at a drawn token would bias what is emitted there (a token drawn from q but
    verified only when it is a likely one is no longer a draw from q)."""
    q = torch.softmax(base_logits.float() / sampling["temperature"], -1)
    drawn = sample_from_probs(q, sampling.get("generator"))
    _, scores = top1_chain(base_logits)  # depends on the drafter's pass alone
    if vocab is not None:
        drawn = vocab.to(drawn.device)[drawn]
    return chain_tree(root, drawn, scores.to(root.device)), DraftQ(q, vocab)

def children_and_q(tree: Tree, draft_q: DraftQ, vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each node's one child token (-1: none) in a (possibly cut) sampled chain, and the
    distribution it was drawn from (its depth's row of ``draft_q``) over the target's
    ``vocab_size`` tokens: ``int64[B, N]``, ``float32[B, N, V]``."""
    rows, n = tree.tokens.shape
    node = torch.arange(n, device=tree.tokens.device)[None]
    live = (node >= 1) & (node < tree.num_nodes[:, None]) & (tree.parents >= 0)
    slot = torch.where(live, tree.parents.long(), n)  # dead nodes write to a spare column
    child = torch.full((rows, n + 1), -1, dtype=torch.int64, device=node.device)
    child.scatter_(1, slot, node.expand(rows, -1).clone())
    child = child[:, :n]
    has = child >= 0
    tokens = torch.where(has, tree.tokens.gather(1, child.clamp(min=0)), -1)
    depth = tree.depths.gather(1, child.clamp(min=0)).long().clamp(min=1) - 1
    q = draft_q.q.gather(1, depth[..., None].expand(-1, -1, draft_q.q.shape[-1]))
    if draft_q.vocab is not None:
        full = q.new_zeros(rows, n, vocab_size)
        full[..., draft_q.vocab.to(q.device)] = q
        q = full
    return tokens, q
