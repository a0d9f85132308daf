"""The CUDA kernels of csrc/kernels/, run on the CPU by the test-only emulation layer.

The shared library is built from csrc/emu/emu_ops.cpp with the host C++ compiler (no torch
headers, a few seconds) into python_tests/.emu_build/, keyed by a hash of the sources, and called
through ctypes on CPU tensors. ``EmulatedOps`` mirrors the signatures of ``dartree_ext.ops``.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import shutil
import subprocess
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
BUILD_DIR = pathlib.Path(__file__).resolve().parent / ".emu_build"

_P = ctypes.c_void_p
_I = ctypes.c_int
_SIGNATURES = {
    "emu_set_schedule": [_I, ctypes.c_uint64],
    "emu_block_sum": [_P, _I, _I, _I, _P],
    "emu_warp_primitives": [_P, _I, _P, _P, _P, _P],
    "emu_divergent_barrier": [_P],
    "emu_tree_ancestor_bits": [_P, _P, _I, _I, _P, _P],
    "emu_tree_attention_mask": [_P, _P, _P, _I, _I, _I, _I, ctypes.c_uint64, _P],
    "emu_tree_links": [_P, _P, _I, _I, _P, _P],
    "emu_verify_tree": [_P, _P, _P, _P, _I, _I, _P, _P, _P],
    "emu_select_top_w": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P],
    "emu_select_top_b": [_P, _P, _P, _I, _I, _I, _P, _P, _P],
    "emu_ddtree_heap": [_P, _P, _P, _I, _I, _I, _I, _P, _P, _P, _P, _P],
}


def _source_files() -> list[pathlib.Path]:
    return sorted([*CSRC.glob("emu/*"), *CSRC.glob("kernels/*.cuh")])


def build_library() -> pathlib.Path:
    digest = hashlib.sha256()
    for path in _source_files():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    target = BUILD_DIR / f"dartree_emu_{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    BUILD_DIR.mkdir(exist_ok=True)
    compiler = os.environ.get("CXX") or shutil.which("g++") or "c++"
    with tempfile.NamedTemporaryFile(dir=BUILD_DIR, suffix=".so", delete=False) as tmp:
        partial = pathlib.Path(tmp.name)
    cmd = [compiler, "-O2", "-g", "-std=c++20", "-shared", "-fPIC", "-Wall", "-Wextra", "-Werror",
           "-o", str(partial), str(CSRC / "emu" / "emu_ops.cpp")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building the emulation library failed:\n{' '.join(cmd)}\n{result.stderr}")
    partial.replace(target)  # atomic: a concurrent run never loads a half-written file
    return target


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _words(n: int) -> int:
    return (n + 63) // 64


FORWARD, REVERSE, SHUFFLED = 0, 1, 2


class EmulatedOps:
    """``dartree_ext.ops`` signatures, computed by the emulated CUDA kernels on CPU tensors.

    Threads run in a shuffled order (seeded, re-drawn between barriers) unless ``set_schedule``
    says otherwise: any order is a legal CUDA schedule, and a shuffled one exposes races that a
    fixed order can hide.
    """

    def __init__(self, schedule: int = SHUFFLED, seed: int = 0) -> None:
        self.lib = ctypes.CDLL(str(build_library()))
        for name, argtypes in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.lib.emu_last_error.restype = ctypes.c_char_p
        self.set_schedule(schedule, seed)

    def set_schedule(self, schedule: int, seed: int = 0) -> None:
        self.call("emu_set_schedule", schedule, seed)

    def call(self, name: str, *args) -> None:
        if getattr(self.lib, name)(*args) != 0:
            raise RuntimeError(self.lib.emu_last_error().decode())

    def tree_ancestor_bits(self, parents, num_nodes, *, validate=False):
        batch, n_max = parents.shape
        bits = torch.empty(batch, n_max, _words(n_max), dtype=torch.int64)
        depths = torch.empty(batch, n_max, dtype=torch.int32)
        self.call("emu_tree_ancestor_bits", _ptr(parents), _ptr(num_nodes), batch, n_max, _ptr(bits), _ptr(depths))
        return bits, depths

    def tree_attention_mask(self, parents, num_nodes, past_key_mask, dtype=torch.float32, *, validate=False):
        batch, n_max = parents.shape
        past = past_key_mask.shape[1]
        out = torch.empty(batch, 1, n_max, past + n_max, dtype=dtype)
        lowest = torch.tensor([torch.finfo(dtype).min], dtype=dtype)
        width = lowest.element_size()
        hidden = int.from_bytes(lowest.view(torch.uint8).numpy().tobytes(), "little")
        self.call("emu_tree_attention_mask", _ptr(parents), _ptr(num_nodes), _ptr(past_key_mask), batch, n_max, past,
                  width, hidden, _ptr(out))
        return out

    def tree_links(self, parents, num_nodes, *, validate=False):
        next_token = torch.empty_like(parents)
        next_sibling = torch.empty_like(parents)
        self.call("emu_tree_links", _ptr(parents), _ptr(num_nodes), *parents.shape, _ptr(next_token),
                  _ptr(next_sibling))
        return next_token, next_sibling

    def verify_tree(self, tokens, parents, num_nodes, target_tokens, *, validate=False):
        batch, n_max = parents.shape
        accept_nodes = torch.empty_like(parents)
        accept_len = torch.empty(batch, dtype=torch.int32)
        bonus = torch.empty(batch, dtype=torch.int64)
        self.call("emu_verify_tree", _ptr(tokens), _ptr(parents), _ptr(num_nodes), _ptr(target_tokens), batch, n_max,
                  _ptr(accept_nodes), _ptr(accept_len), _ptr(bonus))
        return accept_nodes, accept_len, bonus

    def select_top_w(self, parent_scores, child_logprobs, num_parents, width, *, validate=False):
        batch, p_max, k = child_logprobs.shape
        parent_idx = torch.empty(batch, width, dtype=torch.int32)
        child_k = torch.empty(batch, width, dtype=torch.int32)
        scores = torch.empty(batch, width, dtype=torch.float32)
        self.call("emu_select_top_w", _ptr(parent_scores), _ptr(child_logprobs), _ptr(num_parents), batch, p_max, k,
                  width, _ptr(parent_idx), _ptr(child_k), _ptr(scores))
        return parent_idx, child_k, scores

    def select_top_b(self, parents, scores, num_nodes, budget, *, validate=False):
        batch, n_max = parents.shape
        keep = torch.empty(batch, budget + 1, dtype=torch.int32)
        new_parents = torch.empty(batch, budget + 1, dtype=torch.int32)
        num_kept = torch.empty(batch, dtype=torch.int32)
        self.call("emu_select_top_b", _ptr(parents), _ptr(scores), _ptr(num_nodes), batch, n_max, budget, _ptr(keep),
                  _ptr(new_parents), _ptr(num_kept))
        return keep, new_parents, num_kept

    def ddtree_heap(self, logprobs, token_ids, root_tokens, budget, *, validate=False):
        batch, depth_max, k = logprobs.shape
        tokens = torch.empty(batch, budget + 1, dtype=torch.int64)
        parents = torch.empty(batch, budget + 1, dtype=torch.int32)
        depths = torch.empty(batch, budget + 1, dtype=torch.int32)
        scores = torch.empty(batch, budget + 1, dtype=torch.float32)
        num_nodes = torch.empty(batch, dtype=torch.int32)
        self.call("emu_ddtree_heap", _ptr(logprobs), _ptr(token_ids), _ptr(root_tokens), batch, depth_max, k, budget,
                  _ptr(tokens), _ptr(parents), _ptr(depths), _ptr(scores), _ptr(num_nodes))
        return tokens, parents, depths, scores, num_nodes
