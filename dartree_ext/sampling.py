"""Turning the target's logits at the tree nodes into the tokens verification walks along."""
from __future__ import annotations

import math

import torch

from . import ops


def _filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    # drop a token once the mass strictly before it already reaches top_p (the top token stays)
    drop_sorted = (probs.cumsum(-1) - probs) >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


ARGMAX_BLOCKS = (256, 128, 64)  # _first_argmax: block sizes tried, largest first


def _warped_logits(logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None) -> torch.Tensor:
    """``logits / temperature`` with ``top_k`` then ``top_p`` applied (HF's order): a contiguous
    float32 copy (never the caller's tensor), which the callers work on in place."""
    scaled = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    if temperature != 1.0:
        scaled.div_(temperature)
    if top_k is not None:
        scaled = _filter_top_k(scaled, top_k)
    if top_p is not None and top_p < 1.0:
        scaled = _filter_top_p(scaled, top_p)
    return scaled


def undrawable_row(logits: torch.Tensor) -> tuple[int, str] | None:
    """The first row of ``logits [..., V]`` (leading dims flattened) no token can be drawn from,
    and why (it holds a NaN, or is all -inf), or ``None``."""
    rows = logits.reshape(-1, logits.shape[-1])
    bad = rows.isnan().any(-1) | (rows == float("-inf")).all(-1)
    if not bool(bad.any()):
        return None
    r = int(bad.nonzero()[0, 0])
    return r, ("holds a NaN" if bool(rows[r].isnan().any()) else "is all -inf (no token has positive probability)")


def check_drawable(logits: torch.Tensor) -> None:
    """A ``ValueError`` naming the first row of ``logits`` no token can be drawn from (as
    ``ops.tokens_from_logits`` raises on the CPU)."""
    bad = undrawable_row(logits)
    if bad is not None:
        rows = logits.numel() // logits.shape[-1]
        raise ValueError(f"tokens_from_logits: logits row {bad[0]} of {rows} {bad[1]}: no token can be drawn from it")


