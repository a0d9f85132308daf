"""Every public op x the classes of bad input, from one table (``CASES``).

Each case is one op, one class, the argument its message must name, and a call on a backend. The
test asserts the error type and that the message names the op and the argument, on every backend
the case lists: the CPU kernels, the CUDA kernels under emulation and real CUDA. Data checks (the
values a kernel reads: ids, counts, NaN scores) are run on the emulated backend with
``validate=True``, through :func:`dartree_ext.ops.validate_inputs`, the host checks the CUDA
path makes; the same calls with ``validate=False`` must stay inside their tensors (the
instrumented emulator checks every global access). Shape, dtype and size checks live in the
C++ op entries, shared by the CPU and CUDA entries (``csrc/checks/``; ``test_cuda_entries_share
_the_cpu_checks`` holds them to it), and run on CPU and CUDA. Oversize sizes run in a child
process under an address-space limit, so an allocation that kills the interpreter fails the case
instead of the run. ``DOCUMENTED`` lists the inputs that are accepted, with what they give.
"""
from __future__ import annotations

import dataclasses
import pathlib
import re
import subprocess
import sys
from typing import Any, Callable

import pytest
import torch

from dartree_ext import ops, quant, reference
from dartree_ext.head import CorrectionHeadWeights
from dartree_ext.sampling import target_tokens_from_logits
from dartree_ext.testing import HAND_NUM_NODES, HAND_PARENTS, HAND_TOKENS
from dartree_ext.vat import vat_loss
from conftest import make_backend

I32, I64 = torch.int32, torch.int64
NAN, INF = float("nan"), float("inf")
CLASSES = ("non-finite", "negative id", "id past vocabulary", "oversize", "zero size", "mixed dtypes", "empty")
ALL, HOST = ("cpu", "emu", "cuda"), ("cpu", "cuda")  # HOST: the C++ entries' checks (not emulated)


@dataclasses.dataclass(frozen=True)
class Case:
    op: str
    kind: str  # one of CLASSES
    arg: str  # the argument the message names
    call: Callable[[Any, bool], Any]  # (backend, validate) -> runs the op on the bad input
    error: type = ValueError
    backends: tuple[str, ...] = HOST
    child: bool = False  # run in a child process (sizes that could exhaust memory)
    name_in_message: str = ""  # the op's name in the message, where a wrapper reports an inner op
    match: str = ""  # a pattern the message must also hold (a size case: the bound it names)


# inputs on a backend ---------------------------------------------------------------------------

def _with(t, index, value):
    t = t.clone()
    t[index] = value
    return t


def _amx(x=None, packed=None, out=20, bias=None):
    """amx_linear of 20 outputs over 32 inputs (2 output blocks), each argument replaceable."""
    weight = torch.randn(20, 32).bfloat16()
    return ops.amx_linear(torch.randn(2, 32).bfloat16() if x is None else x,
                          ops.pack_amx(weight) if packed is None else packed, out, bias)


def _head(b, dtype=torch.float32):
    return CorrectionHeadWeights.random(30, 12, 8, 6, device=b.device, dtype=dtype)


def _expand(b, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    z = torch.randn(2, 3, 8, generator=g, dtype=dtype)
    ids = torch.randint(0, 30, (2, 3, 5), generator=g)
    base = torch.randn(2, 3, 5, generator=g, dtype=dtype)
    root = torch.randn(2, 6, generator=g, dtype=dtype)
    return [t.to(b.device) for t in (z, ids, base, root)]


def _depth(b, z=None, ids=None, base=None, states=None, scores=None, num=None, width=2, validate=True):
    """expand_depth on request 2 x 2 parents, each argument replaceable."""
    zz, ii, bb, _ = _expand(b)
    put = lambda t, d: (d if t is None else t).to(b.device)  # noqa: E731
    return b.ops.expand_depth(_head(b), put(z, zz[:, 0].contiguous()), put(ids, ii[:, 0].contiguous()),
                              put(base, bb[:, 0].contiguous()), put(states, torch.zeros(2, 2, 6)),
                              put(scores, torch.zeros(2, 2)), put(num, torch.full((2,), 2, dtype=I32)), width,
                              validate=validate)


def _supertree(b, z=None, ids=None, base=None, root=None, width=2, validate=True):
    zz, ii, bb, rr = _expand(b)
    pick = lambda t, d: d if t is None else t.to(b.device)  # noqa: E731
    return b.ops.build_supertree(_head(b), pick(z, zz), pick(ids, ii), pick(base, bb), pick(root, rr), width,
                                 validate=validate)


def _heap(b, logprobs=None, ids=None, roots=None, budget=8, validate=True):
    lp = torch.sort(torch.log_softmax(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1)), -1), -1,
                    descending=True).values
    lp = lp if logprobs is None else logprobs(lp)
    ids = torch.randint(0, 9, (2, 3, 4), generator=torch.Generator().manual_seed(2)) if ids is None else ids
    roots = torch.tensor([1, 2]) if roots is None else roots
    return b.ops.ddtree_heap(*b.put(lp, ids, roots), budget, validate=validate)


