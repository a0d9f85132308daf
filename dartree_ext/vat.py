"""VAT (verification-aware training) loss for block drafters, on the ``torch.ops.dartree_ext.vat_*`` ops.

Math (per block ``m`` of ``K`` draft positions, ``k = 1..K`` 1-based, only *valid* positions take part):

* ``q_k = softmax(draft_logits[m, k])``, ``p_k = softmax(target_logits[m, k])`` (temperature 1: the
  temperature only changes the *sampling* rule's acceptance, never the soft targets or the CE terms);
* acceptance ``m_k``: ``rule="greedy"``: ``argmax q_k == argmax p_k`` (ties to the lowest index);
  ``rule="sample"``: ``x ~ softmax(draft / T)`` by inverse CDF with one uniform ``u1`` (the first
  vocabulary index whose inclusive CDF exceeds ``u1``), accepted iff ``u2 * q_T(x) < p_T(x)``, i.e. with
  probability ``min(1, p_T(x) / q_T(x))``, where ``p_T = softmax(target / T)``; the uniforms are drawn in
  Python (``generator``), so the kernels are deterministic; :func:`vat_loss`'s ``accept_width = W > 1``
  (greedy only) simulates a tree of W children a node instead of a chain: accepted iff ``argmax p_k``
  is among the W largest entries of ``q_k``;
* ``k*`` = first valid position with ``m_k = 0`` (``K + 1`` if none): invalid positions never reject;
  ``v_k = 1`` iff ``k < k*`` (the verification head's label, ``prod_{j<=k} m_j`` over valid positions);
* weights ``w_k`` by ``schedule`` (``gamma = decay_gamma``):

  - ``"vat"``: ``1`` for ``k < k*``, ``exp(-(k - k*) / gamma)`` for ``k >= k*`` (the paper's shifted decay);
  - ``"dflash"``: ``exp(-(k - 1) / gamma)`` for every ``k`` (no dependence on ``k*``) and *hard CE only*;
  - ``"prefix_only"``: ``1`` for ``k < k*``, ``0`` after;
  - ``"hard_cutoff"``: ``1`` for ``k <= k*`` (the first rejected position included), ``0`` after;
  - ``"unshifted"``: ``1`` for ``k < k*``, ``exp(-(k - 1) / gamma)`` for ``k >= k*``;
  - ``"vat_soft"``: ``"vat"``'s weights and *soft CE only* (the EAGLE-3 loss's soft labels with VAT's
    weights);

  and ``w_k = 0`` at invalid positions;
* ``ce_loss = sum_m sum_k w_k (CE(p_k, q_k) + CE(y_k, q_k)) / #blocks with a valid position``
  (``CE(p, q) = -sum_i p_i log q_i``, ``CE(y, q) = -log q_y``; ``dflash`` drops the soft term,
  ``vat_soft`` the hard one);
* ``vh_loss = mean over valid positions of BCE-with-logits(vh_logits, v)`` (0 when ``vh_logits`` is None);
* ``loss = ce_loss + vh_weight * vh_loss``.

Draft vocabulary (``draft_vocab int64[V']``, FR-Spec / EAGLE-3's d2t: the target ids the drafter can
propose): the draft logits are ``[M, K, V']``, the target's stay ``[M, K, V]`` and ``target_tokens``
hold target ids. Then ``q`` lives on ``V'``; the soft target is ``p`` restricted to ``V'`` and
renormalized; the hard label is ``y``'s draft index, and a position whose ``y`` is outside ``V'``
has no hard term; acceptance is what verification would do: ``greedy``: the target's argmax over
all of ``V`` is the token ``argmax q`` stands for (so a position whose target argmax is outside
``V'`` is rejected); ``sample``: ``x ~ q_T`` over ``V'``, accepted iff ``u2 * q_T(x) < p_T(x)`` with
``p_T`` normalized over all of ``V`` (the kernels see ``u2`` divided by ``p_T``'s mass on ``V'``).

Labels (``k*``, ``v``, the weights, ``p``) carry no gradient; gradients flow to the draft logits (or the
draft hidden states and head weight in :func:`vat_loss_linear`) and to ``vh_logits``. The target side is
treated as a constant. ``d ce_loss / d draft_logits[m, k] = w_k (2 q_k - p_k - onehot(y_k)) / #blocks``
(``w_k (q_k - onehot(y_k))`` for ``dflash``, ``w_k (q_k - p_k)`` for ``vat_soft``, over ``#blocks``).

Precision: float32 / bfloat16 / float16 logits are read as they are and reduced in float32 (the
losses are float32); float64 logits are reduced in float64 (losses float64; for gradcheck).
Non-finite losses: the wrappers raise :class:`FloatingPointError` naming the cause (NaN / inf logits
at a valid position, a target token outside the vocabulary, no valid position) when the loss is not
finite, and ``ValueError`` when no position is valid; this reads the loss on the host, i.e.
synchronizes on CUDA. ``check_finite=False`` skips both checks and nothing synchronizes: then a bad
input gives a NaN loss, and a batch without a valid position a loss of 0 (with zero gradients).
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import torch
import torch.nn.functional as F

SCHEDULES = ("vat", "dflash", "prefix_only", "hard_cutoff", "unshifted", "vat_soft")
RULES = ("greedy", "sample")
# the schedule numbers the vat_block_weights kernels take (vat_soft weighs as vat does)
_KERNEL_SCHEDULES = ("vat", "dflash", "prefix_only", "hard_cutoff", "unshifted")
# the cross-entropy terms (soft, hard) a schedule trains; every other schedule trains both
_CE_TERMS = {"dflash": (False, True), "vat_soft": (True, False)}
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)

_ops = torch.ops.dartree_ext


def _kernel_schedule(schedule: str) -> int:
    return _KERNEL_SCHEDULES.index("vat" if schedule == "vat_soft" else schedule)


class VATLossOutput(NamedTuple):
    """What :func:`vat_loss` and :func:`vat_loss_linear` return.

    ``loss``, ``ce_loss``, ``vh_loss``: scalars (float64 for float64 logits, else float32);
    ``first_reject int32[M]``: ``k*`` (1-based, ``K + 1`` when the whole block is accepted);
    ``accept float32[M, K]``: the per-position acceptance ``m_k`` (0 at invalid positions);
    ``weights float32[M, K]``: the CE weights ``w_k`` of the schedule (0 at invalid positions).
    """
    loss: torch.Tensor
    ce_loss: torch.Tensor
    vh_loss: torch.Tensor
    first_reject: torch.Tensor
    accept: torch.Tensor
    weights: torch.Tensor


# ---------------------------------------------------------------------------------------------
# op registrations: fakes and autograd


def _stat_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("dartree_ext::vat_row_forward")
def _vat_row_forward_fake(draft_logits, target_logits, target_tokens, uniforms, temperature):
    rows = draft_logits.shape[0]
    stat = _stat_dtype(draft_logits.dtype)
    stats = [draft_logits.new_empty((rows,), dtype=stat) for _ in range(4)]
    accept = draft_logits.new_empty((rows,), dtype=torch.float32)
    return stats[0], stats[1], accept, stats[2], stats[3]


@torch.library.register_fake("dartree_ext::vat_row_backward")
def _vat_row_backward_fake(g_q, g_p, g_y, draft_logits, target_logits, target_tokens, draft_lse, target_lse):
    return torch.empty_like(draft_logits)


@torch.library.register_fake("dartree_ext::vat_block_weights")
def _vat_block_weights_fake(accept, valid, schedule, decay_gamma):
    return accept.new_empty((accept.shape[0],), dtype=torch.int32), torch.empty_like(accept)


def _row_grad_coefficients(g_soft, g_hard, g_draft_lse, like: torch.Tensor):
    """d/d draft of g_soft * CE(p, q) + g_hard * CE(y, q) + g_lse * lse(draft) = g_q q - g_p p - g_y onehot."""
    def coef(g):
        return torch.zeros_like(like) if g is None else g.to(like.dtype).contiguous()
    g_soft, g_hard, g_lse = coef(g_soft), coef(g_hard), coef(g_draft_lse)
    return (g_soft + g_hard + g_lse).contiguous(), g_soft, g_hard


def _row_forward_setup_context(ctx, inputs, output):
    draft_logits, target_logits, target_tokens, _uniforms, _temperature = inputs
    _ce_soft, _ce_hard, accept, draft_lse, target_lse = output
    ctx.save_for_backward(draft_logits, target_logits, target_tokens, draft_lse, target_lse)
    ctx.mark_non_differentiable(accept)


def _row_forward_backward(ctx, g_soft, g_hard, _g_accept, g_draft_lse, _g_target_lse):
    draft_logits, target_logits, target_tokens, draft_lse, target_lse = ctx.saved_tensors
    g_q, g_p, g_y = _row_grad_coefficients(g_soft, g_hard, g_draft_lse, draft_lse)
    grad = _ops.vat_row_backward.default(g_q, g_p, g_y, draft_logits, target_logits, target_tokens, draft_lse,
                                         target_lse)
    # the target side is a constant (no gradient), as are the tokens, uniforms and temperature
    return grad, None, None, None, None


torch.library.register_autograd("dartree_ext::vat_row_forward", _row_forward_backward,
                                setup_context=_row_forward_setup_context)


# ---------------------------------------------------------------------------------------------
# kernels the composition runs on (the registered ops; the tests plug in the emulated CUDA kernels)


class _RegisteredOps:
    """The ``torch.ops.dartree_ext.vat_*`` ops (autograd of the row op through its registration)."""

    @staticmethod
    def row_forward(draft, target, tokens, uniforms, temperature):
        return _ops.vat_row_forward.default(draft, target, tokens, uniforms, temperature)

    row_forward_differentiable = row_forward

    @staticmethod
    def row_backward(g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse):
        return _ops.vat_row_backward.default(g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse)

    @staticmethod
    def block_weights(accept, valid, schedule, decay_gamma):
        return _ops.vat_block_weights.default(accept, valid, schedule, decay_gamma)


class RowForwardFunction(torch.autograd.Function):
    """Autograd around any ``kernels`` object's raw row_forward / row_backward (used for backends that
    are not registered ops, e.g. the emulated CUDA kernels in the tests)."""

    @staticmethod
    def forward(ctx, kernels, draft, target, tokens, uniforms, temperature):
        ce_soft, ce_hard, accept, draft_lse, target_lse = kernels.row_forward(draft, target, tokens, uniforms,
                                                                              temperature)
        ctx.kernels = kernels
        ctx.save_for_backward(draft, target, tokens, draft_lse, target_lse)
        ctx.mark_non_differentiable(accept)
        return ce_soft, ce_hard, accept, draft_lse, target_lse

    @staticmethod
    def backward(ctx, g_soft, g_hard, _g_accept, g_draft_lse, _g_target_lse):
        draft, target, tokens, draft_lse, target_lse = ctx.saved_tensors
        g_q, g_p, g_y = _row_grad_coefficients(g_soft, g_hard, g_draft_lse, draft_lse)
        grad = ctx.kernels.row_backward(g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse)
        return None, grad, None, None, None, None


# ---------------------------------------------------------------------------------------------
# argument checks


def _check_options(op: str, rule: str, temperature: float, schedule: str, decay_gamma: float,
                   vh_weight: float) -> None:
    if rule not in RULES:
        raise ValueError(f"{op}: rule must be one of {RULES}, got {rule!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{op}: schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not (math.isfinite(float(temperature)) and float(temperature) > 0):  # any rule: a wrong value is a bug
        raise ValueError(f"{op}: temperature must be finite and > 0, got {temperature}"
                         + (" (the greedy rule does not use it, but it must still be valid)" if rule != "sample" else ""))
    if not (math.isfinite(float(decay_gamma)) and float(decay_gamma) > 0):
        raise ValueError(f"{op}: decay_gamma must be finite and > 0, got {decay_gamma}")
    if not math.isfinite(float(vh_weight)):
        raise ValueError(f"{op}: vh_weight must be finite, got {vh_weight}")


def _check_block_inputs(op: str, m: int, k: int, device: torch.device, target_tokens: torch.Tensor,
                        vh_logits: Optional[torch.Tensor], valid: torch.Tensor) -> None:
    if not isinstance(target_tokens, torch.Tensor) or target_tokens.dtype != torch.int64:
        raise TypeError(f"{op}: target_tokens must be an int64 tensor, got "
                        f"{getattr(target_tokens, 'dtype', type(target_tokens))}")
    if tuple(target_tokens.shape) != (m, k):
        raise ValueError(f"{op}: target_tokens must have shape [M, K] = [{m}, {k}], got {tuple(target_tokens.shape)}")
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool:
        raise TypeError(f"{op}: valid must be a bool tensor, got {getattr(valid, 'dtype', type(valid))}")
    if tuple(valid.shape) != (m, k):
        raise ValueError(f"{op}: valid must have shape [M, K] = [{m}, {k}], got {tuple(valid.shape)}")
    if vh_logits is not None:
        if not vh_logits.is_floating_point():
            raise TypeError(f"{op}: vh_logits must be a floating-point tensor, got {vh_logits.dtype}")
        if tuple(vh_logits.shape) != (m, k):
            raise ValueError(f"{op}: vh_logits must have shape [M, K] = [{m}, {k}], got {tuple(vh_logits.shape)}")
    for name, t in (("target_tokens", target_tokens), ("valid", valid), ("vh_logits", vh_logits)):
        if t is not None and t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device} but the logits are on {device}; all inputs must be on "
                             "one device")
    if m * k == 0:
        raise ValueError(f"{op}: no positions (M = {m}, K = {k}); need at least one valid position")


def _check_logits(op: str, draft_logits: torch.Tensor, target_logits: torch.Tensor,
                  draft_vocab: Optional[torch.Tensor] = None) -> None:
    for name, t in (("draft_logits", draft_logits), ("target_logits", target_logits)):
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 or float64, got "
                            f"{getattr(t, 'dtype', type(t))}")
        if t.dim() != 3:
            raise ValueError(f"{op}: {name} must be [M, K, V], got shape {tuple(t.shape)}")
    if draft_vocab is not None:
        if isinstance(draft_vocab, torch.Tensor) and draft_logits.shape[-1] != draft_vocab.numel():
            raise ValueError(f"{op}: draft_logits has {draft_logits.shape[-1]} columns but draft_vocab has "
                             f"{draft_vocab.numel()} ids")
    elif target_logits.shape[-1] != draft_logits.shape[-1]:
        raise ValueError(f"{op}: target_logits has vocabulary size {target_logits.shape[-1]} but draft_logits has "
                         f"{draft_logits.shape[-1]} (last dim)")
    if target_logits.shape[:-1] != draft_logits.shape[:-1] or (draft_vocab is None
                                                               and target_logits.shape != draft_logits.shape):
        raise ValueError(f"{op}: target_logits must have draft_logits' shape {tuple(draft_logits.shape)}, got "
                         f"{tuple(target_logits.shape)}")
    if target_logits.dtype != draft_logits.dtype:
        raise TypeError(f"{op}: target_logits must have draft_logits' dtype {draft_logits.dtype}, got "
                        f"{target_logits.dtype}")
    if target_logits.device != draft_logits.device:
        raise ValueError(f"{op}: target_logits is on {target_logits.device} but draft_logits is on "
                         f"{draft_logits.device}")
    if draft_logits.shape[-1] == 0:
        raise ValueError(f"{op}: the vocabulary is empty (V = 0)")


def _check_accept_width(op: str, accept_width: int, rule: str, vocab: int) -> None:
    if isinstance(accept_width, bool) or not isinstance(accept_width, int) or not 1 <= accept_width <= vocab:
        raise ValueError(f"{op}: accept_width must be an int in [1, {vocab}] (the draft vocabulary), got "
                         f"{accept_width!r}")
    if accept_width > 1 and rule != "greedy":
        raise ValueError(f"{op}: accept_width > 1 (tree acceptance) needs rule='greedy', got rule={rule!r}")


def _accept_in_top(draft: torch.Tensor, target: torch.Tensor, width: int) -> torch.Tensor:
    """bool[R]: row r's target argmax (over ``target``'s columns, the drafter's vocabulary) is among
    ``draft[r]``'s ``width`` largest entries."""
    return (draft.topk(width, -1).indices == target.argmax(-1, keepdim=True)).any(-1)


