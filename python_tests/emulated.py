"""The CUDA kernels of csrc/kernels/, run on the CPU by the test-only emulation layer.

The shared library is built from csrc/emu/emu_ops.cpp with the host C++ compiler (no torch
headers, a few seconds) into python_tests/.emu_build/, keyed by a hash of the sources, and called
through ctypes on CPU tensors. ``EmulatedOps`` mirrors the signatures of ``dartree_ext.ops``.

The instrumented build (``EmulatedOps(instrumented=True)``, or ``DARTREE_EMU_INSTRUMENT=1`` for
the tests' backend) is compiled by clang++ with load/store tracing: every op then registers the
byte ranges of the tensors it passes, a kernel access to global memory outside them is an error,
and ``counting()`` reports the global-memory bytes the kernels read and wrote.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile
from typing import Iterator

import torch

from dartree_ext import ops as _registered_ops
from dartree_ext._widths import depth_widths

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
BUILD_DIR = pathlib.Path(__file__).resolve().parent / ".emu_build"

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "emu_set_schedule": [_I, ctypes.c_uint64],
    "emu_set_global_ranges": [_P, _I],
    "emu_copy_prefix": [_P, _I, _I, _P],
    "emu_block_sum": [_P, _I, _I, _I, _P],
    "emu_warp_primitives": [_P, _I, _P, _P, _P, _P],
    "emu_divergent_barrier": [_P],
    "emu_racy": [_I, _I, _P],
    "emu_exit_then_barrier": [_P],
    "emu_block_order": [_I, _P, _P],
    "emu_exit_then_shuffle": [_P],
    "emu_shared_write": [_I, _I, _I, _P],
    "emu_launch_shape": [ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                         ctypes.c_int64, _P],
    "emu_tree_ancestor_bits": [_P, _P, _I, _I, _P, _P],
    "emu_tree_attention_mask": [_P, _P, _P, _I, _I, _I, _I, ctypes.c_uint64, _P],
    "emu_tree_links": [_P, _P, _I, _I, _P, _P],
    "emu_packed_tree_mask": [_P, _P, _P, _I, _I, ctypes.c_int64, _P],
    "emu_verify_tree": [_P, _P, _P, _P, _I, _I, _P, _P, _P],
    "emu_quant_linear": [_P, _P, _P, _I, _I, _I, _I, ctypes.c_int64, _P],
    "emu_select_top_w": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    "emu_select_top_b": [_P, _P, _P, _I, _I, _I, _P, _P, _P],
    "emu_ddtree_heap": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P],
    "emu_expand_depth": [_P, _P, _P, _P],
    "emu_compact_kv_layers": [_P, _P, _P, _I, _I, _I, ctypes.c_int64, _P, _P, _P, _I],
    "emu_compact_kv_paged": [_P, _P, _I, _I, _I, _I, _P, _I, _P, _P, _P, _I, ctypes.c_int64],
    "emu_build_supertree": [_P, _P],
    "emu_vat_row_forward": [_I, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, ctypes.c_double, _P, _P, _P, _P, _P],
    "emu_vat_row_backward": [_I, _P, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int64, ctypes.c_int64, _P],
    "emu_vat_block_weights": [_P, _P, ctypes.c_int64, _I, _I, ctypes.c_double, _P, _P],
}


def _source_files() -> list[pathlib.Path]:
    return sorted([*CSRC.glob("emu/*"), *CSRC.glob("kernels/*.cuh"), *CSRC.glob("kernels/*.h")])


# clang's SanitizerCoverage load/store tracing: `edge` is needed for the tracing to instrument
# anything; the callbacks are ours (emu_ops.cpp), so no sanitizer runtime is linked.
INSTRUMENT_FLAGS = ["-DDARTREE_EMU_INSTRUMENTED", "-fsanitize-coverage=edge,trace-loads,trace-stores",
                    "-fno-sanitize-link-runtime"]


def instrumenting_compiler() -> str | None:
    """The clang++ the instrumented build needs (``$DARTREE_EMU_CLANG`` or on PATH), or None."""
    return os.environ.get("DARTREE_EMU_CLANG") or shutil.which("clang++")


def build_library(instrumented: bool = False) -> pathlib.Path:
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    flavour = "dartree_emu_instrumented" if instrumented else "dartree_emu"
    target = BUILD_DIR / f"{flavour}_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    BUILD_DIR.mkdir(exist_ok=True)
    if instrumented:
        compiler = instrumenting_compiler()
        if compiler is None:
            raise RuntimeError("the instrumented emulator needs clang++ (apt-get install clang), "
                               "or DARTREE_EMU_CLANG=<path>")
    else:
        compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    with tempfile.NamedTemporaryFile(dir=BUILD_DIR, suffix=".so", delete=False) as tmp:
        partial = pathlib.Path(tmp.name)
    cmd = [compiler, "-O2", "-g", "-std=c++20", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           *(INSTRUMENT_FLAGS if instrumented else []), "-o", str(partial), str(CSRC / "emu" / "emu_ops.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the emulation library failed:\n{' '.join(cmd)}\n{result.stderr}")
    partial.replace(target)  # atomic: a concurrent run never loads a half-written file
    return target


def _words(n: int) -> int:
    return (n + 63) // 64


def byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes [begin, end) a tensor's elements occupy (strided views included)."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


FORWARD, REVERSE, SHUFFLED = 0, 1, 2


@dataclasses.dataclass
class GlobalTraffic:
    """Global-memory traffic of the emulated launches in a ``counting()`` block: bytes the kernels'
    loads and stores moved (every access counted, no cache model) and launches, in total and per
    kernel name (``{name: (launches, read_bytes, write_bytes)}``)."""
    read_bytes: int = 0
    write_bytes: int = 0
    launches: int = 0
    per_kernel: dict[str, tuple[int, int, int]] = dataclasses.field(default_factory=dict)

    @property
    def bytes(self) -> int:
        return self.read_bytes + self.write_bytes


class EmulatedOps:
    """``dartree_ext.ops`` signatures, computed by the emulated CUDA kernels on CPU tensors.

    Threads run in a shuffled order (seeded, re-drawn between barriers) unless ``set_schedule``
    says otherwise: any order is a legal CUDA schedule, and a shuffled one exposes races that a
    fixed order can hide. ``instrumented`` (default: ``$DARTREE_EMU_INSTRUMENT == "1"``) loads the
    clang-instrumented build: global accesses outside the tensors an op passes are errors, and
    ``counting()`` measures global-memory bytes.
    """

    def __init__(self, schedule: int = SHUFFLED, seed: int = 0, instrumented: bool | None = None) -> None:
        if instrumented is None:
            instrumented = os.environ.get("DARTREE_EMU_INSTRUMENT") == "1"
        self.instrumented = instrumented
        self._ranges: list[tuple[int, int]] = []  # the tensors of the op being prepared
        self.lib = ctypes.CDLL(str(build_library(instrumented)))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.lib.emu_kernel_traffic.restype = ctypes.c_char_p
        self.lib.emu_reset_kernel_traffic.restype = None
        self.lib.emu_instrumented.restype = ctypes.c_int
        self.lib.emu_set_race_detection.restype = None
        self.lib.emu_set_race_detection.argtypes = [_I]
        if bool(self.lib.emu_instrumented()) != instrumented:
            raise RuntimeError("the emulation library's build does not match `instrumented`")
        self.lib.emu_struct_sizes.restype = ctypes.c_size_t
        self.lib.emu_struct_sizes.argtypes = [_I]
        for which, mirror in enumerate((HeadWeightPtrs, ExpandInputs, ExpandOutputs, SupertreeArgs)):
            if self.lib.emu_struct_sizes(which) != ctypes.sizeof(mirror):
                raise RuntimeError(f"ctypes mirror {mirror.__name__} does not match csrc/kernels/launchers.h")
        self.set_schedule(schedule, seed)

    def set_race_detection(self, on: bool) -> None:
        """The instrumented build's data-race detection (on by default): two threads touching a
        byte, one of them writing, with no barrier between them is an error."""
        self.lib.emu_set_race_detection(int(on))

    def set_schedule(self, schedule: int, seed: int = 0) -> None:
        self.call("emu_set_schedule", schedule, seed)

    def _ptr(self, t: torch.Tensor) -> ctypes.c_void_p:
        """``t``'s data pointer, its bytes registered as global memory the next ``call`` may touch."""
        return ctypes.c_void_p(self._addr(t))

    def _addr(self, t: torch.Tensor) -> int:
        self._ranges.append(byte_range(t))
        return t.data_ptr()

    def call(self, name: str, *args, ranges: list[tuple[int, int]] | None = None) -> None:
        """Runs entry point ``name``. The instrumented build checks every global access against
        ``ranges`` (byte ranges [begin, end)) plus the tensors registered through ``_ptr``/``_addr``
        since the last call; with neither, nothing is checked (the raw self-tests' calls)."""
        pending, self._ranges = self._ranges + list(ranges or []), []
        checked = self.instrumented and bool(pending)
        if checked:
            pairs = (ctypes.c_uint64 * (2 * len(pending)))(*[a for r in pending for a in r])
            self._check(self.lib.emu_set_global_ranges(ctypes.cast(pairs, _P), len(pending)))
        try:
            self._check(getattr(self.lib, name)(*args))
        finally:
            if checked:
                self._check(self.lib.emu_set_global_ranges(None, -1))

    def _check(self, status: int) -> None:
        if status != 0:
            raise RuntimeError(self.lib.emu_last_error().decode())

    def kernel_traffic(self) -> dict[str, tuple[int, int, int]]:
        """Every emulated launch so far: ``{kernel: (launches, read_bytes, write_bytes)}``."""
        traffic = {}
        for line in self.lib.emu_kernel_traffic().decode().splitlines():
            name, *counts = line.rsplit(" ", 3)
            traffic[name] = tuple(int(c) for c in counts)
        return traffic

    def reset_kernel_traffic(self) -> None:
        self.lib.emu_reset_kernel_traffic()

    @contextlib.contextmanager
    def counting(self) -> Iterator[GlobalTraffic]:
        """Counts the launches and global-memory bytes of the emulated kernels run inside the block;
        the yielded ``GlobalTraffic`` is filled when the block ends. Bytes need the instrumented build."""
        if not self.instrumented:
            raise RuntimeError("counting global-memory bytes needs EmulatedOps(instrumented=True) (clang++)")
        before = self.kernel_traffic()
        traffic = GlobalTraffic()
        try:
            yield traffic
        finally:
            for name, counts in self.kernel_traffic().items():
                old = before.get(name, (0, 0, 0))
                delta = tuple(c - o for c, o in zip(counts, old))
                if delta[0] > 0:
                    traffic.per_kernel[name] = delta
                    traffic.launches += delta[0]
                    traffic.read_bytes += delta[1]
                    traffic.write_bytes += delta[2]

    def tree_ancestor_bits(self, parents, num_nodes, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("tree_ancestor_bits", parents, num_nodes)
        batch, n_max = parents.shape
        bits = torch.empty(batch, n_max, _words(n_max), dtype=torch.int64)
        depths = torch.empty(batch, n_max, dtype=torch.int32)
        self.call("emu_tree_ancestor_bits", self._ptr(parents), self._ptr(num_nodes), batch, n_max,
                  self._ptr(bits), self._ptr(depths))
        return bits, depths

    def tree_attention_mask(self, parents, num_nodes, past_key_mask, dtype=torch.float32, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("tree_attention_mask", parents, num_nodes, past_key_mask)
        batch, n_max = parents.shape
        past = past_key_mask.shape[1]
        out = torch.empty(batch, 1, n_max, past + n_max, dtype=dtype)
        lowest = torch.tensor([torch.finfo(dtype).min], dtype=dtype)
        width = lowest.element_size()
        hidden = int.from_bytes(lowest.view(torch.uint8).numpy().tobytes(), "little")
        self.call("emu_tree_attention_mask", self._ptr(parents), self._ptr(num_nodes), self._ptr(past_key_mask),
                  batch, n_max, past, width, hidden, self._ptr(out))
        return out

    def tree_links(self, parents, num_nodes, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("tree_links", parents, num_nodes)
        next_token = torch.empty_like(parents)
        next_sibling = torch.empty_like(parents)
        self.call("emu_tree_links", self._ptr(parents), self._ptr(num_nodes), *parents.shape, self._ptr(next_token),
                  self._ptr(next_sibling))
        return next_token, next_sibling

    def packed_tree_mask(self, bits, seq_lens, mask_indptr, total_bytes):
        out = torch.zeros(total_bytes, dtype=torch.uint8)
        self.call("emu_packed_tree_mask", self._ptr(bits), self._ptr(seq_lens), self._ptr(mask_indptr),
                  bits.shape[0], bits.shape[1], total_bytes, self._ptr(out))
        return out

    def verify_tree(self, tokens, parents, num_nodes, target_tokens, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("verify_tree", tokens, parents, num_nodes, target_tokens)
        batch, n_max = parents.shape
        accept_nodes = torch.empty_like(parents)
        accept_len = torch.empty(batch, dtype=torch.int32)
        bonus = torch.empty(batch, dtype=torch.int64)
        self.call("emu_verify_tree", self._ptr(tokens), self._ptr(parents), self._ptr(num_nodes),
                  self._ptr(target_tokens), batch, n_max, self._ptr(accept_nodes), self._ptr(accept_len),
                  self._ptr(bonus))
        return accept_nodes, accept_len, bonus

    def quant_linear(self, x, blocks, kind, bias=None):
        """The CUDA kernel's arithmetic on CPU tensors (float32 staging, as the CUDA op)."""
        kinds = {"q4_0": (0, 18), "q4_1": (1, 20), "q8_0": (2, 34)}
        code, size = kinds[kind]
        rows, k = x.numel() // x.shape[-1], x.shape[-1]
        out_features = blocks.shape[0]
        x32 = x.reshape(rows, k).float().contiguous()
        b32 = None if bias is None else bias.float().contiguous()
        y = torch.empty(rows, out_features, dtype=torch.float32)
        assert blocks.shape[1] // size * 32 == k
        self.call("emu_quant_linear", self._ptr(x32), self._ptr(blocks), None if b32 is None else self._ptr(b32), code,
                  rows, k, out_features, blocks.shape[1], self._ptr(y))
        return y.to(x.dtype).reshape(*x.shape[:-1], out_features)

    def select_top_w(self, parent_scores, child_logprobs, num_parents, width, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("select_top_w", parent_scores, child_logprobs, num_parents, width)
        batch, p_max, k = child_logprobs.shape
        parent_idx = torch.empty(batch, width, dtype=torch.int32)
        child_k = torch.empty(batch, width, dtype=torch.int32)
        scores = torch.empty(batch, width, dtype=torch.float32)
        self.call("emu_select_top_w", self._ptr(parent_scores), self._ptr(child_logprobs), self._ptr(num_parents),
                  batch, p_max, k, width, self._ptr(parent_idx), self._ptr(child_k), self._ptr(scores))
        return parent_idx, child_k, scores

    def select_top_b(self, parents, scores, num_nodes, budget, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("select_top_b", parents, scores, num_nodes, budget)
        batch, n_max = parents.shape
        keep = torch.empty(batch, budget + 1, dtype=torch.int32)
        new_parents = torch.empty(batch, budget + 1, dtype=torch.int32)
        num_kept = torch.empty(batch, dtype=torch.int32)
        self.call("emu_select_top_b", self._ptr(parents), self._ptr(scores), self._ptr(num_nodes), batch, n_max,
                  budget, self._ptr(keep), self._ptr(new_parents), self._ptr(num_kept))
        return keep, new_parents, num_kept

    def ddtree_heap(self, logprobs, token_ids, root_tokens, budget, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("ddtree_heap", logprobs, token_ids, root_tokens, budget)
        batch, depth_max, k = logprobs.shape
        tokens = torch.empty(batch, budget + 1, dtype=torch.int64)
        parents = torch.empty(batch, budget + 1, dtype=torch.int32)
        depths = torch.empty(batch, budget + 1, dtype=torch.int32)
        scores = torch.empty(batch, budget + 1, dtype=torch.float32)
        num_nodes = torch.empty(batch, dtype=torch.int32)
        self.call("emu_ddtree_heap", self._ptr(logprobs), self._ptr(token_ids), self._ptr(root_tokens), batch,
                  depth_max, k, budget, self._ptr(tokens), self._ptr(parents), self._ptr(depths),
                  self._ptr(scores), self._ptr(num_nodes))
        return tokens, parents, depths, scores, num_nodes

    def compact_kv_(self, keys, values, src_positions, dst_start, lengths):
        self.compact_kv_layers_([keys, values], src_positions, dst_start, lengths)

    def compact_kv_layers_(self, caches, src_positions, dst_start, lengths):
        row_bytes = [c.shape[3] * c.element_size() for c in caches]
        unit = next(u for u in (8, 4, 2, 1) if all(r % u == 0 and c.data_ptr() % u == 0
                                                    for r, c in zip(row_bytes, caches)))
        for first in range(0, len(caches), 64):  # kMaxKvLayerCaches per launch, as the CUDA op
            group = caches[first:first + 64]
            bases = (ctypes.c_void_p * len(group))(*[self._addr(c) for c in group])
            units = torch.tensor([r // unit for r in row_bytes[first:first + 64]], dtype=torch.int64)
            heads = torch.tensor([c.shape[1] for c in group], dtype=torch.int32)
            self.call("emu_compact_kv_layers", ctypes.cast(bases, ctypes.c_void_p), self._ptr(units), self._ptr(heads),
                      len(group), unit, src_positions.shape[0], caches[0].shape[2], self._ptr(src_positions),
                      self._ptr(dst_start), self._ptr(lengths), src_positions.shape[1])

    def compact_kv_paged_(self, caches, block_table, src_positions, dst_start, lengths, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("compact_kv_paged_", caches, block_table, src_positions, dst_start, lengths)
        slots = caches[0].shape[0] * caches[0].shape[1]
        row_bytes = [c.numel() // max(1, slots) * c.element_size() for c in caches]
        unit = 4 if all(r % 4 == 0 for r in row_bytes) else 2 if all(r % 2 == 0 for r in row_bytes) else 1
        bases = (ctypes.c_void_p * len(caches))(*[self._addr(c) for c in caches])
        units = torch.tensor([r // unit for r in row_bytes], dtype=torch.int64)
        self.call("emu_compact_kv_paged", ctypes.cast(bases, ctypes.c_void_p), self._ptr(units), len(caches), unit,
                  block_table.shape[0], caches[0].shape[1], self._ptr(block_table), block_table.shape[1],
                  self._ptr(src_positions), self._ptr(dst_start), self._ptr(lengths), src_positions.shape[1],
                  caches[0].shape[0])

    # vat area: the raw kernels (EmulatedVatKernels), composed by dartree_ext.vat like the real ops
    def vat_row_forward(self, draft, target, tokens, uniforms, temperature):
        rows = draft.shape[0]
        stat = torch.float64 if draft.dtype == torch.float64 else torch.float32
        ce_soft, ce_hard, draft_lse, target_lse = (torch.empty(rows, dtype=stat) for _ in range(4))
        accept = torch.empty(rows, dtype=torch.float32)
        self.call("emu_vat_row_forward", _ELEM_TYPES[draft.dtype], self._ptr(draft), self._ptr(target),
                  self._ptr(tokens), None if uniforms is None else self._ptr(uniforms), rows, draft.shape[1],
                  temperature, self._ptr(ce_soft), self._ptr(ce_hard), self._ptr(draft_lse), self._ptr(target_lse),
                  self._ptr(accept))
        return ce_soft, ce_hard, accept, draft_lse, target_lse

    def vat_row_backward(self, g_q, g_p, g_y, draft, target, tokens, draft_lse, target_lse):
        grad = torch.empty_like(draft)
        self.call("emu_vat_row_backward", _ELEM_TYPES[draft.dtype], self._ptr(draft), self._ptr(target),
                  self._ptr(tokens), self._ptr(draft_lse), self._ptr(target_lse), self._ptr(g_q), self._ptr(g_p),
                  self._ptr(g_y), draft.shape[0], draft.shape[1], self._ptr(grad))
        return grad

    def vat_block_weights(self, accept, valid, schedule, decay_gamma):
        blocks, k = accept.shape
        first_reject = torch.empty(blocks, dtype=torch.int32)
        weights = torch.empty(blocks, k, dtype=torch.float32)
        self.call("emu_vat_block_weights", self._ptr(accept), self._ptr(valid), blocks, k, schedule, decay_gamma,
                  self._ptr(first_reject), self._ptr(weights))
        return first_reject, weights

    def vat_loss(self, *args, **kwargs):
        from dartree_ext import vat
        kwargs = {**_VAT_DEFAULTS, **kwargs}
        return vat._vat_loss(EmulatedVatKernels(self), *args, **kwargs)

    def vat_loss_linear(self, *args, **kwargs):
        from dartree_ext import vat
        kwargs = {**_VAT_DEFAULTS, "chunk_size": None, **kwargs}
        return vat._vat_loss_linear(EmulatedVatKernels(self), *args, **kwargs)

    # expand area: the launchers take structs; these mirrors must match csrc/kernels/launchers.h
    def expand_depth(self, head, z, cand_ids, cand_base, parent_states, parent_scores, num_parents, width,
                     depth_bonus=-0.2, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("expand_depth", head, z, cand_ids, cand_base, parent_states, parent_scores,
                                            num_parents, width)
        w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh = (head.w_s, head.fc2_weight, head.fc2_bias, head.gru_table,
                                                            head.w_hh, head.b_hh)
        batch, k = cand_ids.shape
        p_max, g = parent_states.shape[1], w_s.shape[1]
        head = _head_weight_ptrs(w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh, self._addr)
        inputs = ExpandInputs(self._addr(z), z.shape[1], self._addr(cand_ids), self._addr(cand_base), k,
                              self._addr(parent_states), self._addr(parent_scores), p_max, self._addr(num_parents),
                              batch, p_max, k, width, depth_bonus)
        parent_idx = torch.empty(batch, width, dtype=torch.int32)
        child_k = torch.empty(batch, width, dtype=torch.int32)
        scores = torch.empty(batch, width, dtype=torch.float32)
        tokens = torch.empty(batch, width, dtype=torch.int64)
        states = torch.empty(batch, width, g, dtype=torch.float32)
        num_children = torch.empty(batch, dtype=torch.int32)
        workspace = torch.empty(_expand_workspace_floats(batch, p_max, k, width, w_s.shape[0], g))
        outputs = ExpandOutputs(self._addr(parent_idx), self._addr(child_k), self._addr(scores), self._addr(tokens),
                                None, width, 0, 0, self._addr(states), self._addr(num_children))
        self.call("emu_expand_depth", ctypes.addressof(head), ctypes.addressof(inputs), self._ptr(workspace),
                  ctypes.addressof(outputs))
        return parent_idx, child_k, scores, tokens, states

    def build_supertree(self, head, z, cand_ids, cand_base, root_state, width, depth_bonus=-0.2, *, validate=False):
        if validate:
            _registered_ops.validate_inputs("build_supertree", head, z, cand_ids, cand_base, root_state, width)
        w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh = (head.w_s, head.fc2_weight, head.fc2_bias, head.gru_table,
                                                            head.w_hh, head.b_hh)
        batch, depth, k = cand_ids.shape
        widths = depth_widths(width, depth, exact=True)
        g = w_s.shape[1]
        total, max_width = sum(widths), max(widths)
        head = _head_weight_ptrs(w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh, self._addr)
        width_array = (ctypes.c_int64 * depth)(*widths)
        states = [torch.empty(batch, max_width, g), torch.empty(batch, max_width, g)]
        states[0].view(-1)[: batch * g] = root_state.float().reshape(-1)  # dense [B, 1, G]
        counts = [torch.ones(batch, dtype=torch.int32), torch.empty(batch, dtype=torch.int32)]
        root_scores = torch.zeros(batch)
        workspace = torch.empty(_expand_workspace_floats(batch, max_width, k, max_width, w_s.shape[0], g))
        tokens = torch.empty(batch, total, dtype=torch.int64)
        parents = torch.empty(batch, total, dtype=torch.int32)
        depths = torch.empty(batch, total, dtype=torch.int32)
        scores = torch.empty(batch, total)
        args = SupertreeArgs(self._addr(z), self._addr(cand_ids), self._addr(cand_base), width_array, batch,
                             depth, k, depth_bonus, self._addr(workspace),
                             (ctypes.c_void_p * 2)(*[self._addr(s) for s in states]), self._addr(root_scores),
                             (ctypes.c_void_p * 2)(*[self._addr(c) for c in counts]), self._addr(tokens),
                             self._addr(parents), self._addr(depths), self._addr(scores))
        self.call("emu_build_supertree", ctypes.addressof(head), ctypes.addressof(args))
        return tokens, parents, depths, scores


# csrc/kernels/elem_type.h's ElemType; the expand launchers take the first three, the VAT ones all four
_ELEM_TYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
_VAT_DEFAULTS = dict(rule="greedy", temperature=1.0, schedule="vat", decay_gamma=7.0, vh_weight=1.0, generator=None,
                     check_finite=True)


class EmulatedVatKernels:
    """The ``kernels`` object dartree_ext.vat composes, on the emulated CUDA kernels (CPU tensors);
    autograd of the row kernel through dartree_ext.vat.RowForwardFunction."""

    def __init__(self, emu: "EmulatedOps") -> None:
        self.row_forward = emu.vat_row_forward
        self.row_backward = emu.vat_row_backward
        self.block_weights = emu.vat_block_weights

    def row_forward_differentiable(self, draft, target, tokens, uniforms, temperature):
        from dartree_ext.vat import RowForwardFunction
        return RowForwardFunction.apply(self, draft, target, tokens, uniforms, temperature)


_HEAD_ELEM_TYPES = {dtype: code for dtype, code in _ELEM_TYPES.items() if dtype != torch.float64}


class HeadWeightPtrs(ctypes.Structure):
    _fields_ = [("dtype", ctypes.c_int), ("w_s", _P), ("fc2_weight", _P), ("fc2_bias", _P), ("gru_table", _P),
                ("w_hh", _P), ("b_hh", _P), ("e", _I), ("g", _I), ("v", ctypes.c_int64)]


class ExpandInputs(ctypes.Structure):
    _fields_ = [("z", _P), ("z_stride", ctypes.c_int64), ("cand_ids", _P), ("cand_base", _P),
                ("cand_stride", ctypes.c_int64), ("parent_states", _P), ("parent_scores", _P),
                ("parent_score_stride", ctypes.c_int64), ("num_parents", _P), ("batch", _I), ("p_max", _I), ("k", _I),
                ("width", _I), ("depth_bonus", ctypes.c_float)]


class ExpandOutputs(ctypes.Structure):
    _fields_ = [("parent_idx", _P), ("child_k", _P), ("scores", _P), ("tokens", _P), ("depths", _P),
                ("stride", ctypes.c_int64), ("parent_offset", _I), ("depth_value", _I), ("child_states", _P),
                ("num_children", _P)]


class SupertreeArgs(ctypes.Structure):
    _fields_ = [("z", _P), ("cand_ids", _P), ("cand_base", _P), ("widths", ctypes.POINTER(ctypes.c_int64)),
                ("batch", _I), ("depth", _I), ("k", _I), ("depth_bonus", ctypes.c_float), ("workspace", _P),
                ("states", _P * 2), ("root_scores", _P), ("counts", _P * 2), ("tokens", _P), ("parents", _P),
                ("depths", _P), ("scores", _P)]


def _expand_workspace_floats(batch, p_max, k, width, e, g) -> int:
    """csrc/kernels/launchers.h's expand_workspace_floats: candidate scores, hidden vectors, child states."""
    return batch * (p_max * k + p_max * e + width * g)


def _head_weight_ptrs(w_s, fc2_weight, fc2_bias, gru_table, w_hh, b_hh, addr) -> HeadWeightPtrs:
    def ptr(t):
        return None if t is None else addr(t)
    return HeadWeightPtrs(_HEAD_ELEM_TYPES[w_s.dtype], addr(w_s), addr(fc2_weight), ptr(fc2_bias),
                          addr(gru_table), addr(w_hh), ptr(b_hh), w_s.shape[0], w_s.shape[1],
                          fc2_weight.shape[0])
