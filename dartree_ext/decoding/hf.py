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


_GROWING = None


def _growing_layer_class():
    """``DynamicLayer`` whose keys and values are the first slots of a buffer with room to grow:
    a step writes its entries in place instead of concatenating (``torch.cat`` copies the whole
    cache, every layer, every step: O(length) a token, about 10% of a SmolLM2-135M step at 140
    cached tokens on a 2-vCPU Xeon). ``keys`` / ``values`` stay views ``buffer[:, :, :length]``, so
    every reader (attention, cropping by slicing, the cache length) sees a plain dynamic cache; a
    layer whose tensors were replaced by others (a batch selection) takes them as its new
    contents at the next update."""
    global _GROWING
    if _GROWING is None:
        from transformers.cache_utils import DynamicLayer

        class GrowingLayer(DynamicLayer):
            # keys / values are the first slots of key_buffer / value_buffer, and update writes
            # the new ones after them (dartree_ext.flat_forward writes them so from C++)
            _dartree_growing = True

            def update(self, key_states, value_states, *args, **kwargs):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                keys, values = self.keys, self.values
                length, new = (keys.shape[-2] if keys.dim() == 4 else 0), key_states.shape[-2]
                kbuf, vbuf = self.__dict__.get("key_buffer"), self.__dict__.get("value_buffer")
                # the views this layer handed out last (the common step) need no inspection; others
                # (a crop's narrower views, replaced tensors) are checked against the buffers
                handed_out = keys is self.__dict__.get("_keys_view") and values is self.__dict__.get("_values_view")
                if not ((handed_out or (_prefix_of(keys, kbuf, key_states) and _prefix_of(values, vbuf, value_states)))
                        and kbuf is not None and length + new <= kbuf.shape[2]):
                    room = length + new + max(64, (length + new) // 4)  # amortized O(1) a slot
                    kbuf, vbuf = (_grown(t, fresh, length, room) for t, fresh in ((keys, key_states),
                                                                                   (values, value_states)))
                    self.key_buffer, self.value_buffer = kbuf, vbuf
                kbuf[:, :, length:length + new].copy_(key_states)
                vbuf[:, :, length:length + new].copy_(value_states)
                self.keys, self.values = kbuf[:, :, :length + new], vbuf[:, :, :length + new]
                self._keys_view, self._values_view = self.keys, self.values
                return self.keys, self.values

            def reset(self) -> None:
                self.key_buffer = self.value_buffer = self._keys_view = self._values_view = None
                super().reset()

        _GROWING = GrowingLayer
    return _GROWING


def _prefix_of(view: torch.Tensor, buffer: torch.Tensor | None, fresh: torch.Tensor) -> bool:
    """Whether ``view`` is ``buffer[:, :, :length]`` and ``fresh`` fits after it."""
    if buffer is None:
        return False
    if view.dim() != 4:  # an empty layer: any buffer of fresh's shape and dtype
        return buffer.dtype == fresh.dtype and buffer.shape[:2] == fresh.shape[:2] and buffer.shape[3] == fresh.shape[3]
    return (view.data_ptr() == buffer.data_ptr() and view.stride() == buffer.stride() and view.dtype == buffer.dtype
            and view.shape[:2] == buffer.shape[:2] == fresh.shape[:2] and view.shape[3] == buffer.shape[3] == fresh.shape[3])


def _grown(current: torch.Tensor, fresh: torch.Tensor, length: int, room: int) -> torch.Tensor:
    b, h, _, d = fresh.shape
    buffer = torch.empty(b, h, room, d, dtype=fresh.dtype, device=fresh.device)
    if length:
        buffer[:, :, :length].copy_(current)
    return buffer


def new_cache(target):
    """A new dynamic cache for ``target`` whose full-attention layers grow in place
    (:func:`_growing_layer_class`); other layer kinds (sliding windows) as transformers makes them."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer
    cache = DynamicCache(config=target.config)
    growing = _growing_layer_class()
    for i, layer in enumerate(getattr(cache, "layers", [])):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            cache.layers[i] = growing()
    return cache


def layer_buffers(layer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A growing layer's buffers ``[B, H, room, D]`` (contiguous) when its keys and values are
    their first slots, else ``None``."""
    kbuf, vbuf = getattr(layer, "key_buffer", None), getattr(layer, "value_buffer", None)
    keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
    if kbuf is None or vbuf is None or keys is None or keys.dim() != 4 or values.dim() != 4:
        return None
    if _prefix_of(keys, kbuf, keys) and _prefix_of(values, vbuf, values):
        return kbuf, vbuf
    return None

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
