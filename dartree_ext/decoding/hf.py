"""What the decoding loops need from a transformers model, shared by the eager loop and the
compiled round."""
from __future__ import annotations

import torch


def text_config(target):
    """The text model's config (a multimodal model's ``get_text_config()``)."""
    cfg = target.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where ``visible``, the dtype's minimum elsewhere (HF's additive attention mask; a bool 4D
    mask gives wrong logits with eager attention)."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)


def check_prompts(target, input_ids, attention_mask, max_new_tokens, temperature) -> list[torch.Tensor]:
    """The prompts' token ids (one tensor each, on the target's device), or a ValueError."""
    if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64[B, L], got {input_ids.dtype}{list(input_ids.shape)}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    device = next(target.parameters()).device
    input_ids = input_ids.to(device)
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {list(attention_mask.shape)} must match input_ids {list(input_ids.shape)}")
    attention_mask = attention_mask.to(device).bool()
    prompts = [input_ids[b][attention_mask[b]] for b in range(input_ids.shape[0])]
    if any(p.numel() == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    text = text_config(target)
    max_pos = int(getattr(text, "max_position_embeddings", 0) or 0) or None
    longest = max(p.numel() for p in prompts)
    if max_pos is not None and longest >= max_pos:
        raise ValueError(f"a prompt has {longest} tokens; the target's context is {max_pos} positions")
    vocab = int(text.vocab_size)
    if int(input_ids.max()) >= vocab or int(input_ids.min()) < 0:
        raise ValueError(f"input_ids must be token ids in [0, {vocab})")
    return prompts


def new_cache(target):
    """A new dynamic cache for ``target``."""
    from transformers import DynamicCache
    return DynamicCache(config=target.config)

def cache_length(cache) -> int:
    """Slots in use in a transformers cache (0 before the first forward)."""
    layers = getattr(cache, "layers", None)
    if not layers or getattr(layers[0], "keys", None) is None:
        return 0
    return int(layers[0].keys.shape[2])

def pad_token_id(target) -> int:
    """The id a batch's outputs are padded with: the pad token, else the end of sequence, else 0."""
    for cfg in (getattr(target, "generation_config", None), target.config):
        for name in ("pad_token_id", "eos_token_id"):
            value = getattr(cfg, name, None) if cfg is not None else None
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if value is not None:
                return int(value)
    return 0