def draw_uniforms(rule: str, rows: int, device: torch.device,
                  generator: Optional[torch.Generator]) -> Optional[torch.Tensor]:
    """The sampling rule's uniforms, float32 [rows, 2] (``[:, 0]`` picks the draft token, ``[:, 1]``
    accepts it), drawn on the generator's device (the default generator of ``device`` when None) and
    moved to ``device``: a CPU generator gives the same uniforms, hence the same result, on every
    backend. None for the greedy rule."""
    if rule != "sample":
        return None
    where = generator.device if generator is not None else device
    return torch.rand(rows, 2, generator=generator, device=where, dtype=torch.float32).to(device)


class _DraftVocab:
    """A draft vocabulary ``ids int64[V']`` of a ``V``-token target, and the reduction of target
    rows to it (see the module docstring)."""

    def __init__(self, op: str, ids: torch.Tensor, vocab: int, device: torch.device) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 or ids.dim() != 1 or ids.numel() == 0:
            raise ValueError(f"{op}: draft_vocab must be a non-empty 1-D int64 tensor of target ids, got "
                             f"{getattr(ids, 'dtype', type(ids))}{list(getattr(ids, 'shape', []))}")
        if ids.device != device:
            raise ValueError(f"{op}: draft_vocab is on {ids.device} but the inputs are on {device}")
        if bool(((ids < 0) | (ids >= vocab)).any()):
            raise ValueError(f"{op}: draft_vocab ids must be in [0, {vocab}) (the target's vocabulary)")
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError(f"{op}: draft_vocab ids must be distinct")
        self.ids, self.vocab = ids, vocab
        self.index = torch.full((vocab,), -1, dtype=torch.int64, device=device)   # target id -> draft index
        self.index[ids] = torch.arange(ids.numel(), device=device)

    def reduce(self, target: torch.Tensor, tokens: torch.Tensor, uniforms: Optional[torch.Tensor],
               temperature: float):
        """Target rows ``[R, V]`` -> ``(target rows over V' [R, V'], tokens as draft indices,
        has_label bool[R] (the token is in V', or out of any vocabulary: left to the checks),
        top_in bool[R] (the target's argmax over V is in V'), uniforms with u2 scaled)."""
        reduced = target.index_select(-1, self.ids).contiguous()
        outside = (tokens < 0) | (tokens >= self.vocab)
        index = self.index[tokens.clamp(0, self.vocab - 1)]
        has_label = (index >= 0) | outside
        draft_tokens = torch.where(outside, tokens, index.clamp(min=0)).contiguous()
        top_in = self.ids[reduced.argmax(-1)] == target.argmax(-1)
        if uniforms is not None:  # u2 / P_T(V'): acceptance against p_T normalized over all of V
            stat = torch.float64 if target.dtype == torch.float64 else torch.float32
            scaled = target.to(stat) / temperature
            share = torch.exp(torch.logsumexp(scaled.index_select(-1, self.ids), -1) - torch.logsumexp(scaled, -1))
            uniforms = torch.stack([uniforms[:, 0], (uniforms[:, 1] / share).to(uniforms.dtype)], 1)
        return reduced, draft_tokens, has_label, top_in, uniforms