def _top_w(b, ps=None, cl=None, num=None, width=2, validate=True):
    ps = torch.zeros(2, 3) if ps is None else ps
    cl = torch.log_softmax(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(3)), -1) if cl is None else cl
    num = torch.tensor([3, 2], dtype=I32) if num is None else num
    return b.ops.select_top_w(*b.put(ps, cl, num), width, validate=validate)


def _top_b(b, parents=None, scores=None, num=None, budget=3, validate=True):
    parents = HAND_PARENTS if parents is None else parents
    scores = torch.zeros(HAND_PARENTS.shape) if scores is None else scores
    num = HAND_NUM_NODES if num is None else num
    return b.ops.select_top_b(*b.put(parents, scores, num), budget, validate=validate)


def _tree_op(name):
    def call(b, parents=None, num=None, validate=True):
        p, n = b.put(HAND_PARENTS if parents is None else parents, HAND_NUM_NODES if num is None else num)
        if name == "tree_attention_mask":
            return b.ops.tree_attention_mask(p, n, b.put(torch.ones(p.shape[0], 2, dtype=torch.bool)), validate=validate)
        return getattr(b.ops, name)(p, n, validate=validate)
    return call


def _verify(b, tokens=None, target=None, parents=None, validate=True):
    tokens = HAND_TOKENS if tokens is None else tokens
    target = HAND_TOKENS if target is None else target
    return b.ops.verify_tree(*b.put(tokens, HAND_PARENTS if parents is None else parents, HAND_NUM_NODES, target),
                             validate=validate)


def _kv(b, keys=None, values=None, src=None, dst=None, lengths=None):
    keys = torch.zeros(2, 1, 10, 4) if keys is None else keys
    values = torch.zeros(2, 1, 10, 4) if values is None else values
    src = torch.tensor([[5, 6], [3, 4]]) if src is None else src
    dst = torch.tensor([2, 2]) if dst is None else dst
    lengths = torch.tensor([2, 2], dtype=I32) if lengths is None else lengths
    return b.ops.compact_kv_(*b.put(keys, values, src, dst, lengths))


def _paged(b, table=None, validate=True):
    pool = b.put(torch.zeros(4, 4, 1, 2))
    table = torch.tensor([[0, 1], [2, 3]], dtype=I32) if table is None else table
    return b.ops.compact_kv_paged_([pool], *b.put(table, torch.tensor([[5, 6], [3, 4]]), torch.tensor([2, 2]),
                                                  torch.tensor([2, 2], dtype=I32)), validate=validate)


def _vat(b, draft=None, target=None, tokens=None, vh=None, valid=None, **kwargs):
    g = torch.Generator().manual_seed(4)
    draft = torch.randn(1, 2, 5, generator=g) if draft is None else draft
    target = torch.randn(1, 2, 5, generator=g) if target is None else target
    tokens = torch.zeros(1, 2, dtype=I64) if tokens is None else tokens
    valid = torch.ones(draft.shape[:2], dtype=torch.bool) if valid is None else valid
    draft = draft.to(b.device).requires_grad_()
    loss = vat_loss if b.name != "emu" else b.ops.vat_loss
    return loss(draft, *b.put(target, tokens), None if vh is None else vh.to(b.device), valid.to(b.device), **kwargs)


_BLOCKS = quant.quantize(torch.randn(4, 64, generator=torch.Generator().manual_seed(5)), "q4_0")


def _quant(b, op="quant_linear", x=None, blocks=None, kind="q4_0", bias=None):
    x = torch.randn(1, 64) if x is None else x
    blocks = _BLOCKS if blocks is None else blocks
    if op == "quant_linear_int8":
        blocks = quant.pack_int8(blocks, "q4_0") if blocks.dtype == torch.uint8 and blocks.dim() == 2 else blocks
    fn = getattr(ops, op) if b.name != "emu" else b.ops.quant_linear
    return fn(*b.put(x, blocks), kind, None if bias is None else bias.to(b.device))


def _c(op, kind, arg, call, error=ValueError, backends=HOST, **kw):
    return Case(op, kind, arg, call, error, backends, **kw)


CPU = ("cpu",)
CASES: list[Case] = []
for _name in ("tree_ancestor_bits", "tree_attention_mask", "tree_links"):
    _t = _tree_op(_name)
    CASES += [
        _c(_name, "negative id", "parents", lambda b, v, t=_t: t(b, _with(HAND_PARENTS, (0, 2), -4), validate=v),
           backends=ALL),
        _c(_name, "negative id", "num_nodes", lambda b, v, t=_t: t(b, num=torch.tensor([-1], dtype=I32), validate=v),
           backends=ALL),
        _c(_name, "oversize", "num_nodes", lambda b, v, t=_t: t(b, num=torch.tensor([9], dtype=I32), validate=v),
           backends=ALL),
        _c(_name, "oversize", "parents", lambda b, v, t=_t: t(b, torch.full((1, ops.MAX_TREE_NODES + 1), -1, dtype=I32),
                                                                torch.ones(1, dtype=I32), validate=v)),
        _c(_name, "zero size", "parents", lambda b, v, t=_t: t(b, torch.zeros(1, 0, dtype=I32), validate=v)),
        _c(_name, "mixed dtypes", "parents", lambda b, v, t=_t: t(b, HAND_PARENTS.long(), validate=v), RuntimeError),
        _c(_name, "mixed dtypes", "num_nodes", lambda b, v, t=_t: t(b, num=HAND_NUM_NODES.long(), validate=v),
           RuntimeError),
    ]
