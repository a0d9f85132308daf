"""An EAGLE-3-style autoregressive drafter with a verification head.

Inputs per position: the target's low, middle and high layer hidden states, fused by one linear
layer into the drafter's width, and the (frozen, shared) target embedding of the *next* token.
One decoder layer reads ``[embed_norm(e), hidden_norm(h)]`` (width 2H) for its queries, keys
and values and keeps ``h`` as its residual; its output, through the drafter's own norm and the
target's LM head (or a reduced draft vocabulary), gives the token after that next token. The
output (before the norm) is also the hidden input of the following drafting step, so the
drafter draws ``num_steps`` tokens autoregressively on its own hidden states.

Indexing (training and decoding agree): *index* ``r`` of a sequence ``x`` embeds token ``x[r]``
and carries hidden ``h[r]`` = the fused target features of ``x[r - 1]`` (zeros for ``r = 0``),
at rotary position ``r - 1``; its output predicts ``x[r + 1]``. Step ``k > 1`` at index ``i``
takes as hidden the step ``k - 1`` output at index ``i - 1`` and attends to the step-1 keys at
indices ``1 .. i - k + 1`` and to the step-``m`` key at index ``i - k + m`` for ``m = 2..k`` (its
own draft path): the training-time test, exactly what decoding computes from a root at index
``i - k + 1`` (a decoder's committed slot ``j`` is index ``j + 1``, so index 0, which has no
features, is a key only for a root at index 0, i.e. a prompt of one token).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn

from .drafter import AttentionMLPLayer, DrafterConfigBase, RMSNorm, TargetAttached, VerificationHead, _rope, _target_sizes, check_draft_vocab

EAGLE3_CONFIG_NAME = "eagle3_drafter.json"
EAGLE3_DECAY_GAMMA = 1.0 / math.log(1.25)   # exp(-(k - 1) / gamma) = 0.8 ** (k - 1): EAGLE-3's step weights
MIN_TARGET_LAYERS = 4


def eagle3_target_layers(num_target_layers: int) -> tuple[int, int, int]:
    """Low, middle and high layer indices into HF ``hidden_states`` (``i`` = output of layer ``i``;
    the last entry, already normalised for the LM head, is not used): ``(1 or 2, L // 2, L - 1)``."""
    if num_target_layers < MIN_TARGET_LAYERS:
        raise ValueError(f"an EAGLE-3 drafter fuses three distinct intermediate target layers (low, middle, high): "
                         f"the target needs at least {MIN_TARGET_LAYERS} layers, it has {num_target_layers} "
                         f"(or pass target_layer_ids)")
    low = 2 if num_target_layers >= 8 else 1
    return low, num_target_layers // 2, num_target_layers - 1


@dataclasses.dataclass
class Eagle3DrafterConfig(DrafterConfigBase):
    """Sizes of an EAGLE-3 drafter and of the target it was built for."""

    vocab_size: int
    hidden_size: int                       # = the target's (shared embedding and LM head)
    target_num_layers: int
    target_layer_ids: tuple[int, ...]      # three indices into the target's hidden_states
    num_steps: int = 7                     # K: tokens drafted autoregressively (training unroll, tree depth)
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None            # default hidden_size // num_heads
    intermediate_size: int | None = None   # default 2 * hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    target_model_type: str = ""

    def __post_init__(self) -> None:
        self._check_common()
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if len(self.target_layer_ids) != 3 or self._bad_layer_ids():
            raise ValueError(f"target_layer_ids must be three indices (low, middle, high) into the target's "
                             f"hidden_states (0..{self.target_num_layers}), got {self.target_layer_ids}")

    @property
    def block_size(self) -> int:
        """Root + drafted positions per training block (what the block sampler and target pass read)."""
        return self.num_steps + 1

    @property
    def draft_depth(self) -> int:
        return self.num_steps


class Eagle3Layer(AttentionMLPLayer):
    """Pre-norm decoder layer over ``[embed_norm(e), hidden_norm(h)]`` with residual ``h``;
    causal structure comes from the caller's mask."""

    def __init__(self, cfg: Eagle3DrafterConfig) -> None:
        super().__init__(cfg, 2 * cfg.hidden_size)
        self.embed_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attn_input(self, hidden: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.embed_norm(emb), self.hidden_norm(hidden)], -1)

    def kv(self, hidden: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values ``[B, kv_heads, T, head_dim]`` of inputs ``[B, T, H]`` each."""
        return self._kv(self.attn_input(hidden, emb), positions)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        k = _rope(self._heads(self.k_proj(x), cfg.num_kv_heads), positions, cfg.rope_theta)
        return k, self._heads(self.v_proj(x), cfg.num_kv_heads)

    def forward(self, hidden: torch.Tensor, emb: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor,
                past_v: torch.Tensor, visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries at ``hidden, emb [B, T, H]``, ``positions int64[B, T]``; keys = ``past_k/past_v
        [B, kv_heads, P, head_dim]`` followed by the queries' own; ``visible bool[B, T, P + T]``.
        Returns the output hidden states ``[B, T, H]`` and the queries' keys and values."""
        cfg = self.cfg
        x = self.attn_input(hidden, emb)
        q = _rope(self._heads(self.q_proj(x), cfg.num_heads), positions, cfg.rope_theta)
        k, v = self._kv(x, positions)
        keys, values = torch.cat([past_k.to(k.dtype), k], 2), torch.cat([past_v.to(v.dtype), v], 2)
        return self.attend(hidden, q, keys, values, visible[:, None]), k, v


def ttt_masks(length: int, steps: int, device: torch.device) -> list[torch.Tensor]:
    """Per step ``k = 1..steps``, ``bool[T, k * T]``: which keys (step 1's ``T``, then step 2's, ...)
    a step-``k`` query at index ``i`` sees: step-1 keys at ``1 .. i - k + 1`` (index 0 only when
    ``i - k + 1 = 0``), the step-``m`` key at ``i - k + m`` (``m = 2..k``)."""
    idx = torch.arange(length, device=device)
    masks = []
    for k in range(1, steps + 1):
        root = idx[:, None] - k + 1
        parts = [(idx[None, :] <= root) & ((idx[None, :] >= 1) | (root == 0))]
        parts += [idx[None, :] == idx[:, None] - k + m for m in range(2, k + 1)]
        masks.append(torch.cat(parts, 1))
    return masks


class Eagle3Drafter(TargetAttached, nn.Module):
    """EAGLE-3-style drafter (module docstring) with a verification head on its normed hidden
    states ("this step and all before it are accepted")."""

    _kind = "EAGLE-3 drafter"
    _config_name, _config_class = EAGLE3_CONFIG_NAME, Eagle3DrafterConfig

    def __init__(self, cfg: Eagle3DrafterConfig, target: nn.Module | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.fuse = nn.Linear(3 * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.verification_head = VerificationHead(cfg)
        self._target_modules: tuple[nn.Module, nn.Module] | None = None
        self.draft_vocab: torch.Tensor | None = None
        self._draft_head: tuple | None = None
        self.calibration: dict[str, dict] = {}
        if target is not None:
            self.attach(target)

    # target --------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, **config: Any) -> "Eagle3Drafter":
        """A freshly initialised drafter sized for the HF causal LM ``target`` (keyword arguments
        override :class:`Eagle3DrafterConfig` fields). A target with fewer than 4 layers (without
        explicit ``target_layer_ids``) or a ``hidden_size`` other than the target's is a ``ValueError``."""
        vocab, hidden, layers, model_type = _target_sizes(target)
        if config.get("hidden_size", hidden) != hidden:
            raise ValueError(f"an EAGLE-3 drafter's width must equal the target's hidden size {hidden} (it reads the "
                             f"target's embedding and LM head), got hidden_size={config['hidden_size']}")
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        defaults = dict(vocab_size=vocab, hidden_size=hidden, target_num_layers=layers, target_model_type=model_type,
                        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)))
        if "target_layer_ids" not in config:
            defaults["target_layer_ids"] = eagle3_target_layers(layers)
        rope = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
        if rope:
            defaults["rope_theta"] = float(rope)
        heads = int(getattr(text, "num_attention_heads", 4))
        if hidden % heads == 0:
            kv = int(getattr(text, "num_key_value_heads", heads) or heads)
            defaults.update(num_heads=heads, num_kv_heads=kv if heads % kv == 0 else heads)
        defaults.update(config)
        drafter = cls(Eagle3DrafterConfig(**defaults), target)
        return drafter.to(device=next(target.parameters()).device)

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    def set_draft_vocab(self, ids) -> "Eagle3Drafter":
        """Draft over these target token ids only (d2t); ``None`` restores the full vocabulary."""
        self.draft_vocab = None if ids is None else check_draft_vocab(ids, self.config.vocab_size)
        self._draft_head = None
        return self

    # inputs ---------------------------------------------------------------------------------
    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The low / middle / high target hidden states, concatenated: ``[B, T, 3H]``."""
        return torch.cat([hidden_states[i] for i in self.config.target_layer_ids], -1)

    def fuse_features(self, features: torch.Tensor) -> torch.Tensor:
        """The drafter's hidden input ``[B, T, H]`` from :meth:`target_features`."""
        return self.fuse(features.to(self.dtype))

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embedding(tokens).to(self.dtype)

    def project_context(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """A decoder's context vector per committed slot: ``[fused features, embedding of the
        slot's next token]`` (``[B, T, 2H]``; slot ``j`` is index ``j + 1``)."""
        return torch.cat([self.fuse_features(features), self.embed(next_tokens)], -1)

    def empty_context(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, 0, 2 * self.config.hidden_size, dtype=self.dtype, device=self.fuse.weight.device)

    def context_kv(self, context: torch.Tensor, context_positions: torch.Tensor) -> list[torch.Tensor]:
        """Keys and values of context vectors (:meth:`project_context`) at ``context_positions``:
        a one-element list of ``[B, S, 2, kv_heads, head_dim]`` (the decoder keeps it per slot)."""
        h = self.config.hidden_size
        k, v = self.layer.kv(context[..., :h], context[..., h:], context_positions)
        return [torch.stack([k, v], 1).permute(0, 3, 1, 2, 4)]

    # outputs --------------------------------------------------------------------------------
    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(normed, logits)`` of layer outputs ``[..., H]``; with a draft vocabulary (in eval mode)
        the logits cover its entries only."""
        normed = self.norm(hidden)
        if self.draft_vocab is not None and not self.training:
            w = self.lm_head.weight
            key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr())
            if self._draft_head is None or self._draft_head[0] != key:
                self._draft_head = (key, w.detach()[self.draft_vocab.to(w.device)].contiguous())
            logits = normed.to(w.dtype) @ self._draft_head[1].T
            bias = getattr(self.lm_head, "bias", None)
            if bias is not None:
                logits = logits + bias[self.draft_vocab.to(bias.device)]
            return normed, logits
        return normed, self.lm_head(normed.to(self.lm_head.weight.dtype))

    def vocab_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into :meth:`head`'s logits -> target token ids."""
        return ids if self.draft_vocab is None or self.training else self.draft_vocab.to(ids.device)[ids]

    # training-time test ------------------------------------------------------------------------
    def forward(self, features: torch.Tensor, tokens: torch.Tensor, steps: int | None = None) -> list[torch.Tensor]:
        """The training-time test over whole sequences: ``features [S, T, 3H]`` (the target's, at
        every token), ``tokens int64[S, T]`` (the data). Returns per step ``k = 1..steps`` (default
        ``num_steps``) the layer outputs ``[S, T, H]`` by index (module docstring): index ``i`` of
        step ``k`` predicts ``tokens[i + 1]`` after the drafter drafted ``k - 1`` tokens itself from
        the root at ``i - k + 1``."""
        steps = steps or self.config.num_steps
        s, t = tokens.shape
        hidden, emb, positions = self._index_inputs(features, tokens)
        masks = ttt_masks(t, steps, tokens.device)
        keys, values, outs = [], [], []
        for k in range(steps):
            past_k = torch.cat(keys, 2) if keys else hidden.new_empty(s, self.config.num_kv_heads, 0,
                                                                       self.config.head_dim)
            past_v = torch.cat(values, 2) if values else past_k
            out, key, value = self.layer(hidden, emb, positions, past_k, past_v, masks[k][None].expand(s, -1, -1))
            keys.append(key)
            values.append(value)
            outs.append(out)
            hidden = torch.cat([out.new_zeros(s, 1, out.shape[-1]), out[:, :-1]], 1)  # step k at i-1 feeds i
        return outs

    def _index_inputs(self, features: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Step 1's inputs at every index (module docstring): the hidden input (index ``r`` carries
        the fused features of ``x[r - 1]``, zeros at 0), the token embeddings and the rotary
        positions ``r - 1``."""
        s, t = tokens.shape
        fused = self.fuse_features(features)
        hidden = torch.cat([fused.new_zeros(s, 1, fused.shape[-1]), fused[:, :-1]], 1)
        return hidden, self.embed(tokens), (torch.arange(t, device=tokens.device) - 1)[None].expand(s, -1)

    def unroll_blocks(self, features: torch.Tensor, tokens: torch.Tensor, roots: torch.Tensor,
                      steps: int | None = None) -> torch.Tensor:
        """The training-time test at some roots only: ``roots int64[S, n]`` (indices into
        ``tokens [S, T]``) -> ``[S * n, steps, H]``, step ``k`` of root ``r`` being what
        :meth:`forward` gives at index ``r + k - 1`` (wherever ``r + k - 1 < T``; past the end the
        index is clamped and the row means nothing). Only step 1's keys and values come from every
        index; the layer itself runs on the roots' own paths, ``n * steps`` rows a sequence where
        :meth:`forward` runs ``steps * T`` and attends over ``steps * T`` keys."""
        steps = steps or self.config.num_steps
        s, t = tokens.shape
        n = roots.shape[1]
        dev = tokens.device
        hidden_all, emb_all, positions = self._index_inputs(features, tokens)
        keys, values = self.layer.kv(hidden_all, emb_all, positions)
        seq = torch.arange(s, device=dev)[:, None]
        index = torch.arange(t, device=dev)[None, None]
        root = roots[..., None]
        visible = [(index <= root) & ((index >= 1) | (root == 0))]          # step 1's keys: 1 .. r (0 if r = 0)
        own = torch.eye(n, dtype=torch.bool, device=dev).expand(s, n, n)     # a path key: its own block's
        hidden, outs = hidden_all[seq, roots.clamp(max=t - 1)], []
        for k in range(1, steps + 1):
            at = (roots + k - 1).clamp(max=t - 1)
            mask = torch.cat(visible + [own if k > 1 else torch.zeros_like(own)], -1)
            out, key, value = self.layer(hidden, emb_all[seq, at], at - 1, keys, values, mask)
            if k > 1:  # step 1's own key is already among ``keys``
                keys, values = torch.cat([keys, key], 2), torch.cat([values, value], 2)
                visible.append(own)
            outs.append(out)
            hidden = out
        return torch.stack(outs, 2).reshape(s * n, steps, -1)