def _draft_vocab(op: str, ids: Optional[torch.Tensor], vocab: int, device: torch.device) -> Optional[_DraftVocab]:
    return None if ids is None else _DraftVocab(op, ids, vocab, device)


# ---------------------------------------------------------------------------------------------
# the loss


def _vh_loss(vh_logits: Optional[torch.Tensor], first_reject: torch.Tensor, valid: torch.Tensor,
             stat: torch.dtype) -> torch.Tensor:
    if vh_logits is None:
        return torch.zeros((), dtype=stat, device=valid.device)
    k = valid.shape[1]
    position = torch.arange(1, k + 1, device=valid.device)
    verified = (position[None, :] < first_reject[:, None]).to(stat)
    logits = torch.where(valid, vh_logits.to(stat), 0.0)
    bce = F.binary_cross_entropy_with_logits(logits, verified, reduction="none")
    bce = torch.where(valid, bce, 0.0)
    return bce.sum() / valid.sum().clamp(min=1).to(stat)


def _ce_terms(ce_soft, ce_hard, weights, valid, schedule: str):
    """w_k (CE_soft + CE_hard) per position (only the terms of :data:`_CE_TERMS`; 0 where invalid),
    differentiable in ce_soft / ce_hard."""
    w = weights.to(ce_hard.dtype)
    soft, hard = _CE_TERMS.get(schedule, (True, True))
    per_position = w * sum(term for term, on in ((ce_soft, soft), (ce_hard, hard)) if on)
    return torch.where(valid, per_position, 0.0)