CASES += [
    _c("tree_attention_mask", "mixed dtypes", "past_key_mask",
       lambda b, v: b.ops.tree_attention_mask(*b.put(HAND_PARENTS, HAND_NUM_NODES, torch.ones(1, 2)), validate=v),
       RuntimeError),
    _c("verify_tree", "negative id", "parents", lambda b, v: _verify(b, parents=_with(HAND_PARENTS, (0, 3), -2),
                                                                   validate=v), backends=ALL),
    _c("verify_tree", "negative id", "tokens", lambda b, v: _verify(b, _with(HAND_TOKENS, (0, 2), -3), validate=v),
       backends=ALL),
    _c("verify_tree", "negative id", "target_tokens",
       lambda b, v: _verify(b, target=_with(HAND_TOKENS, (0, 1), -1), validate=v), backends=ALL),
    _c("verify_tree", "mixed dtypes", "tokens", lambda b, v: _verify(b, HAND_TOKENS.float(), validate=v), RuntimeError),
    _c("verify_tree", "mixed dtypes", "target_tokens", lambda b, v: _verify(b, target=HAND_TOKENS.int(), validate=v),
       RuntimeError),
    _c("verify_tree", "empty", "target_tokens", lambda b, v: _verify(b, target=HAND_TOKENS[:, :0].contiguous(),
                                                                   validate=v), RuntimeError),
    _c("packed_tree_mask", "negative id", "seq_lens", lambda b, v: ops.packed_tree_mask(
        *b.put(torch.zeros(1, 1, 1, dtype=I64), torch.tensor([-5]), torch.tensor([0, 1], dtype=I32)), 1)),
    _c("packed_tree_mask", "oversize", "mask_indptr", lambda b, v: ops.packed_tree_mask(
        *b.put(torch.zeros(1, 1, 1, dtype=I64), torch.tensor([5]), torch.tensor([0, 100], dtype=I32)), 1)),
    _c("packed_tree_mask", "oversize", "total_bytes", lambda b, v: ops.packed_tree_mask(
        *b.put(torch.zeros(1, 1, 1, dtype=I64), torch.zeros(1, dtype=I64), torch.zeros(2, dtype=I32)), 2 ** 40),
       child=True, match=r"total_bytes must be in \[0, 2\^31\)"),
    _c("packed_tree_mask", "negative id", "total_bytes", lambda b, v: ops.packed_tree_mask(
        *b.put(torch.zeros(1, 1, 1, dtype=I64), torch.tensor([5]), torch.tensor([0, 1], dtype=I32)), -1)),
    _c("packed_tree_mask", "mixed dtypes", "bits", lambda b, v: ops.packed_tree_mask(
        *b.put(torch.zeros(1, 1, 1, dtype=I32), torch.tensor([5]), torch.tensor([0, 1], dtype=I32)), 1), RuntimeError),
    # selection
    _c("select_top_w", "non-finite", "parent_scores", lambda b, v: _top_w(b, _with(torch.zeros(2, 3), (0, 1), NAN),
                                                                        validate=v), backends=ALL),
    _c("select_top_w", "non-finite", "parent_scores", lambda b, v: _top_w(b, _with(torch.zeros(2, 3), (1, 0), INF),
                                                                        validate=v), backends=ALL),
    _c("select_top_w", "non-finite", "child_logprobs", lambda b, v: _top_w(b, cl=torch.full((2, 3, 4), NAN),
                                                                         validate=v), backends=ALL),
    _c("select_top_w", "negative id", "num_parents", lambda b, v: _top_w(b, num=torch.tensor([3, -1], dtype=I32),
                                                                       validate=v), backends=ALL),
    _c("select_top_w", "oversize", "num_parents", lambda b, v: _top_w(b, num=torch.tensor([4, 2], dtype=I32),
                                                                    validate=v), backends=ALL),
    _c("select_top_w", "zero size", "width", lambda b, v: _top_w(b, width=0, validate=v)),
    _c("select_top_w", "oversize", "width", lambda b, v: _top_w(b, width=2 ** 31, validate=v), child=True,
       match=r"width must be in \[1, 8192\]"),
    _c("select_top_w", "mixed dtypes", "child_logprobs", lambda b, v: _top_w(b, cl=torch.zeros(2, 3, 4).bfloat16(),
                                                                           validate=v), RuntimeError),
    _c("select_top_w", "empty", "child_logprobs", lambda b, v: _top_w(b, cl=torch.zeros(2, 3, 0), validate=v)),
    _c("select_top_b", "non-finite", "scores", lambda b, v: _top_b(b, scores=_with(torch.zeros(1, 8), (0, 4), NAN),
                                                                 validate=v), backends=ALL),
    _c("select_top_b", "non-finite", "scores", lambda b, v: _top_b(b, scores=_with(torch.zeros(1, 8), (0, 2), INF),
                                                                 validate=v), backends=ALL),
    _c("select_top_b", "negative id", "parents", lambda b, v: _top_b(b, _with(HAND_PARENTS, (0, 5), -7), validate=v),
       backends=ALL),
    _c("select_top_b", "negative id", "budget", lambda b, v: _top_b(b, budget=-1, validate=v)),
    _c("select_top_b", "oversize", "budget", lambda b, v: _top_b(b, budget=2 ** 40, validate=v), child=True,
       match=r"budget must be in \[0, 8192\]"),
    _c("select_top_b", "mixed dtypes", "scores", lambda b, v: _top_b(b, scores=torch.zeros(1, 8).double(), validate=v),
       RuntimeError),
    _c("ddtree_heap", "non-finite", "logprobs", lambda b, v: _heap(b, lambda lp: _with(lp, (0, 1, 0), INF),
                                                                 validate=v), backends=ALL),
    _c("ddtree_heap", "non-finite", "logprobs", lambda b, v: _heap(b, lambda lp: _with(lp, (1, 2, 1), NAN),
                                                                 validate=v), backends=ALL),
    _c("ddtree_heap", "negative id", "token_ids", lambda b, v: _heap(b, ids=torch.full((2, 3, 4), -1), validate=v),
       backends=ALL),
    _c("ddtree_heap", "negative id", "root_tokens", lambda b, v: _heap(b, roots=torch.tensor([0, -5]), validate=v),
       backends=ALL),
    _c("ddtree_heap", "negative id", "budget", lambda b, v: _heap(b, budget=-1, validate=v)),
    _c("ddtree_heap", "oversize", "budget", lambda b, v: _heap(b, budget=2 ** 40, validate=v), child=True,
       match=r"budget must be in \[0, 2048\]"),
    _c("ddtree_heap", "mixed dtypes", "logprobs", lambda b, v: _heap(b, lambda lp: lp.double(), validate=v),
       RuntimeError),
    _c("ddtree_heap", "mixed dtypes", "token_ids", lambda b, v: _heap(b, ids=torch.zeros(2, 3, 4, dtype=I32),
                                                                    validate=v), RuntimeError),
    # expansion
    _c("expand_depth", "id past vocabulary", "cand_ids", lambda b, v: _depth(b, ids=torch.full((2, 5), 30),
                                                                           validate=v), backends=ALL),
    _c("expand_depth", "negative id", "cand_ids", lambda b, v: _depth(b, ids=torch.full((2, 5), -2), validate=v),
       backends=ALL),
    _c("expand_depth", "non-finite", "cand_base", lambda b, v: _depth(b, base=torch.full((2, 5), NAN), validate=v),
       backends=ALL),
    _c("expand_depth", "non-finite", "z", lambda b, v: _depth(b, z=torch.full((2, 8), INF), validate=v),
       backends=ALL),
    _c("expand_depth", "non-finite", "parent_scores", lambda b, v: _depth(b, scores=_with(torch.zeros(2, 2), (0, 1),
                                                                                           NAN), validate=v),
       backends=ALL),
    _c("expand_depth", "non-finite", "parent_states", lambda b, v: _depth(b, states=_with(torch.zeros(2, 2, 6),
                                                                                           (1, 0, 3), NAN),
                                                                           validate=v), backends=ALL),
    _c("expand_depth", "oversize", "num_parents", lambda b, v: _depth(b, num=torch.tensor([1, 3], dtype=I32),
                                                                    validate=v), backends=ALL),
    _c("expand_depth", "negative id", "num_parents", lambda b, v: _depth(b, num=torch.tensor([-1, 1], dtype=I32),
                                                                       validate=v), backends=ALL),
    _c("expand_depth", "oversize", "width", lambda b, v: _depth(b, width=2 ** 31, validate=v), child=True,
       match=r"width must be in \[0, 8192\]"),
    _c("expand_depth", "empty", "cand_ids", lambda b, v: _depth(b, ids=torch.zeros(2, 0, dtype=I64),
                                                              base=torch.zeros(2, 0), validate=v), RuntimeError),
    _c("expand_depth", "mixed dtypes", "parent_states", lambda b, v: _depth(b, states=torch.zeros(2, 2, 6).double(),
                                                                          validate=v), RuntimeError),
    _c("build_supertree", "id past vocabulary", "cand_ids",
       lambda b, v: _supertree(b, ids=torch.full((2, 3, 5), 31), validate=v), backends=ALL),
    _c("build_supertree", "negative id", "cand_ids", lambda b, v: _supertree(b, ids=torch.full((2, 3, 5), -1),
                                                                           validate=v), backends=ALL),
    _c("build_supertree", "non-finite", "cand_base", lambda b, v: _supertree(b, base=torch.full((2, 3, 5), NAN),
                                                                           validate=v), backends=ALL),
    _c("build_supertree", "non-finite", "root_state", lambda b, v: _supertree(b, root=torch.full((2, 6), NAN),
                                                                            validate=v), backends=ALL),
    _c("build_supertree", "non-finite", "z", lambda b, v: _supertree(b, z=torch.full((2, 3, 8), -INF), validate=v),
       backends=ALL),
    _c("build_supertree", "zero size", "width", lambda b, v: _supertree(b, width=0, validate=v)),
    _c("build_supertree", "oversize", "width", lambda b, v: _supertree(b, width=[2 ** 31, 1, 1], validate=v),
       child=True, match=r"every width must be in \[1, 65535\]"),
    _c("build_supertree", "mixed dtypes", "z", lambda b, v: _supertree(b, z=torch.zeros(2, 3, 8).bfloat16(),
                                                                     validate=v), RuntimeError),
    _c("build_supertree", "empty", "cand_ids", lambda b, v: _supertree(b, ids=torch.zeros(2, 3, 0, dtype=I64),
                                                                     base=torch.zeros(2, 3, 0), validate=v),
       RuntimeError),
    # kv
    _c("compact_kv_", "negative id", "lengths", lambda b, v: _kv(b, lengths=torch.tensor([-1, 2], dtype=I32)), backends=CPU),
    _c("compact_kv_", "negative id", "dst_start", lambda b, v: _kv(b, dst=torch.tensor([-3, 2])), backends=CPU),
    _c("compact_kv_", "oversize", "src_positions", lambda b, v: _kv(b, src=torch.tensor([[5, 60], [3, 4]])),
       backends=CPU),
    _c("compact_kv_", "mixed dtypes", "values", lambda b, v: _kv(b, values=torch.zeros(2, 1, 10, 4).bfloat16()),
       RuntimeError),
    _c("compact_kv_", "mixed dtypes", "src_positions", lambda b, v: _kv(b, src=torch.tensor([[5, 6], [3, 4]], dtype=I32)),
       RuntimeError),
    _c("compact_kv_", "oversize", "lengths", lambda b, v: _kv(b, lengths=torch.tensor([3, 2], dtype=I32)),
       backends=CPU),
    _c("compact_kv_layers_", "empty", "caches", lambda b, v: ops.compact_kv_layers_(
        [], *b.put(torch.tensor([[5, 6], [3, 4]]), torch.tensor([2, 2]), torch.tensor([2, 2], dtype=I32)))),
    _c("compact_kv_layers_", "mixed dtypes", "caches", lambda b, v: ops.compact_kv_layers_(
        [b.put(torch.zeros(2, 1, 10, 4)), b.put(torch.zeros(3, 1, 10, 4))],
        *b.put(torch.tensor([[5, 6], [3, 4]]), torch.tensor([2, 2]), torch.tensor([2, 2], dtype=I32)))),
    _c("compact_kv_paged_", "negative id", "block_table",
       lambda b, v: _paged(b, torch.tensor([[-1, 1], [2, 3]], dtype=I32), validate=v), backends=ALL),
    _c("compact_kv_paged_", "oversize", "block_table",
       lambda b, v: _paged(b, torch.tensor([[0, 1], [2, 9]], dtype=I32), validate=v), backends=ALL),
    _c("compact_kv_paged_", "mixed dtypes", "block_table",
       lambda b, v: _paged(b, torch.tensor([[0, 1], [2, 3]]), validate=v), RuntimeError),
    # quantized linear (the emulated backend runs the CUDA kernel's arithmetic without the entry)
    _c("quant_linear", "zero size", "kind", lambda b, v: _quant(b, kind="q5_0")),
    _c("quant_linear", "oversize", "x", lambda b, v: _quant(b, x=torch.randn(257, 64))),
    _c("quant_linear", "zero size", "x", lambda b, v: _quant(b, x=torch.randn(1, 48))),
    _c("quant_linear", "mixed dtypes", "bias", lambda b, v: _quant(b, bias=torch.zeros(4).bfloat16()), RuntimeError),
    _c("quant_linear", "mixed dtypes", "blocks", lambda b, v: _quant(b, blocks=torch.zeros(4, 36)), RuntimeError),
    _c("quant_linear_int8", "zero size", "kind", lambda b, v: _quant(b, "quant_linear_int8", kind="q5_0"),
       backends=CPU),
    _c("quant_linear_int8", "oversize", "x", lambda b, v: _quant(b, "quant_linear_int8", x=torch.randn(257, 64)),
       backends=CPU),
    _c("quant_linear_int8", "mixed dtypes", "bias",
       lambda b, v: _quant(b, "quant_linear_int8", bias=torch.zeros(4).bfloat16()), RuntimeError, backends=CPU),
    # AMX linear (CPU only; the shape checks come before the AMX check, so they run on any CPU)
    _c("amx_linear", "oversize", "x", lambda b, v: _amx(x=torch.randn(257, 32).bfloat16()), backends=CPU),
    _c("amx_linear", "mixed dtypes", "x", lambda b, v: _amx(x=torch.randn(2, 32)), RuntimeError, backends=CPU),
    _c("amx_linear", "mixed dtypes", "bias", lambda b, v: _amx(bias=torch.zeros(20)), RuntimeError, backends=CPU),
    _c("amx_linear", "zero size", "out_features", lambda b, v: _amx(out=0), backends=CPU),
    _c("amx_linear", "zero size", "x", lambda b, v: _amx(x=torch.randn(2, 40).bfloat16()), backends=CPU),
    _c("amx_linear", "empty", "packed", lambda b, v: _amx(packed=torch.zeros(2, 0, 512).bfloat16()), RuntimeError,
       backends=CPU),
    _c("pack_amx", "mixed dtypes", "weight", lambda b, v: ops.pack_amx(torch.randn(20, 32)), backends=CPU),
    _c("pack_amx", "zero size", "weight", lambda b, v: ops.pack_amx(torch.randn(20, 40).bfloat16()), backends=CPU),
    _c("pack_amx", "empty", "weight", lambda b, v: ops.pack_amx(torch.zeros(0, 32).bfloat16()), backends=CPU),
    # row ops (CPU only)
    _c("few_rows_linear", "oversize", "x", lambda b, v: ops.few_rows_linear(torch.randn(257, 4), torch.randn(3, 4)),
       backends=CPU),
    _c("few_rows_linear", "mixed dtypes", "weight",
       lambda b, v: ops.few_rows_linear(torch.randn(1, 4), torch.randn(3, 4).bfloat16()), RuntimeError, backends=CPU),
    _c("few_rows_linear", "zero size", "x", lambda b, v: ops.few_rows_linear(torch.randn(1, 5), torch.randn(3, 4)),
       RuntimeError, backends=CPU),
    _c("rms_norm_rows", "non-finite", "eps", lambda b, v: ops.rms_norm_rows(torch.randn(2, 4), torch.ones(4), NAN),
       backends=CPU),
    _c("rms_norm_rows", "negative id", "eps", lambda b, v: ops.rms_norm_rows(torch.randn(2, 4), torch.ones(4), -1.0),
       backends=CPU),
    _c("rms_norm_rows", "mixed dtypes", "weight",
       lambda b, v: ops.rms_norm_rows(torch.randn(2, 4), torch.ones(4).bfloat16(), 1e-6), RuntimeError, backends=CPU),
    _c("rms_norm_rows", "empty", "x", lambda b, v: ops.rms_norm_rows(torch.randn(2, 0), torch.ones(0), 1e-6),
       RuntimeError, backends=CPU),
    _c("rotary_rows", "non-finite", "theta",
       lambda b, v: ops.rotary_rows(torch.randn(1, 1, 2, 4), torch.tensor([[0, 1]]), INF), backends=CPU),
    _c("rotary_rows", "mixed dtypes", "positions",
       lambda b, v: ops.rotary_rows(torch.randn(1, 1, 2, 4), torch.tensor([[0, 1]], dtype=I32), 1e4), RuntimeError,
       backends=CPU),
    _c("rotary_tables", "mixed dtypes", "cos", lambda b, v: ops.rotary_tables(
        torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 2, 4).bfloat16(), torch.randn(1, 2, 4)),
       RuntimeError, backends=CPU),
    _c("silu_mul", "mixed dtypes", "up", lambda b, v: ops.silu_mul(torch.randn(3), torch.randn(3).bfloat16()),
       RuntimeError, backends=CPU),
    _c("few_rows_attention", "non-finite", "scale", lambda b, v: ops.few_rows_attention(
        torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), scale=NAN), backends=CPU),
    _c("few_rows_attention", "mixed dtypes", "key", lambda b, v: ops.few_rows_attention(
        torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4).bfloat16(), torch.randn(1, 1, 3, 4)), backends=CPU),
    _c("few_rows_attention", "empty", "key", lambda b, v: ops.few_rows_attention(
        torch.randn(1, 1, 1, 4), torch.randn(1, 1, 0, 4), torch.randn(1, 1, 0, 4)), backends=CPU),
    _c("few_rows_attention", "mixed dtypes", "mask", lambda b, v: ops.few_rows_attention(
        torch.randn(1, 1, 1, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.zeros(1, 1, 1, 3, dtype=I32)),
       backends=CPU),
    # sampling
    _c("tokens_from_logits", "non-finite", "logits",
       lambda b, v: ops.tokens_from_logits(torch.full((2, 5), NAN), None, 0.0), backends=CPU),
    _c("tokens_from_logits", "non-finite", "logits",
       lambda b, v: ops.tokens_from_logits(torch.full((2, 5), -INF), torch.rand(2), 1.0), backends=CPU),
    _c("tokens_from_logits", "non-finite", "temperature",
       lambda b, v: ops.tokens_from_logits(torch.randn(2, 5), torch.rand(2), INF), backends=CPU),
    _c("tokens_from_logits", "non-finite", "uniforms",
       lambda b, v: ops.tokens_from_logits(torch.randn(2, 5), torch.tensor([0.5, NAN]), 1.0), backends=CPU),
    _c("tokens_from_logits", "oversize", "uniforms",
       lambda b, v: ops.tokens_from_logits(torch.randn(2, 5), torch.tensor([0.5, 1.0]), 1.0), backends=CPU),
    _c("tokens_from_logits", "mixed dtypes", "uniforms",
       lambda b, v: ops.tokens_from_logits(torch.randn(2, 5), torch.rand(2, dtype=torch.float64), 1.0), RuntimeError,
       backends=CPU),
    _c("tokens_from_logits", "empty", "logits", lambda b, v: ops.tokens_from_logits(torch.randn(2, 0), None, 0.0),
       RuntimeError, backends=CPU),
    _c("target_tokens_from_logits", "non-finite", "logits",
       lambda b, v: target_tokens_from_logits(b.put(torch.full((2, 5), NAN)), 0.0), name_in_message="tokens_from_logits",
       backends=ALL),
    _c("target_tokens_from_logits", "non-finite", "temperature",
       lambda b, v: target_tokens_from_logits(b.put(torch.randn(2, 5)), INF), backends=ALL),
    _c("target_tokens_from_logits", "non-finite", "top_p",
       lambda b, v: target_tokens_from_logits(b.put(torch.randn(2, 5)), 1.0, top_p=NAN), backends=ALL),
    _c("target_tokens_from_logits", "zero size", "top_k",
       lambda b, v: target_tokens_from_logits(b.put(torch.randn(2, 5)), 1.0, top_k=0), backends=ALL),
    _c("target_tokens_from_logits", "mixed dtypes", "logits",
       lambda b, v: target_tokens_from_logits(b.put(torch.randint(0, 5, (2, 5))), 0.0), TypeError, backends=ALL),
    _c("target_tokens_from_logits", "empty", "logits",
       lambda b, v: target_tokens_from_logits(b.put(torch.randn(2, 0)), 0.0), backends=ALL),
    # the VAT loss (its checks are Python, run on the emulated kernels too)
    _c("vat_loss", "non-finite", "draft_logits", lambda b, v: _vat(b, torch.full((1, 2, 5), NAN)), FloatingPointError,
       ALL),
    _c("vat_loss", "non-finite", "vh_logits", lambda b, v: _vat(b, vh=torch.full((1, 2), NAN)), FloatingPointError, ALL),
    _c("vat_loss", "negative id", "target_tokens", lambda b, v: _vat(b, tokens=torch.full((1, 2), -1)),
       FloatingPointError, ALL),
    _c("vat_loss", "id past vocabulary", "target_tokens", lambda b, v: _vat(b, tokens=torch.full((1, 2), 5)),
       FloatingPointError, ALL),
    _c("vat_loss", "mixed dtypes", "target_logits", lambda b, v: _vat(b, target=torch.randn(1, 2, 5).double()),
       TypeError, ALL),
    _c("vat_loss", "empty", "vocabulary", lambda b, v: _vat(b, torch.randn(1, 2, 0), torch.randn(1, 2, 0)),
       backends=ALL),
    _c("vat_loss", "empty", "positions", lambda b, v: _vat(b, torch.randn(0, 2, 5), torch.randn(0, 2, 5),
                                                         torch.zeros(0, 2, dtype=I64)), backends=ALL),
    _c("vat_loss", "non-finite", "temperature", lambda b, v: _vat(b, temperature=NAN), backends=ALL),
    _c("vat_loss", "negative id", "temperature", lambda b, v: _vat(b, temperature=-1.0), backends=ALL),
    _c("vat_loss", "oversize", "accept_width", lambda b, v: _vat(b, accept_width=10 ** 9), backends=ALL),
    _c("vat_loss", "zero size", "decay_gamma", lambda b, v: _vat(b, decay_gamma=0.0), backends=ALL),
]


