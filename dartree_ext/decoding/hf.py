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
