"""The correction head's weights as the tree code reads them, and the head's two steps in plain
PyTorch.

* :class:`CorrectionHeadWeights`: the Domino-style GRU causal-correction head, in the layout the
  expand ops (:func:`dartree_ext.ops.expand_depth`, :func:`dartree_ext.ops.build_supertree`) read;
  :meth:`dartree_ext.models.BlockDrafter.export_head` returns one.
* :func:`corrected_logprobs` and :func:`gru_update`: one corrected-score step and one state step
  over a few candidates, as :func:`dartree_ext.tree.seq_heap` takes them node by node (the
  pure-PyTorch reference of the expand ops, :mod:`dartree_ext.reference`, builds on them too).
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["CorrectionHeadWeights", "corrected_logprobs", "gru_update"]


@dataclasses.dataclass
class CorrectionHeadWeights:
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
                     w_s: torch.nn.Linear, fc2: torch.nn.Linear) -> "CorrectionHeadWeights":
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
               device: str | torch.device = "cpu", seed: int = 0, bias: bool = True) -> "CorrectionHeadWeights":
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


def corrected_logprobs(head: CorrectionHeadWeights, z: torch.Tensor, cand_ids: torch.Tensor,
                       cand_base: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """log q(k | parent) over the K candidates, float32[B, P, K], for parent states [B, P, G],
    z [B, E], candidates [B, K]."""
    hidden = torch.nn.functional.silu(z.float()[:, None, :] + states @ head.w_s.float().T)  # [B, P, E]
    rows = head.fc2_weight[cand_ids].float()  # [B, K, E]: only the K candidate rows
    logits = cand_base.float()[:, None, :] + hidden @ rows.transpose(1, 2)
    if head.fc2_bias is not None:
        logits = logits + head.fc2_bias[cand_ids].float()[:, None, :]
    return torch.log_softmax(logits, dim=-1)


def gru_update(head: CorrectionHeadWeights, tokens: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """torch.nn.GRUCell on precomputed input gates gi = gru_table[tokens]; float32."""
    gi = head.gru_table[tokens].float()
    gh = states @ head.w_hh.float().T
    if head.b_hh is not None:
        gh = gh + head.b_hh.float()
    g = states.shape[-1]
    r = torch.sigmoid(gi[..., :g] + gh[..., :g])
    u = torch.sigmoid(gi[..., g:2 * g] + gh[..., g:2 * g])
    n = torch.tanh(gi[..., 2 * g:] + r * gh[..., 2 * g:])
    return (1 - u) * n + u * states