def _case_id(case: Case) -> str:
    return f"{case.op}-{case.kind.replace(' ', '_')}-{case.arg}"


def _ids(cases):
    seen: dict[str, int] = {}
    out = []
    for c in cases:
        key = _case_id(c)
        seen[key] = seen.get(key, 0) + 1
        out.append(key if seen[key] == 1 else f"{key}{seen[key]}")
    return out


CASE_IDS = dict(zip(_ids(CASES), CASES))
_PAIRS = [(cid, name) for cid, c in CASE_IDS.items() for name in c.backends]


def _check_message(case: Case, error: BaseException) -> None:
    message = str(error)
    name = case.name_in_message or case.op
    assert re.search(rf"(^|\W){re.escape(name)}\W", message), f"the message does not name {name}: {message}"
    assert re.search(rf"\b{re.escape(case.arg)}\b", message), f"the message does not name {case.arg}: {message}"
    assert re.search(case.match, message), f"the message does not say {case.match!r}: {message}"


def run_case(cid: str, backend_name: str) -> BaseException | None:
    """Run one case; the error it raised (None if it was accepted)."""
    case = CASE_IDS[cid]
    backend = make_backend(backend_name)
    try:
        case.call(backend, True)
    except case.error as e:
        return e
    return None


@pytest.mark.parametrize("cid, backend_name", [pytest.param(c, n, id=f"{c}-{n}") for c, n in _PAIRS])
def test_bad_input_is_refused(cid, backend_name, tmp_path):
    case = CASE_IDS[cid]
    make_backend(backend_name)  # (skips where the backend is absent)
    if case.child:
        _run_in_child(cid, backend_name, tmp_path)
        return
    error = run_case(cid, backend_name)
    assert error is not None, f"{cid} on {backend_name}: accepted"
    _check_message(case, error)


