"""Training an :class:`~dartree_ext.models.eagle3.Eagle3Drafter` with the training-time test.

The drafter is unrolled ``K = num_steps`` steps from each sampled root: step 1 reads the target's
fused features, step ``k > 1`` its own step ``k - 1`` hidden state at the previous index, every
step the data's token embeddings. The block of a sampled root ``r`` is the ``K`` predictions of
``x[r + 1 .. r + K]``: step ``k`` at index ``r + k - 1``. Only the sampled roots' paths are run
(:meth:`~dartree_ext.models.eagle3.Eagle3Drafter.unroll_blocks`; the drafter's ``forward`` runs
every step at every index and gives the same rows). Losses:

* ``eagle3`` (EAGLE-3's): ``sum_k 0.8^(k-1) CE(p_k, q_k)`` (soft labels: the target's
  distribution), averaged over blocks; the verification head is trained alongside on detached
  hidden states (it never shapes the drafter), with the labels of simulated verification;
* ``vat`` (and the other schedules of :data:`dartree_ext.vat.SCHEDULES`): :func:`dartree_ext.vat.vat_loss`
  over each block, i.e. simulated verification labels, weights ``1`` before the first rejection
  ``k*`` and ``w_{k - k* + 1}`` after it (base schedule ``w_k = exp(-(k - 1) / decay_gamma)``;
  ``0.8^(k-1)`` at :data:`~dartree_ext.models.eagle3.EAGLE3_DECAY_GAMMA`), soft + hard CE (soft
  only with ``vat_soft``: EAGLE-3's labels with VAT's weights) and the verification head's BCE.
"""
from __future__ import annotations

import torch
from torch import nn

from ..models.eagle3 import EAGLE3_DECAY_GAMMA, Eagle3Drafter
from ..vat import SCHEDULES, vat_loss
from .scales import global_scales

EAGLE3_LOSSES = ("eagle3",) + SCHEDULES


def block_hidden(outs: list[torch.Tensor], roots: torch.Tensor) -> torch.Tensor:
    """The unrolled outputs of each block: ``outs`` = per step ``[S, T, H]``, ``roots int64[S, n]``
    -> ``[S * n, K, H]`` with step ``k`` (1-based) read at index ``root + k - 1`` (clamped to the
    sequence; positions past it are invalid anyway)."""
    stacked = torch.stack(outs, 2)                                   # [S, T, K, H]
    s, t, k, _ = stacked.shape
    idx = (roots[..., None] + torch.arange(k, device=roots.device)).clamp(max=t - 1)  # [S, n, K]
    rows = torch.arange(s, device=roots.device)[:, None, None]
    hidden = stacked[rows, idx, torch.arange(k, device=roots.device)]
    return hidden.reshape(-1, k, stacked.shape[-1])


def eagle3_weights(steps: int, device=None) -> torch.Tensor:
    """EAGLE-3's step weights ``0.8^(k-1)``, ``k = 1..steps``."""
    return torch.exp(-torch.arange(steps, device=device, dtype=torch.float32) / EAGLE3_DECAY_GAMMA)


def eagle3_soft_ce(draft_logits: torch.Tensor, target_logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_m sum_k 0.8^(k-1) CE(softmax(target), softmax(draft))`` over valid positions, divided by
    the blocks with a valid position."""
    soft = -(torch.softmax(target_logits.float(), -1) * torch.log_softmax(draft_logits.float(), -1)).sum(-1)
    w = eagle3_weights(draft_logits.shape[1], draft_logits.device)
    blocks = valid.any(1).sum().clamp(min=1)
    return (torch.where(valid, w * soft, 0.0)).sum() / blocks


class Eagle3Objective(nn.Module):
    """The trainable part as one module (DDP sees one forward): unrolled drafter -> loss."""

    def __init__(self, drafter: Eagle3Drafter, cfg) -> None:
        super().__init__()
        if cfg.loss not in EAGLE3_LOSSES:
            raise ValueError(f"an EAGLE-3 drafter trains with loss {', '.join(EAGLE3_LOSSES)}, got {cfg.loss!r}")
        self.drafter, self.cfg = drafter, cfg

    def forward(self, batch, tb, generator: torch.Generator | None = None) -> dict:
        d, cfg = self.drafter, self.cfg
        device = tb.features.device
        normed, logits = d.head(d.unroll_blocks(tb.features, batch.sequences.to(device), batch.anchors.to(device)))
        labels = torch.where(tb.valid, tb.labels, 0)
        target_logits = tb.logits.to(logits.dtype)
        opts = dict(rule=cfg.rule, vh_weight=cfg.vh_weight, generator=generator, accept_width=cfg.accept_width)
        block_scale, position_scale = global_scales(tb.valid)
        if cfg.loss == "eagle3":
            vh = d.verification_head(normed.detach())
            base = vat_loss(logits.detach(), target_logits, labels, vh, tb.valid, schedule="dflash",
                            decay_gamma=EAGLE3_DECAY_GAMMA, **opts)
            ce = eagle3_soft_ce(logits, target_logits, tb.valid)
            weights = torch.where(tb.valid, eagle3_weights(logits.shape[1], device), 0.0)
            base = base._replace(loss=ce + cfg.vh_weight * base.vh_loss, ce_loss=ce, weights=weights)
        else:
            base = vat_loss(logits, target_logits, labels, d.verification_head(normed), tb.valid,
                            schedule=cfg.loss, decay_gamma=cfg.decay_gamma, **opts)
        loss = base.ce_loss * block_scale + cfg.vh_weight * base.vh_loss * position_scale
        return {"base": base, "valid": tb.valid, "loss": loss}