def _num_blocks(valid: torch.Tensor, stat: torch.dtype) -> torch.Tensor:
    return valid.any(dim=1).sum().clamp(min=1).to(stat)


def _finish(op: str, ce_loss, vh_loss, first_reject, accept, weights, valid, vh_weight, check_finite,
            diagnose) -> VATLossOutput:
    loss = ce_loss + vh_weight * vh_loss
    accept = torch.where(valid, accept, 0.0)
    out = VATLossOutput(loss, ce_loss, vh_loss, first_reject, accept, weights)
    if check_finite:
        if not bool(valid.any()):
            raise ValueError(f"{op}: valid has no True entry; the loss needs at least one valid position")
        if not bool(torch.isfinite(loss.detach())):
            raise FloatingPointError(f"{op}: the loss is {float(loss.detach())}: {diagnose()}")
    return out


def _diagnose_rows(op: str, draft_rows_finite, target_rows_finite, target_tokens, valid, vocab, vh_logits,
                   names=("draft_logits", "target_logits")) -> str:
    """Names the first valid position whose inputs make the loss non-finite."""
    k = valid.shape[1]
    tokens_bad = valid & ((target_tokens < 0) | (target_tokens >= vocab))
    for name, bad in (("target_tokens", tokens_bad), (names[0], valid & ~draft_rows_finite()),
                      (names[1], valid & ~target_rows_finite())):
        if bool(bad.any()):
            index = int(bad.flatten().nonzero()[0, 0])
            m, j = divmod(index, k)
            if name == "target_tokens":
                return (f"target_tokens[{m}, {j}] = {int(target_tokens[m, j])} is outside the vocabulary "
                        f"[0, {vocab}) at a valid position")
            return f"{name} has NaN or inf values at valid position [{m}, {j}]"
    if vh_logits is not None and bool((valid & ~torch.isfinite(vh_logits)).any()):
        return "vh_logits has NaN or inf values at a valid position"
    return "the logits overflow (every row must have a finite maximum and finite values)"


