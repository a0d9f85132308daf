"""Tiny HF targets and drafters for decoding tests (no downloads: built from configs)."""
from __future__ import annotations

import torch

from dartree_ext import quant
from dartree_ext.linear import set_linear
from dartree_ext.models import BlockDrafter


def tiny_target(kind: str = "llama", vocab: int = 97, hidden: int = 32, layers: int = 3, seed: int = 0,
                max_positions: int = 512):
    import transformers
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions)
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
    elif kind == "qwen3":
        cfg = transformers.Qwen3Config(head_dim=hidden // 4, **common)
    else:
        raise ValueError(kind)
    model = getattr(transformers, {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "qwen3": "Qwen3ForCausalLM"}[kind])(cfg).eval()
    # make the target peaked enough that greedy decoding has no near-ties
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(4.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def quantized_model(kind: str = "q4_1", seed: int = 0, vocab: int = 97, hidden: int = 64, layers: int = 2,
                    int8: bool = False):
    """A tiny llama whose linear layers (the output head too) are ``kind`` blocks, with its dense
    weights set to the de-quantized values (what a GGUF loader gives), patched with set_linear's
    few_rows and then the blocks."""
    target = tiny_target("llama", vocab=vocab, hidden=hidden, layers=layers, seed=seed)
    found = {}
    with torch.no_grad():
        for name, module in target.named_modules():
            if isinstance(module, torch.nn.Linear):
                blocks = quant.quantize(module.weight, kind)
                module.weight.copy_(quant.dequantize(blocks, kind))
                found[name] = (kind, blocks)
    set_linear(target, "few_rows")
    assert quant.use_quant_linear(target, found, int8=int8) == len(found)
    return target


def tiny_drafter(target, seed: int = 1, **config) -> BlockDrafter:
    torch.manual_seed(seed)
    defaults = dict(block_size=6, head_state_size=16, head_proj_size=16)
    defaults.update(config)
    return BlockDrafter.from_target(target, **defaults).eval()


def greedy_reference(target, prompt: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
    """The target's own greedy continuation (HF generate, one request, no stop token)."""
    out = target.generate(prompt[None], attention_mask=torch.ones(1, prompt.numel(), dtype=torch.long),
                          max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, prompt.numel():]
