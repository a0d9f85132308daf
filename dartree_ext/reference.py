"""Plain-PyTorch references of every op, for tests and benchmarks. Readable first, loop-free
where PyTorch allows; same signatures and outputs as :mod:`dartree_ext.ops`."""
from __future__ import annotations

import heapq

import numpy as np
import torch

from ._widths import depth_widths
from .head import corrected_logprobs, gru_update  # the expand ops' reference builds on them (and re-exports them)


def _valid_nodes(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    index = torch.arange(parents.shape[1], device=parents.device)
    return index[None, :] < num_nodes[:, None].long()


def _effective_parents(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """parents as int64 with -1 for the root and for padding."""
    index = torch.arange(parents.shape[1], device=parents.device)
    has_parent = _valid_nodes(parents, num_nodes) & (index[None, :] > 0)
    return torch.where(has_parent, parents.long(), torch.full_like(parents, -1, dtype=torch.long))


def ancestor_matrix(parents: torch.Tensor, num_nodes: torch.Tensor) -> torch.Tensor:
    """bool[B, N, N]: [b, i, j] iff node j is on node i's root path (itself included).

    Pointer doubling: after step k each row holds the ancestors less than 2^k levels up and
    ``jump`` points 2^k levels up (to a sentinel row N, all False, past the root).
    """
    batch, n_max = parents.shape
    par = _effective_parents(parents, num_nodes)
    jump = torch.where(par >= 0, par, n_max)
    jump = torch.cat([jump, torch.full((batch, 1), n_max, dtype=torch.long, device=parents.device)], 1)
    reach = torch.eye(n_max + 1, n_max, dtype=torch.bool, device=parents.device).expand(batch, -1, -1).clone()
    reach[:, n_max] = False
    for _ in range(max(1, n_max.bit_length())):
        reach = reach | torch.gather(reach, 1, jump[:, :, None].expand(-1, -1, n_max))
        jump = torch.gather(jump, 1, jump)
    return reach[:, :n_max]


def pack_bits(rows: torch.Tensor) -> torch.Tensor:
    """bool[..., N] -> int64[..., ceil(N / 64)], bit j of word w = rows[..., 64 w + j]."""
    n = rows.shape[-1]
    words = (n + 63) // 64
    padded = torch.nn.functional.pad(rows.long(), (0, words * 64 - n))
    weights = torch.ones(64, dtype=torch.long, device=rows.device) << torch.arange(64, device=rows.device)
    # distinct powers of two never carry, so the int64 sum is the exact bit pattern (bit 63 included)
    return (padded.view(*rows.shape[:-1], words, 64) * weights).sum(-1)


def tree_ancestor_bits(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    anc = ancestor_matrix(parents, num_nodes)
    depths = torch.where(_valid_nodes(parents, num_nodes), anc.sum(-1) - 1, -1).to(torch.int32)
    return pack_bits(anc), depths


def unpack_bits(bits: torch.Tensor, n: int) -> torch.Tensor:
    """int64[..., ceil(n / 64)] -> bool[..., n] (the inverse of :func:`pack_bits`)."""
    j = torch.arange(n, device=bits.device)
    return ((bits[..., j // 64] >> (j % 64)) & 1).bool()


def packed_tree_mask(bits: torch.Tensor, seq_lens: torch.Tensor, mask_indptr: torch.Tensor,
                     total_bytes: int) -> torch.Tensor:
    n = bits.shape[1]
    out = torch.zeros(total_bytes, dtype=torch.uint8, device=bits.device)
    weights = torch.ones(8, dtype=torch.long, device=bits.device) << torch.arange(8, device=bits.device)
    for b in range(bits.shape[0]):
        s = int(seq_lens[b])
        full = torch.cat([torch.ones(n, s, dtype=torch.bool, device=bits.device), unpack_bits(bits[b], n)], 1)
        flat = full.reshape(-1)
        flat = torch.nn.functional.pad(flat.long(), (0, -flat.numel() % 8))
        packed = (flat.view(-1, 8) * weights).sum(-1).to(torch.uint8)
        start = int(mask_indptr[b])
        out[start:start + packed.numel()] = packed
    return out


def tree_attention_mask(parents: torch.Tensor, num_nodes: torch.Tensor, past_key_mask: torch.Tensor,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    anc = ancestor_matrix(parents, num_nodes)
    valid = _valid_nodes(parents, num_nodes)
    past = past_key_mask[:, None, :] & valid[:, :, None]
    visible = torch.cat([past, anc], dim=-1)
    hidden = torch.tensor(torch.finfo(dtype).min, dtype=dtype, device=parents.device)
    zero = torch.zeros((), dtype=dtype, device=parents.device)
    return torch.where(visible, zero, hidden)[:, None]


def _first_true(matrix: torch.Tensor) -> torch.Tensor:
    """Index of the first True along the last dim, -1 where there is none (int32)."""
    first = matrix.long().argmax(-1)  # argmax returns the first maximal index
    return torch.where(matrix.any(-1), first, -1).to(torch.int32)


def tree_links(parents: torch.Tensor, num_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    par = _effective_parents(parents, num_nodes)
    n_max = parents.shape[1]
    index = torch.arange(n_max, device=parents.device)
    is_child = par[:, None, :] == index[None, :, None]  # [b, i, j]: j is a child of i
    has_parent = par >= 0
    later_sibling = (
        (par[:, None, :] == par[:, :, None])
        & has_parent[:, :, None] & has_parent[:, None, :]
        & (index[None, None, :] > index[None, :, None])
    )
    return _first_true(is_child), _first_true(later_sibling)


def verify_tree(tokens: torch.Tensor, parents: torch.Tensor, num_nodes: torch.Tensor,
                target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One step per tree level, vectorized over the batch."""
    batch, n_max = parents.shape
    par = _effective_parents(parents, num_nodes)
    rows = torch.arange(batch, device=parents.device)
    current = torch.zeros(batch, dtype=torch.long, device=parents.device)
    length = torch.zeros(batch, dtype=torch.long, device=parents.device)
    accept_nodes = torch.full((batch, n_max), -1, dtype=torch.int32, device=parents.device)
    accept_nodes[:, 0] = 0
    active = torch.ones(batch, dtype=torch.bool, device=parents.device)
    while bool(active.any()):
        wanted = target_tokens[rows, current]
        match = (par == current[:, None]) & (tokens == wanted[:, None])
        nxt = _first_true(match).long()
        active = active & (nxt >= 0)
        current = torch.where(active, nxt, current)
        length = length + active.long()
        accept_nodes[rows[active], length[active]] = current[active].to(torch.int32)
    return accept_nodes, length.to(torch.int32), target_tokens[rows, current]


def _order_best_first(scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Indices along the last dim: valid entries by score descending, ties by lower index (NaN
    as -inf), then the invalid ones."""
    clean = torch.nan_to_num(scores, nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    order = torch.sort(clean, dim=-1, descending=True, stable=True).indices
    valid_sorted = torch.gather(valid, -1, order)
    return torch.gather(order, -1, torch.sort(valid_sorted.int(), dim=-1, descending=True, stable=True).indices)


def select_top_w(parent_scores: torch.Tensor, child_logprobs: torch.Tensor, num_parents: torch.Tensor,
                 width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch, p_max, k = child_logprobs.shape
    total = p_max * k
    scores = torch.nan_to_num((parent_scores[:, :, None] + child_logprobs).reshape(batch, total),
                              nan=float("-inf"), posinf=float("inf"), neginf=float("-inf"))
    parent_of = torch.arange(total, device=scores.device) // k
    valid = parent_of[None, :] < num_parents[:, None].long()
    if width > total:  # room for padding entries, which sort last
        scores = torch.nn.functional.pad(scores, (0, width - total), value=float("-inf"))
        valid = torch.nn.functional.pad(valid, (0, width - total), value=False)
    order = _order_best_first(scores, valid)[:, :width]
    picked_valid = torch.gather(valid, 1, order)
    minus_one = torch.full_like(order, -1)
    return (torch.where(picked_valid, order // k, minus_one).to(torch.int32),
            torch.where(picked_valid, order % k, minus_one).to(torch.int32),
            torch.where(picked_valid, torch.gather(scores, 1, order), float("-inf")))


def _kept_to_layout(parents: torch.Tensor, kept: torch.Tensor, budget: int):
    batch, n_max = parents.shape
    index = torch.arange(n_max, device=parents.device)
    slots = budget + 1
    keep = torch.sort(torch.where(kept, index, n_max), dim=1).values
    keep = torch.nn.functional.pad(keep, (0, max(0, slots - n_max)), value=n_max)[:, :slots]
    present = keep < n_max
    new_index = kept.long().cumsum(1) - 1
    safe_keep = torch.where(present, keep, 0)
    parent_old = torch.gather(parents.long(), 1, safe_keep)
    has_parent = present & (safe_keep > 0)
    new_parents = torch.gather(new_index, 1, torch.where(has_parent, parent_old, 0).clamp(min=0))
    minus_one = torch.full_like(keep, -1)
    return (torch.where(present, keep, minus_one).to(torch.int32),
            torch.where(has_parent, new_parents, minus_one).to(torch.int32),
            kept.sum(1).to(torch.int32))


def select_top_b(parents: torch.Tensor, scores: torch.Tensor, num_nodes: torch.Tensor,
                 budget: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Global top-B by sorting when scores are monotone (Lemma 1); otherwise the heap, one
    vectorized round per kept node."""
    batch, n_max = parents.shape
    index = torch.arange(n_max, device=parents.device)
    valid = _valid_nodes(parents, num_nodes)
    par = _effective_parents(parents, num_nodes)
    clean = torch.nan_to_num(scores, nan=float("-inf"))
    parent_score = torch.gather(clean, 1, par.clamp(min=0))
    monotone = bool(((clean <= parent_score) | (par < 0)).all())
    non_root = valid & (index[None, :] > 0)
    if monotone:
        order = _order_best_first(clean, non_root)
        rank = torch.empty_like(order).scatter_(1, order, index.expand(batch, -1).contiguous())
        kept = (non_root & (rank < budget)) | (index[None, :] == 0)
    else:
        kept = index[None, :].expand(batch, -1) == 0
        rows = torch.arange(batch, device=parents.device)
        for _ in range(budget):
            frontier = non_root & ~kept & torch.gather(kept, 1, par.clamp(min=0))
            if not bool(frontier.any()):
                break
            best = _order_best_first(clean, frontier)[:, 0]
            take = frontier[rows, best]
            kept = kept.clone()
            kept[rows[take], best[take]] = True
    return _kept_to_layout(parents, kept, budget)


def ddtree_heap(logprobs: torch.Tensor, token_ids: torch.Tensor, root_tokens: torch.Tensor,
                budget: int) -> tuple[torch.Tensor, ...]:
    """DDTree's best-first heap with Python's heapq, float32 arithmetic as in the kernels."""
    batch, depth_max, k = logprobs.shape
    slots = budget + 1
    tokens = torch.zeros(batch, slots, dtype=torch.int64)
    parents = torch.full((batch, slots), -1, dtype=torch.int32)
    depths = torch.full((batch, slots), -1, dtype=torch.int32)
    scores = torch.full((batch, slots), float("-inf"), dtype=torch.float32)
    num_nodes = torch.zeros(batch, dtype=torch.int32)
    lp_all = logprobs.detach().cpu().numpy().astype(np.float32)
    ids_all = token_ids.detach().cpu().numpy()
    for b in range(batch):
        lp, ids = lp_all[b], ids_all[b]
        out_tokens, out_parents, out_depths = [int(root_tokens[b])], [-1], [0]
        out_scores = [np.float32(0.0)]
        heap: list = []
        seq = 0
        if budget > 0 and depth_max > 0 and k > 0:
            heapq.heappush(heap, (-lp[0, 0], seq, 0, 1, 0))
            seq += 1
        while len(out_tokens) <= budget and heap:
            neg_score, _, parent, depth, rank = heapq.heappop(heap)
            node = len(out_tokens)
            out_tokens.append(int(ids[depth - 1, rank]))
            out_parents.append(parent)
            out_depths.append(depth)
            out_scores.append(-neg_score)
            if rank + 1 < k:
                heapq.heappush(heap, (-(out_scores[parent] + lp[depth - 1, rank + 1]), seq, parent, depth, rank + 1))
                seq += 1
            if depth < depth_max:
                heapq.heappush(heap, (-(-neg_score + lp[depth, 0]), seq, node, depth + 1, 0))
                seq += 1
        count = len(out_tokens)
        tokens[b, :count] = torch.tensor(out_tokens)
        parents[b, :count] = torch.tensor(out_parents, dtype=torch.int32)
        depths[b, :count] = torch.tensor(out_depths, dtype=torch.int32)
        scores[b, :count] = torch.tensor(np.array(out_scores, dtype=np.float32))
        num_nodes[b] = count
    device = logprobs.device
    return tokens.to(device), parents.to(device), depths.to(device), scores.to(device), num_nodes.to(device)


# expand area -----------------------------------------------------------------------------------

def expand_depth(head, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width,
                 depth_bonus=-0.2):
    batch, p_max, _ = parent_states.shape
    k = cand_ids.shape[1]
    logq = corrected_logprobs(head, z, cand_ids, cand_base, parent_states)
    child_logprobs = logq + depth_bonus
    parent_idx, child_k, scores = select_top_w(parent_scores, child_logprobs, num_parents, width)
    valid = parent_idx >= 0
    tokens = torch.where(valid, torch.gather(cand_ids, 1, child_k.long().clamp(min=0)), 0)
    parent_state = torch.gather(parent_states, 1, parent_idx.long().clamp(min=0)[..., None].expand(-1, -1,
                                                                                                    parent_states.shape[2]))
    states = torch.where(valid[..., None], gru_update(head, tokens, parent_state), 0.0)
    return parent_idx, child_k, scores, tokens, states


def build_supertree(head, z, cand_ids, cand_base, root_state, width, depth_bonus=-0.2):
    """Algorithm 1's supertree, one depth at a time with :func:`expand_depth`."""
    batch, depth, _ = z.shape
    widths = depth_widths(width, depth, exact=True)
    states = root_state.float()[:, None, :]
    scores_prev = torch.zeros(batch, 1)
    num_parents = torch.ones(batch, dtype=torch.int32, device=z.device)
    out_tokens, out_parents, out_depths, out_scores = [], [], [], []
    offset_prev = -1
    for d in range(depth):
        parent_idx, _, scores, tokens, states = expand_depth(head, z[:, d], cand_ids[:, d], cand_base[:, d], states,
                                                             scores_prev.to(z.device), num_parents, widths[d],
                                                             depth_bonus)
        valid = parent_idx >= 0
        out_tokens.append(tokens)
        out_parents.append(torch.where(valid, parent_idx + offset_prev, -1).to(torch.int32))
        out_depths.append(torch.where(valid, d + 1, -1).to(torch.int32))
        out_scores.append(scores)
        num_parents = valid.sum(1).to(torch.int32)
        scores_prev = scores
        offset_prev = sum(widths[:d])
    return (torch.cat(out_tokens, 1), torch.cat(out_parents, 1), torch.cat(out_depths, 1), torch.cat(out_scores, 1))


# linear area -------------------------------------------------------------------------------------

def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float32, rounded to the dtype of ``x`` once."""
    y = torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
    return y.to(x.dtype)


def amx_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` in float64, rounded to bfloat16 once (the AMX op sums in float32 in
    its own order: compare within a tolerance)."""
    y = torch.nn.functional.linear(x.double(), weight.double(), None if bias is None else bias.double())
    return y.to(torch.bfloat16)


def quant_linear(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(blocks, kind).T + bias`` in float32, rounded to the dtype of ``x`` once."""
    from .quant import dequantize
    return few_rows_linear(x, dequantize(blocks, kind), bias)


def quantize_x_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., K]`` (K a multiple of 32) rounded to 8 bits a block of 32: ``(qx int8 [..., K],
    dx float32 [..., K / 32])`` with ``dx = max|x| / 127`` and ``qx = round(x * (1 / dx))`` (half
    to even, clamped to [-127, 127]; 0 where ``dx = 0``)."""
    xb = x.float().reshape(*x.shape[:-1], -1, 32)
    dx = xb.abs().amax(-1) / 127
    inv = torch.where(dx > 0, 1.0 / torch.where(dx > 0, dx, 1.0), 0.0)
    qx = torch.round(xb * inv[..., None]).clamp(-127, 127).to(torch.int8)
    return qx.reshape(x.shape), dx


def quant_linear_int8(x: torch.Tensor, blocks: torch.Tensor, kind: str, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``sum_b dx_b * (qx_b . w_b)`` in float64 with ``x`` rounded as :func:`quantize_x_int8` and
    the weights de-quantized exactly, rounded to the dtype of ``x`` once."""
    from .quant import dequantize
    qx, dx = quantize_x_int8(x)
    xq = (qx.double().reshape(*x.shape[:-1], -1, 32) * dx.double()[..., None]).reshape(x.shape)
    y = torch.nn.functional.linear(xq, dequantize(blocks, kind).double(), None if bias is None else bias.double())
    return y.to(x.dtype)


def few_rows_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None = None,
                       scale: float | None = None) -> torch.Tensor:
    """``softmax(scale * q k^T + mask) v`` in float64 over repeated key/value heads, rounded to the
    query's dtype once; a key whose mask is <= -1e30 gets weight 0 unless the row hides every key
    (then the plain formula over all keys; a row of -inf scores gives 0)."""
    rep = query.shape[1] // key.shape[1]
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    k = key.double().repeat_interleave(rep, 1)
    v = value.double().repeat_interleave(rep, 1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        m = mask.double().expand(query.shape[0], 1, query.shape[2], key.shape[2])
        hidden = m <= -1e30
        hidden = hidden & ~hidden.all(-1, keepdim=True)
        scores = (scores + m).masked_fill(hidden, float("-inf"))
    weights = torch.nan_to_num(scores.softmax(-1), nan=0.0) if mask is not None else scores.softmax(-1)
    return (weights @ v).to(query.dtype)  # a row of -inf scores: 0, as SDPA gives


# kv area ---------------------------------------------------------------------------------------

def compact_kv_(keys: torch.Tensor, values: torch.Tensor, src_positions: torch.Tensor, dst_start: torch.Tensor,
                lengths: torch.Tensor) -> None:
    """Gather every moved row first, then write: correct for any source order."""
    compact_kv_layers_([keys, values], src_positions, dst_start, lengths)


def compact_kv_layers_(caches: list[torch.Tensor], src_positions: torch.Tensor, dst_start: torch.Tensor,
                       lengths: torch.Tensor) -> None:
    """:func:`compact_kv_` on every tensor of ``caches`` ([B, H, S, D] each)."""
    for cache in caches:
        for b in range(cache.shape[0]):
            n = int(lengths[b])
            if n == 0:
                continue
            rows = cache[b, :, src_positions[b, :n]].clone()
            start = int(dst_start[b])
            cache[b, :, start:start + n] = rows


def compact_kv_paged_(caches: list[torch.Tensor], block_table: torch.Tensor, src_positions: torch.Tensor,
                      dst_start: torch.Tensor, lengths: torch.Tensor) -> None:
    """Gather every moved row of every pool first (logical -> pool slot through the block
    table), then scatter: correct for any order."""
    page_size = caches[0].shape[1]

    def slots(b: int, pos: torch.Tensor) -> torch.Tensor:
        return block_table[b, pos // page_size].long() * page_size + pos % page_size

    for pool in caches:
        flat = pool.view(pool.shape[0] * page_size, -1)
        moves = []
        for b in range(block_table.shape[0]):
            n = int(lengths[b])
            if n:
                dst = int(dst_start[b]) + torch.arange(n, device=pool.device)
                moves.append((slots(b, dst), flat[slots(b, src_positions[b, :n])].clone()))
        for to, rows in moves:
            flat[to] = rows


def vat_block_weights(accept: torch.Tensor, valid: torch.Tensor, schedule: str = "vat",
                      decay_gamma: float = 7.0) -> tuple[torch.Tensor, torch.Tensor]:
    """First rejection ``k*`` (1-based, K + 1 if none; invalid positions never reject) and the CE
    weights of ``schedule`` (float32, 0 at invalid positions); see :mod:`dartree_ext.vat`."""
    m, k = accept.shape
    rejected = valid & (accept == 0)
    first = torch.where(rejected.any(1), rejected.to(torch.int64).argmax(1) + 1, torch.full_like(rejected[:, 0], k + 1,
                                                                                                   dtype=torch.int64))
    position = torch.arange(1, k + 1, device=accept.device, dtype=torch.float64)[None, :]
    k_star = first[:, None].to(torch.float64)
    before = position < k_star
    decay_shifted = torch.exp(-(position - k_star) / decay_gamma)
    decay_plain = torch.exp(-(position - 1) / decay_gamma).expand(m, k)
    ones, zeros = torch.ones_like(decay_shifted), torch.zeros_like(decay_shifted)
    weights = {
        "vat": torch.where(before, ones, decay_shifted),
        "dflash": decay_plain,
        "prefix_only": torch.where(before, ones, zeros),
        "hard_cutoff": torch.where(position <= k_star, ones, zeros),
        "unshifted": torch.where(before, ones, decay_plain),
    }["vat" if schedule == "vat_soft" else schedule]
    return first.to(torch.int32), torch.where(valid, weights, zeros).to(torch.float32)


def vat_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor, target_tokens: torch.Tensor,
             vh_logits, valid: torch.Tensor, *, rule: str = "greedy", temperature: float = 1.0,
             schedule: str = "vat", decay_gamma: float = 7.0, vh_weight: float = 1.0, generator=None,
             draft_vocab=None, accept_width: int = 1):
    """The VAT loss with materialized softmaxes, autograd through PyTorch (same signature, same
    uniforms from ``generator``, same outputs as :func:`dartree_ext.vat.vat_loss`; ``accept_width``
    ranks the draft columns by a stable descending sort). With
    ``draft_vocab`` (target ids of the draft logits' columns) it is written from the definition:
    ``q`` over those ids, ``p`` renormalized over them as the soft target, no hard term where the
    label is not one of them, and acceptance judged against the target over its whole vocabulary."""
    from .vat import VATLossOutput, draw_uniforms

    m, k, sub = draft_logits.shape
    vocab = target_logits.shape[-1]
    # the target id of each draft column (all of them without a draft vocabulary)
    ids = torch.arange(sub, device=draft_logits.device) if draft_vocab is None else draft_vocab.to(draft_logits.device)
    stat = torch.float64 if draft_logits.dtype == torch.float64 else torch.float32
    # invalid positions may hold anything (NaN included): zero them so they add no NaN gradient
    keep = valid[..., None]
    d = torch.where(keep, draft_logits.to(stat), 0.0)
    t = torch.where(keep, target_logits.detach().to(stat), 0.0)
    log_q = torch.log_softmax(d, -1)
    p = torch.softmax(t[..., ids], -1)                          # on the draft columns, renormalized
    ce_soft = -torch.where(p > 0, p * log_q, 0.0).sum(-1)
    if draft_vocab is None:   # a label outside the vocabulary makes the loss NaN (the op's checks name it)
        in_vocab = (target_tokens >= 0) & (target_tokens < vocab)
        picked = log_q.gather(-1, target_tokens.clamp(0, vocab - 1)[..., None])[..., 0]
        ce_hard = torch.where(in_vocab, -picked, torch.full_like(picked, float("nan")))
    else:                     # no hard term where the label is not a draft token
        match = target_tokens[..., None] == ids
        ce_hard = torch.where(match.any(-1), -(log_q * match).sum(-1), 0.0)
    if rule == "greedy":   # the target's argmax is the drafted token (one of the accept_width drafted tokens)
        drafted = ids[d.argsort(dim=-1, descending=True, stable=True)[..., :accept_width]]
        accept = (drafted == t.argmax(-1, keepdim=True)).any(-1)
    else:
        u = draw_uniforms(rule, m * k, draft_logits.device, generator).view(m, k, 2).double()
        dq, tp = d.detach().double() / temperature, t.double() / temperature
        q_t = torch.softmax(dq, -1)
        p_t = torch.softmax(tp, -1)                              # over the whole target vocabulary
        cdf = torch.cumsum(torch.exp(dq - dq.max(-1, keepdim=True).values), -1)
        chosen = torch.searchsorted(cdf, u[..., 0:1] * cdf[..., -1:], right=True)[..., 0]
        chosen = torch.where(chosen < sub, chosen, dq.argmax(-1))
        q_x = q_t.gather(-1, chosen[..., None])[..., 0]
        p_x = p_t.gather(-1, ids[chosen][..., None])[..., 0]
        accept = u[..., 1] * q_x < p_x
    accept = accept.to(torch.float32)
    first_reject, weights = vat_block_weights(accept, valid, schedule, decay_gamma)
    terms = {"dflash": ce_hard, "vat_soft": ce_soft}.get(schedule, ce_soft + ce_hard)
    per_position = weights.to(stat) * terms
    ce_loss = torch.where(valid, per_position, 0.0).sum() / valid.any(1).sum().clamp(min=1)
    if vh_logits is None:
        vh_loss = torch.zeros((), dtype=stat, device=valid.device)
    else:
        verified = (torch.arange(1, k + 1, device=valid.device)[None, :] < first_reject[:, None]).to(stat)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(torch.where(valid, vh_logits.to(stat), 0.0),
                                                                   verified, reduction="none")
        vh_loss = torch.where(valid, bce, 0.0).sum() / valid.sum().clamp(min=1)
    loss = ce_loss + vh_weight * vh_loss
    return VATLossOutput(loss, ce_loss, vh_loss, first_reject, torch.where(valid, accept, 0.0), weights)


# per-row steps (ops.rms_norm_rows, rotary_rows, rotary_tables, silu_mul, tokens_from_logits) ----

def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2) + eps))`` in float32, the normalized row rounded to the
    dtype and the product rounded again (the drafter's RMSNorm; what training runs)."""
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rotary_rows(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x [B, H, T, Dh]`` at ``positions int64[B or 1, T]``,
    float32 math, one rounding (the drafter's; what training runs)."""
    half = x.shape[-1] // 2
    inv = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = positions.float()[:, None, :, None] * inv
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


def rotary_tables(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding with cos / sin tables ``[B or 1, T, Dh]`` (transformers'
    ``apply_rotary_pos_emb``): ``x * cos + rotate_half(x) * sin`` for ``x`` = ``q``, ``k``."""
    cos, sin = cos[:, None], sin[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], -1)

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A SwiGLU MLP's ``silu(gate) * up``."""
    return torch.nn.functional.silu(gate) * up


def tokens_from_logits(logits: torch.Tensor, uniforms: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """T = 0: ``argmax`` (the first maximum). T > 0: the first token whose cumulative
    ``exp((x - max) / T)`` exceeds ``u`` times the row's total (inverse-CDF sampling)."""
    if temperature == 0:
        return logits.float().argmax(-1)
    scaled = logits.float() / temperature
    cdf = (scaled - scaled.amax(-1, keepdim=True)).exp().cumsum(-1)
    u = uniforms.reshape(cdf.shape[:-1] + (1,)).float() * cdf[..., -1:]
    return torch.searchsorted(cdf, u, right=True).clamp(max=cdf.shape[-1] - 1)[..., 0]