def vat_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, target_tokens: torch.Tensor,
             vh_logits: Optional[torch.Tensor], valid: torch.Tensor, *, rule: str = "greedy",
             temperature: float = 1.0, schedule: str = "vat", decay_gamma: float = 7.0, vh_weight: float = 1.0,
             generator: Optional[torch.Generator] = None, check_finite: bool = True,
             draft_vocab: Optional[torch.Tensor] = None, accept_width: int = 1) -> VATLossOutput:
    """The VAT loss of a batch of draft blocks from materialized logits (see the module docstring).

    Args:
        draft_logits: ``[M, K, V]`` float32 / bfloat16 / float16 / float64, the drafter's logits for
            M blocks of K positions (gradients flow here).
        target_logits: ``[M, K, V]``, same dtype: the target model's logits (no gradient).
        target_tokens: ``int64[M, K]``, the hard labels ``y`` (any value at invalid positions).
        vh_logits: ``[M, K]`` verification-head logits (gradients flow here), or None (``vh_loss = 0``).
        valid: ``bool[M, K]``; False past a sequence's end: such positions neither reject nor count.
        rule: ``"greedy"`` or ``"sample"`` (acceptance of the simulated verification).
        temperature: the sampling rule's temperature (> 0; checked for every rule, used by the sampling rule only).
        schedule: one of :data:`SCHEDULES`.
        decay_gamma: the decay length of the exponential schedules (> 0).
        vh_weight: the weight of ``vh_loss`` in ``loss``.
        generator: draws the sampling rule's uniforms (see :func:`draw_uniforms`).
        check_finite: raise :class:`FloatingPointError` instead of returning a non-finite loss, and
            ``ValueError`` when no position is valid; synchronizes on CUDA. With False: no check, no
            synchronization (a NaN loss for bad input, 0 for a batch without a valid position).
        draft_vocab: ``int64[V']``, distinct target ids: ``draft_logits`` is ``[M, K, V']`` over them
            (the module docstring says what the loss is then); None: one vocabulary.
        accept_width: the greedy rule's acceptance for a tree of this many children a node: a
            position is accepted iff the target's argmax is among the drafter's ``accept_width``
            largest logits (``torch.topk``'s order among ties). 1 (the default): the chain's
            ``argmax q == argmax p``. Only with ``rule="greedy"``.

    Non-contiguous logits are copied. Memory beyond the inputs: O(M K) statistics, plus the
    gradient ``[M, K, V]`` in backward; no ``[M, K, V]`` intermediate is saved.
    """
    return _vat_loss(_RegisteredOps, draft_logits, target_logits, target_tokens, vh_logits, valid, rule=rule,
                     temperature=temperature, schedule=schedule, decay_gamma=decay_gamma, vh_weight=vh_weight,
                     generator=generator, check_finite=check_finite, draft_vocab=draft_vocab,
                     accept_width=accept_width)