def _run_in_child(cid: str, backend_name: str, tmp_path: pathlib.Path) -> None:
    tests = pathlib.Path(__file__).resolve().parent
    package_root = pathlib.Path(ops.__file__).resolve().parents[1]  # the dartree_ext this process runs
    code = ("import resource, sys\n"
            # 8 GiB of address space: far above what a refused call needs, far below what an
            # attempted 2**31-wide output takes (an allocation past it fails instead of swapping)
            "resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))\n"
            f"sys.path[:0] = [{str(package_root)!r}, {str(tests)!r}]\n"
            "import test_bad_input_matrix as m\n"
            f"e = m.run_case({cid!r}, {backend_name!r})\n"
            "print('ACCEPTED' if e is None else 'REFUSED ' + str(e).splitlines()[0])\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("REFUSED"), done.stdout
    _check_message(CASE_IDS[cid], ValueError(done.stdout[len("REFUSED "):]))


DATA_CASES = [cid for cid, c in CASE_IDS.items() if "emu" in c.backends and c.op in ops._VALIDATORS]


@pytest.mark.parametrize("cid", DATA_CASES)
def test_emu_kernels_stay_inside_their_tensors_without_validation(cid):
    """The CUDA kernels on bad values with validate=False: whatever they compute, no access outside
    the tensors they were given (checked by the instrumented emulator, DARTREE_EMU_INSTRUMENT=1)."""
    backend = make_backend("emu")
    CASE_IDS[cid].call(backend, False)


def test_every_class_and_public_op_is_in_the_table():
    public = set(ops.__all__) - {"MAX_HEAP_BUDGET", "MAX_TREE_NODES", "check_tree", "validate_inputs"}
    covered = {c.op for c in CASES}
    assert public - covered == set(), f"public ops without a bad-input case: {sorted(public - covered)}"
    assert {c.kind for c in CASES} == set(CLASSES)
    assert set(DATA_CASES), "no data case runs on the emulated backend"


def test_validate_inputs_names_its_ops():
    with pytest.raises(ValueError, match="validate_inputs: no data checks for 'few_rows_linear'"):
        ops.validate_inputs("few_rows_linear")


def test_cuda_entries_share_the_cpu_checks():
    """A CUDA op entry checks its inputs with the same csrc/checks/ function as the CPU entry."""
    csrc = pathlib.Path(__file__).resolve().parents[1] / "csrc"
    calls = lambda files: {m for f in files for m in re.findall(r"\b(check_\w+)\(", f.read_text())}  # noqa: E731
    cuda, cpu = calls(sorted((csrc / "cuda").glob("*_ops.cpp"))), calls(sorted((csrc / "cpu").glob("*.cpp")))
    assert cuda, "no checks found in the CUDA entries"
    assert cuda <= cpu, f"checks only the CUDA entries make: {sorted(cuda - cpu)}"


# accepted, as documented ------------------------------------------------------------------------

_ROT_X = torch.randn(1, 2, 2, 8, generator=torch.Generator().manual_seed(6))
DOCUMENTED = {
    "an empty batch gives empty results": lambda: ops.tree_ancestor_bits(torch.zeros(0, 8, dtype=I32),
                                                                          torch.zeros(0, dtype=I32))[0].shape == (0, 8, 1),
    "a heap over no positions is the root alone": lambda: int(ops.ddtree_heap(
        torch.zeros(1, 0, 3), torch.zeros(1, 0, 3, dtype=I64), torch.zeros(1, dtype=I64), 4)[-1][0]) == 1,
    "a supertree of no depths has no nodes": lambda: _supertree(make_backend("cpu"), torch.zeros(2, 0, 8),
                                                                torch.zeros(2, 0, 5, dtype=I64), torch.zeros(2, 0, 5)
                                                                )[0].shape == (2, 0),
    "NaN inputs to a linear layer give NaN outputs (arithmetic, as torch)": lambda: bool(ops.few_rows_linear(
        torch.full((1, 4), NAN), torch.randn(3, 4)).isnan().all()),
    "a negative rotary position rotates backwards (EAGLE-3's shifted first position is -1)": lambda: torch.allclose(
        ops.rotary_rows(_ROT_X, torch.tensor([[-1, -3]]), 1e4), reference.rotary_rows(_ROT_X, torch.tensor([[-1, -3]]), 1e4)),
    "a top_k above the vocabulary keeps every token (as HF)": lambda: target_tokens_from_logits(
        torch.randn(2, 5), 1.0, top_k=10 ** 12).shape == (2,),
    "validate=False ranks NaN scores as -inf (the decoding loop's own trees)": lambda: int(ops.select_top_w(
        torch.tensor([[NAN, 0.0]]), torch.zeros(1, 2, 1), torch.tensor([2], dtype=I32), 1, validate=False)[0][0, 0]) == 1,
}


@pytest.mark.parametrize("what", sorted(DOCUMENTED))
def test_documented_behaviour(what):
    assert DOCUMENTED[what]()
