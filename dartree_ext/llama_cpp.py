"""Plain greedy decoding with llama.cpp (``llama-cpp-python``) on a GGUF: the baseline a CPU user
measures first. Same prompt token ids, same thread count, no sampling (T = 0, no repetition
penalty), stopping at the same stop tokens as the library's decoders.

    from dartree_ext.llama_cpp import LlamaCppBaseline
    base = LlamaCppBaseline()                       # the shipped SmolLM2 GGUF (Q4_1), torch's threads
    run = base.generate(ids, max_new_tokens=64, stops=[2])
    run.tokens, run.first_s, run.total_s            # prefill + first token, then the rest

``pip install llama-cpp-python diskcache`` (the ``llama`` extra; it compiles llama.cpp from source,
several minutes on 2 cores). llama.cpp multiplies the Q4_1 weights against activations it
quantizes to 8 bits, so its tokens can differ from the library's (which de-quantizes the same
weights exactly); the benchmarks report where they first differ.
"""
from __future__ import annotations

import dataclasses
import time

import torch


def available() -> bool:
    """Whether ``llama_cpp`` imports here."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


@dataclasses.dataclass
class LlamaCppRun:
    tokens: list[int]  # the new tokens, up to and including the first stop token
    first_s: float     # prefill and the first new token
    total_s: float     # the whole call

    @property
    def decode_ms_per_token(self) -> float:
        """Time per token past the first (prefill left out, as the library's e2e rows do)."""
        return 1e3 * (self.total_s - self.first_s) / max(1, len(self.tokens) - 1)

    @property
    def ms_per_token(self) -> float:
        """Time per new token, prefill included (as ``dartree-generate`` reports its own)."""
        return 1e3 * self.total_s / max(1, len(self.tokens))


class LlamaCppBaseline:
    """One llama.cpp model, loaded once; :meth:`generate` decodes greedily."""

    def __init__(self, path: str | None = None, threads: int | None = None, n_ctx: int = 4096) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as error:
            raise ImportError("the llama.cpp baseline needs llama-cpp-python: "
                              "pip install llama-cpp-python diskcache") from error
        if path is None:
            from .data.smollm2 import gguf_file
            path = gguf_file()
        self.path = path
        self.threads = threads or torch.get_num_threads()
        self.llm = Llama(model_path=path, n_threads=self.threads, n_threads_batch=self.threads, n_ctx=n_ctx,
                         verbose=False)

    def generate(self, ids: list[int], max_new_tokens: int, stops=()) -> LlamaCppRun:
        """Greedy decoding of ``ids`` (the prompt, with its chat template applied) for up to
        ``max_new_tokens`` tokens, stopping after the first of ``stops``; the prompt is evaluated
        afresh (no prefix reuse from an earlier call)."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        stops = set(stops)
        self.llm.reset()
        out: list[int] = []
        first = None
        start = time.perf_counter()
        for token in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            out.append(int(token))
            if first is None:
                first = time.perf_counter()
            if token in stops or len(out) >= max_new_tokens:
                break
        end = time.perf_counter()
        return LlamaCppRun(out, (first or end) - start, end - start)