def _vat_loss(kernels: Any, draft_logits, target_logits, target_tokens, vh_logits, valid, *, rule, temperature,
              schedule, decay_gamma, vh_weight, generator, check_finite, draft_vocab=None,
              accept_width: int = 1) -> VATLossOutput:
    op = "vat_loss"
    _check_options(op, rule, temperature, schedule, decay_gamma, vh_weight)
    _check_logits(op, draft_logits, target_logits, draft_vocab)
    _check_accept_width(op, accept_width, rule, draft_logits.shape[-1])
    m, k, vocab = target_logits.shape
    _check_block_inputs(op, m, k, draft_logits.device, target_tokens, vh_logits, valid)
    reduce = _draft_vocab(op, draft_vocab, vocab, draft_logits.device)
    rows = m * k
    uniforms = draw_uniforms(rule, rows, draft_logits.device, generator)
    target = target_logits.detach().reshape(rows, vocab).contiguous()
    tokens = target_tokens.reshape(rows).contiguous()
    if reduce is not None:
        target, tokens, has_label, top_in, uniforms = reduce.reduce(target, tokens, uniforms, float(temperature))
    draft = draft_logits.reshape(rows, draft_logits.shape[-1]).contiguous()
    ce_soft, ce_hard, accept, _, _ = kernels.row_forward_differentiable(draft, target, tokens, uniforms,
                                                                         float(temperature))
    if accept_width > 1:  # the target's argmax among the drafter's top accept_width (and in V')
        accept = _accept_in_top(draft.detach(), target, accept_width).to(accept.dtype)
    if reduce is not None:
        ce_hard = torch.where(has_label, ce_hard, 0.0)  # no hard label outside the draft vocabulary
        accept = accept * top_in if uniforms is None else accept
    stat = ce_hard.dtype
    valid = valid.contiguous()
    first_reject, weights = kernels.block_weights(accept.view(m, k), valid, _kernel_schedule(schedule),
                                                  float(decay_gamma))
    terms = _ce_terms(ce_soft.view(m, k), ce_hard.view(m, k), weights, valid, schedule)
    ce_loss = terms.sum() / _num_blocks(valid, stat)
    vh_loss = _vh_loss(vh_logits, first_reject, valid, stat)

    def diagnose() -> str:
        return _diagnose_rows(op, lambda: torch.isfinite(draft_logits.detach()).all(-1),
                              lambda: torch.isfinite(target_logits.detach()).all(-1), target_tokens, valid, vocab,
                              vh_logits)

    return _finish(op, ce_loss, vh_loss, first_reject, accept.view(m, k), weights, valid, vh_weight, check_finite,
                   diagnose)


# ---------------------------------------------------------------------------------------------
# the loss from hidden states, without materializing [M, K, V] logits