def _first_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The index of each row's maximum, the lowest on ties (torch.argmax's answer), for CPU
    float32 (or float64) logits. Reductions with indices do not vectorise over the reduced dimension on a CPU,
    ``amax`` does: the row is cut into blocks, the first block holding the row's maximum is found
    from the blocks' maxima (a short row), and the first maximum inside that block. About 4x
    faster than ``max(-1).indices`` over 9-65 rows of 49152 (2-vCPU AMD EPYC, Zen 4; a one-off timing). A row with
    a NaN gets NaN's block, as ``max`` does; rows not cut evenly take ``max(-1).indices``."""
    size = logits.shape[-1]
    block = next((b for b in ARGMAX_BLOCKS if size % b == 0 and size >= 4 * b), None)
    if block is None or logits.numel() == 0:
        # max(-1).indices is argmax (the first index of the maximum) and twice as fast on a CPU
        return logits.max(-1).indices
    rows = logits.reshape(-1, size // block, block)
    first = rows.amax(-1).max(-1).indices  # the first block holding the row's maximum
    inner = rows[torch.arange(rows.shape[0], device=rows.device), first].max(-1).indices
    return (first * block + inner).view(logits.shape[:-1])


def target_tokens_from_logits(logits: torch.Tensor, temperature: float = 0.0, top_k: int | None = None,
                              top_p: float | None = None,
                              generator: torch.Generator | None = None) -> torch.Tensor:
    """The target's token after each node: ``int64[...]`` from ``logits [..., V]``.

    ``temperature == 0`` takes the argmax (ties to the lowest token id). ``temperature > 0``
    samples from ``softmax(logits / temperature)`` restricted by ``top_k`` and ``top_p`` (the
    same warpers, in the same order, as HuggingFace's sampling), with ``generator`` for
    reproducibility. Verifying against these samples is lossless: every emitted token is a
    sample of the target.
    """
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"target_tokens_from_logits: temperature must be finite and >= 0, got {temperature}")
    if not logits.is_floating_point():
        raise TypeError(f"target_tokens_from_logits: logits must be floating-point, got {logits.dtype}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"target_tokens_from_logits: top_k must be >= 1 or None, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"target_tokens_from_logits: top_p must be in (0, 1] or None, got {top_p}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"target_tokens_from_logits: logits must be [..., V] with V >= 1, got {tuple(logits.shape)}")
    one_call = logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)
    if not (one_call and (temperature == 0 or (top_k is None and (top_p is None or top_p >= 1.0)))):
        check_drawable(logits)  # (ops.tokens_from_logits refuses these rows itself, in its one pass)
    if temperature == 0:
        if one_call:  # one pass over the logits, no float32 copy (ops.tokens_from_logits)
            return ops.tokens_from_logits(logits, None, 0.0)
        if logits.device.type != "cpu":
            return logits.argmax(-1)
        if logits.dtype in (torch.bfloat16, torch.float16):
            # exact (every bf16/fp16 value is a float32 value): PyTorch's reduced-precision
            # reductions are not vectorised on a CPU
            logits = logits.float()
        return _first_argmax(logits)
    if one_call and top_k is None and (top_p is None or top_p >= 1.0):
        # the same uniforms as below, one call for the rest (ops.tokens_from_logits)
        u = torch.rand(logits.shape[:-1] + (1,), generator=generator, device=logits.device)
        return ops.tokens_from_logits(logits, u.float(), temperature)  # (the default dtype may differ)
    scaled = _warped_logits(logits, temperature, top_k, top_p)
    # inverse-CDF sampling: one uniform per row, scaled to the row's total, against the
    # cumulative unnormalised probabilities exp(x - max). The same distribution as
    # torch.multinomial, and fast on a CPU over a 49k vocabulary (a tree samples at every node,
    # so this is on the critical path at T > 0): in place, 0.43 ms for 11 rows where softmax then
    # cumsum into new tensors took 1.8 ms (2-vCPU EPYC). right=True never lands on a
    # zero-probability token: its cumulative value equals its predecessor's.
    cdf = scaled.sub_(scaled.amax(-1, keepdim=True)).exp_()
    torch.cumsum(cdf, -1, out=cdf)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)[..., 0]


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int | None = None,
                 top_p: float | None = None) -> torch.Tensor:
    """``softmax(logits / temperature)`` restricted by ``top_k`` and ``top_p`` (the distribution
    :func:`target_tokens_from_logits` samples at ``temperature > 0``), float32 ``[..., V]``."""
    if not temperature > 0:
        raise ValueError(f"warped_probs needs temperature > 0, got {temperature}")
    return torch.softmax(_warped_logits(logits, temperature, top_k, top_p), -1)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of non-negative weights ``probs [..., V]`` (any positive total):
    ``int64[...]``, by inverse CDF (never a token of weight 0)."""
    cdf = torch.cumsum(probs.float(), -1)
    u = torch.rand(cdf.shape[:-1] + (1,), generator=generator, device=cdf.device) * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[-1] - 1)[..., 0]


def speculative_tokens(logits: torch.Tensor, child: torch.Tensor, q: torch.Tensor, temperature: float,
                       top_k: int | None = None, top_p: float | None = None,
                       generator: torch.Generator | None = None) -> torch.Tensor:
    """The token after each node when each node has at most one drafted child drawn from a known
    distribution (speculative sampling): ``int64[B, N]`` from the target's ``logits [B, N, V]``,
    ``child int64[B, N]`` (each node's drafted child token, -1 for none) and ``q float[B, N, V]``
    (the distribution that child was drawn from, over the target's vocabulary; ignored where
    ``child`` is -1).

    Where a node has a child ``x``, the result is ``x`` with probability ``min(1, p(x) / q(x))``
    (``p``: :func:`warped_probs`), else a sample of ``max(0, p - q)`` normalised; elsewhere a
    sample of ``p``. Either way the token is distributed as ``p``, so accepting the child where the
    result equals it (``ops.verify_tree``) is lossless, and the child is accepted with probability
    ``1 - TV(p, q)``: more than a fixed draft's ``p(x)`` where both distributions are spread out."""
    if logits.shape[:-1] != child.shape or q.shape != logits.shape:
        raise ValueError(f"speculative_tokens: logits {tuple(logits.shape)}, child {tuple(child.shape)} and "
                         f"q {tuple(q.shape)} do not match")
    p = warped_probs(logits, temperature, top_k, top_p)
    q = q.float()
    has = child >= 0
    c = child.clamp(min=0)[..., None]
    pc, qc = p.gather(-1, c)[..., 0], q.gather(-1, c)[..., 0]
    u = torch.rand(pc.shape, generator=generator, device=p.device)
    accept = has & (u * qc < pc)
    residual = torch.where(has[..., None], (p - q).clamp_(min=0), p)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p <= q everywhere: p == q
    return torch.where(accept, c[..., 0], sample_from_probs(residual, generator))