def default_chunk_blocks(m: int, k: int, vocab: int, hidden: int) -> int:
    """Blocks per chunk of :func:`vat_loss_linear`: about ``max(hidden, 256)`` rows, so that a chunk's
    ``[rows, V]`` logits are about the size of the ``[V, hidden]`` head weight the caller already holds,
    rounded down to whole blocks (at least one block). Much smaller chunks (Liger-Kernel's rule,
    ``M K / ceil(V / hidden)`` rows) save little memory here, since the float32 weight gradient is of
    that size anyway, and cost time: every chunk reads the weights and updates the whole weight
    gradient once."""
    rows = max(hidden, 256)
    return max(1, min(m, rows // k))


class _LinearVATCE(torch.autograd.Function):
    """ce_loss from hidden states chunk by chunk; the gradients are computed in forward (per chunk:
    logits by matmul, the fused row kernels, the row gradient, two matmuls) and only they are saved."""

    @staticmethod
    def forward(ctx, kernels, draft_hidden, draft_weight, target_hidden, target_weight, tokens, valid, uniforms,
                temperature, schedule, decay_gamma, chunk_blocks, reduce):
        m, k, hd = draft_hidden.shape
        rows = m * k
        h_draft = draft_hidden.detach().reshape(rows, hd)
        h_target = target_hidden.detach().reshape(rows, target_hidden.shape[-1])
        w_draft, w_target = draft_weight.detach(), target_weight.detach()
        stat = _stat_dtype(draft_hidden.dtype)
        num_blocks = _num_blocks(valid, stat)
        kernel_schedule, (soft, hard) = _kernel_schedule(schedule), _CE_TERMS.get(schedule, (True, True))
        need_hidden, need_weight = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(h_draft) if need_hidden else None
        grad_weight = (torch.zeros(w_draft.shape, dtype=torch.float32 if stat == torch.float32 else stat,
                                   device=w_draft.device) if need_weight else None)
        total = torch.zeros((), dtype=stat, device=draft_hidden.device)
        first_reject = torch.empty(m, dtype=torch.int32, device=draft_hidden.device)
        accept = torch.empty(m, k, dtype=torch.float32, device=draft_hidden.device)
        weights = torch.empty(m, k, dtype=torch.float32, device=draft_hidden.device)
        for b0 in range(0, m, chunk_blocks):
            b1 = min(m, b0 + chunk_blocks)
            r0, r1 = b0 * k, b1 * k
            h = h_draft[r0:r1]
            draft_logits = h @ w_draft.t()
            target_logits = h_target[r0:r1] @ w_target.t()
            tok = tokens[r0:r1]
            u = None if uniforms is None else uniforms[r0:r1]
            if reduce is not None:
                target_logits, tok, has_label, top_in, u = reduce.reduce(target_logits, tok, u, temperature)
            ce_soft, ce_hard, acc, lse_d, lse_t = kernels.row_forward(draft_logits, target_logits, tok, u, temperature)
            if reduce is not None:
                ce_hard = torch.where(has_label, ce_hard, 0.0)
                acc = acc * top_in if u is None else acc
            ok = valid[b0:b1]
            fr, w = kernels.block_weights(acc.view(-1, k), ok, kernel_schedule, decay_gamma)
            first_reject[b0:b1], accept[b0:b1], weights[b0:b1] = fr, acc.view(-1, k), w
            total += _ce_terms(ce_soft.view(-1, k), ce_hard.view(-1, k), w, ok, schedule).sum()
            if not (need_hidden or need_weight):  # no gradient wanted: the loss only
                continue
            coef = torch.where(ok, w.to(stat), 0.0).reshape(-1) / num_blocks
            g_soft = coef if soft else torch.zeros_like(coef)
            g_hard = (coef if reduce is None else torch.where(has_label, coef, 0.0)) if hard else torch.zeros_like(coef)
            grad_logits = kernels.row_backward((g_soft + g_hard).contiguous(), g_soft.contiguous(), g_hard.contiguous(),
                                               draft_logits, target_logits, tok, lse_d, lse_t)
            del draft_logits, target_logits
            if need_hidden:
                torch.matmul(grad_logits, w_draft, out=grad_hidden[r0:r1])
            if need_weight and grad_weight.dtype == grad_logits.dtype:
                grad_weight.addmm_(grad_logits.t(), h)
            elif need_weight:  # 16-bit logits: accumulate in float32
                grad_weight.addmm_(grad_logits.t().float(), h.float())
            del grad_logits
        ctx.save_for_backward(None if grad_hidden is None else grad_hidden.view(draft_hidden.shape), grad_weight)
        ctx.weight_dtype = draft_weight.dtype
        ctx.mark_non_differentiable(first_reject, accept, weights)
        return total / num_blocks, first_reject, accept, weights

    @staticmethod
    def backward(ctx, grad_ce, _g_first_reject, _g_accept, _g_weights):
        grad_hidden, grad_weight = ctx.saved_tensors
        grad_h = None if grad_hidden is None else grad_hidden * grad_ce.to(grad_hidden.dtype)
        grad_w = None if grad_weight is None else (grad_weight * grad_ce.to(grad_weight.dtype)).to(ctx.weight_dtype)
        return None, grad_h, grad_w, None, None, None, None, None, None, None, None, None, None


def vat_loss_linear(draft_hidden: torch.Tensor, draft_weight: torch.Tensor, target_hidden: torch.Tensor,
                    target_weight: torch.Tensor, target_tokens: torch.Tensor, vh_logits: Optional[torch.Tensor],
                    valid: torch.Tensor, *, rule: str = "greedy", temperature: float = 1.0, schedule: str = "vat",
                    decay_gamma: float = 7.0, vh_weight: float = 1.0, generator: Optional[torch.Generator] = None,
                    chunk_size: Optional[int] = None, check_finite: bool = True,
                    draft_vocab: Optional[torch.Tensor] = None) -> VATLossOutput:
    """:func:`vat_loss` of ``draft_logits = draft_hidden @ draft_weight.T`` and ``target_logits =
    target_hidden @ target_weight.T`` without materializing them.

    Args (besides :func:`vat_loss`'s):
        draft_hidden: ``[M, K, Hd]`` (gradients flow here); draft_weight: ``[V, Hd]`` (and here).
        target_hidden: ``[M, K, Ht]``; target_weight: ``[V, Ht]`` (no gradient); all four of one dtype.
        chunk_size: positions per chunk, rounded down to whole blocks (at least one block); None
            picks :func:`default_chunk_blocks`.
        draft_vocab: ``int64[V']`` as in :func:`vat_loss`; ``draft_weight`` is then ``[V', Hd]``
            (the rows of those ids) and ``target_weight`` stays ``[V, Ht]``.

    Chunks of whole blocks are processed in turn: the chunk's logits (two matmuls), the fused row
    kernels, the block weights, the gradient of the chunk's logits, and from it the gradients of the
    hidden states (``g @ W``) and the weight (``+= g^T @ h``, accumulated in float32). The gradients
    are computed in forward (only those of inputs that require a gradient; none under ``torch.no_grad()``),
    scaled by the incoming gradient in backward (Liger-Kernel's scheme):
    memory beyond the inputs is one chunk's logits and gradient plus ``grad_hidden`` and a float32
    ``[V, Hd]`` weight gradient. The forward therefore costs about what forward + backward of
    :func:`vat_loss` costs. Same sampling uniforms (hence the same acceptance) as :func:`vat_loss`
    with the same generator.
    """
    return _vat_loss_linear(_RegisteredOps, draft_hidden, draft_weight, target_hidden, target_weight, target_tokens,
                            vh_logits, valid, rule=rule, temperature=temperature, schedule=schedule,
                            decay_gamma=decay_gamma, vh_weight=vh_weight, generator=generator, chunk_size=chunk_size,
                            check_finite=check_finite, draft_vocab=draft_vocab)


def _check_linear(op: str, draft_hidden, draft_weight, target_hidden, target_weight, draft_vocab=None) -> None:
    tensors = (("draft_hidden", draft_hidden, 3), ("draft_weight", draft_weight, 2),
               ("target_hidden", target_hidden, 3), ("target_weight", target_weight, 2))
    for name, t, dim in tensors:
        if not isinstance(t, torch.Tensor) or t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{op}: {name} must be float32, bfloat16, float16 or float64, got "
                            f"{getattr(t, 'dtype', type(t))}")
        if t.dim() != dim:
            raise ValueError(f"{op}: {name} must be {dim}-D, got shape {tuple(t.shape)}")
        if t.dtype != draft_hidden.dtype:
            raise TypeError(f"{op}: {name} must have draft_hidden's dtype {draft_hidden.dtype}, got {t.dtype}")
        if t.device != draft_hidden.device:
            raise ValueError(f"{op}: {name} is on {t.device} but draft_hidden is on {draft_hidden.device}")
    m, k, hd = draft_hidden.shape
    if draft_weight.shape[1] != hd:
        raise ValueError(f"{op}: draft_weight must be [V, Hd] with Hd = {hd} (draft_hidden's last dim), got "
                         f"{tuple(draft_weight.shape)}")
    if tuple(target_hidden.shape[:2]) != (m, k):
        raise ValueError(f"{op}: target_hidden must be [M, K, Ht] with [M, K] = [{m}, {k}], got "
                         f"{tuple(target_hidden.shape)}")
    if target_weight.shape[1] != target_hidden.shape[2]:
        raise ValueError(f"{op}: target_weight must be [V, Ht] with Ht = {target_hidden.shape[2]}, got "
                         f"{tuple(target_weight.shape)}")
    if draft_vocab is not None:
        if isinstance(draft_vocab, torch.Tensor) and draft_weight.shape[0] != draft_vocab.numel():
            raise ValueError(f"{op}: draft_weight has {draft_weight.shape[0]} rows but draft_vocab has "
                             f"{draft_vocab.numel()} ids")
    elif target_weight.shape[0] != draft_weight.shape[0]:
        raise ValueError(f"{op}: target_weight has vocabulary size {target_weight.shape[0]} but draft_weight has "
                         f"{draft_weight.shape[0]} (dim 0)")
    if draft_weight.shape[0] == 0:
        raise ValueError(f"{op}: the vocabulary is empty (V = 0)")


def _vat_loss_linear(kernels: Any, draft_hidden, draft_weight, target_hidden, target_weight, target_tokens, vh_logits,
                     valid, *, rule, temperature, schedule, decay_gamma, vh_weight, generator, chunk_size,
                     check_finite, draft_vocab=None) -> VATLossOutput:
    op = "vat_loss_linear"
    _check_options(op, rule, temperature, schedule, decay_gamma, vh_weight)
    _check_linear(op, draft_hidden, draft_weight, target_hidden, target_weight, draft_vocab)
    m, k, hd = draft_hidden.shape
    vocab = target_weight.shape[0]
    _check_block_inputs(op, m, k, draft_hidden.device, target_tokens, vh_logits, valid)
    reduce = _draft_vocab(op, draft_vocab, vocab, draft_hidden.device)
    if chunk_size is not None and int(chunk_size) < 1:
        raise ValueError(f"{op}: chunk_size must be >= 1, got {chunk_size}")
    chunk_blocks = (default_chunk_blocks(m, k, vocab, hd) if chunk_size is None
                    else max(1, min(m, int(chunk_size) // k)))
    uniforms = draw_uniforms(rule, m * k, draft_hidden.device, generator)
    valid = valid.contiguous()
    ce_loss, first_reject, accept, weights = _LinearVATCE.apply(
        kernels, draft_hidden.contiguous(), draft_weight.contiguous(), target_hidden.contiguous(),
        target_weight.contiguous(), target_tokens.reshape(m * k).contiguous(), valid, uniforms, float(temperature),
        schedule, float(decay_gamma), chunk_blocks, reduce)
    vh_loss = _vh_loss(vh_logits, first_reject, valid, ce_loss.dtype)

    def diagnose() -> str:
        def rows_finite(hidden, weight):
            finite_weight = bool(torch.isfinite(weight).all())
            return lambda: torch.isfinite(hidden.detach()).all(-1) & finite_weight
        return _diagnose_rows(op, rows_finite(draft_hidden, draft_weight), rows_finite(target_hidden, target_weight),
                              target_tokens, valid, vocab, vh_logits,
                              names=("draft_hidden (or draft_weight)", "target_hidden (or target_weight)"))

    return _finish(op, ce_loss, vh_loss, first_reject, accept, weights, valid, vh_weight, check_finite, diagnose)
