"""The drafter models: a block-parallel (DFlash-style) drafter, the GRU causal-correction head
(Domino-style) and the verification head (VAT).

The drafter shares the target's token embedding and LM head (they are *not* its parameters:
``parameters()`` / ``save_pretrained`` leave them out, and they stay frozen). Its context is
a projection of the concatenated hidden states of a few target layers, one vector per token
already in the target's KV cache; a block is ``[last committed token, mask x (D - 1)]`` (with
``root_in_masks``, each mask input is the mask embedding plus the root token's embedding),
attends non-causally inside itself and to the whole context, and one pass predicts the D - 1
tokens after the last committed one.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops, reference
from ..attention import gqa_attention
from .. import row_layers
from ..row_layers import one_call
from ..head import CorrectionHeadWeights
from ..linear import linear_as

log = logging.getLogger(__name__)

CONFIG_NAME = "dartree_drafter.json"
WEIGHTS_NAME = "model.safetensors"


def default_target_layers(num_target_layers: int, count: int = 3) -> tuple[int, ...]:
    """Indices into HF ``hidden_states`` (0 = embedding output, i = output of layer i), spread
    over the target's depth from its first layer to its second-to-last (the last entry of
    ``hidden_states`` is already normalised for the LM head)."""
    if num_target_layers < 1:
        raise ValueError(f"the target needs at least one layer, got {num_target_layers}")
    hi = max(1, num_target_layers - 1)
    count = max(1, min(count, hi))
    if count == 1:
        return (hi,)
    return tuple(sorted({round(1 + j * (hi - 1) / (count - 1)) for j in range(count)}))



def read_json(path: str) -> object:
    """A saved drafter's JSON file; a ``ValueError`` naming the file if it is not JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}): the file is corrupt or truncated") from None


def read_weights(path: str) -> dict:
    """A saved drafter's safetensors weights; a ``FileNotFoundError`` or ``ValueError`` naming the
    file if it is missing, truncated or corrupt."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no drafter weights at {path}: the file is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}): truncated or corrupt") from None

class DrafterConfigBase:
    """What the drafter configs share: the attention sizes' defaults and checks, and ``to_dict``."""

    def _check_common(self) -> None:
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_heads
        if self.intermediate_size is None:
            self.intermediate_size = 2 * self.hidden_size
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    def _bad_layer_ids(self) -> list[int]:
        return [i for i in self.target_layer_ids if not 0 <= i <= self.target_num_layers]

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d


@dataclasses.dataclass
class BlockDrafterConfig(DrafterConfigBase):
    """Sizes of a drafter and of the target it was built for."""

    vocab_size: int
    hidden_size: int                       # = the target's (shared embedding and LM head)
    target_num_layers: int
    target_layer_ids: tuple[int, ...]      # indices into the target's hidden_states
    block_size: int = 16                   # D: 1 root + D - 1 predicted positions
    num_layers: int = 1
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None            # default hidden_size // num_heads
    intermediate_size: int | None = None   # default 2 * hidden_size
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    head_state_size: int = 128             # G: the correction head's GRU state
    head_proj_size: int = 64               # E: the correction head's inner width
    target_model_type: str = ""
    root_in_masks: bool = False            # add the root token's embedding to every mask position

    def __post_init__(self) -> None:
        self._check_common()
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (a root and at least one drafted position), got "
                             f"{self.block_size}")
        if not self.target_layer_ids or self._bad_layer_ids():
            raise ValueError(f"target_layer_ids must index the target's hidden_states (0..{self.target_num_layers}), "
                             f"got {self.target_layer_ids}")

    @property
    def draft_depth(self) -> int:
        """Positions drafted per pass (D - 1)."""
        return self.block_size - 1


def _target_sizes(target: nn.Module) -> tuple[int, int, int, str]:
    cfg = getattr(target, "config", None)
    if cfg is None:
        raise TypeError("target must be a HuggingFace causal LM (it has no .config)")
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    return int(text.vocab_size), int(text.hidden_size), int(text.num_hidden_layers), str(getattr(cfg, "model_type", ""))


def _target_io(target: nn.Module) -> tuple[nn.Module, nn.Module]:
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    if embed is None or head is None:
        raise TypeError("target must have input embeddings and an LM head (a *ForCausalLM model)")
    return embed, head


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if one_call(x, self.weight):
            return ops.rms_norm_rows(x, self.weight, self.eps)
        return reference.rms_norm_rows(x, self.weight, self.eps)


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half rotary embedding: ``x [B, H, T, Dh]``, ``positions int64[B, T]``."""
    if one_call(x) and x.stride(-1) == 1 and positions.dtype == torch.int64 and positions.shape[0] in (1, x.shape[0]):
        return ops.rotary_rows(x, positions, theta)
    return reference.rotary_rows(x, positions, theta)


class AttentionMLPLayer(nn.Module):
    """The weights every drafter layer has: q/k/v/o projections from ``in_width`` inputs (grouped
    query heads), and a SwiGLU MLP after its own norm."""

    def __init__(self, cfg, in_width: int) -> None:
        super().__init__()
        h, nh, nkv, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(in_width, nh * dh, bias=False)
        self.k_proj = nn.Linear(in_width, nkv * dh, bias=False)
        self.v_proj = nn.Linear(in_width, nkv * dh, bias=False)
        self.o_proj = nn.Linear(nh * dh, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.cfg.head_dim).transpose(1, 2)

    def attend(self, residual: torch.Tensor, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
        """``residual + o_proj(attention)``, then the MLP block: queries ``[B, heads, T, Dh]``,
        keys/values ``[B, kv_heads, S, Dh]`` (read by their query heads in place:
        :func:`dartree_ext.attention.gqa_attention`), ``mask`` bool ``[B or 1, 1, T or 1, S]``."""
        attn = gqa_attention(q, keys, values, mask)
        x = residual + self.o_proj(attn.transpose(1, 2).reshape(residual.shape[0], residual.shape[1], -1))
        hm = self.mlp_norm(x)
        gate, up = self.gate_proj(hm), self.up_proj(hm)
        act = ops.silu_mul(gate, up) if row_layers.vector_silu() and one_call(gate, up) else F.silu(gate) * up
        return x + self.down_proj(act)


class DrafterLayer(AttentionMLPLayer):
    """Pre-norm decoder layer whose queries are the block and whose keys/values are the context
    followed by the block (non-causal inside the block)."""

    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__(cfg, cfg.hidden_size)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def context_kv(self, ctx: torch.Tensor, ctx_pos: torch.Tensor) -> torch.Tensor:
        """The keys (rotated) and values of context vectors ``[B, S, H]`` at ``ctx_pos int64[B, S]``:
        ``[B, S, 2, kv_heads, head_dim]``. They depend on nothing else, so a decoder computes each
        slot's once (:meth:`forward`'s ``ctx_kv``) instead of every round."""
        cfg = self.cfg
        k = _rope(self._heads(self.k_proj(ctx), cfg.num_kv_heads), ctx_pos, cfg.rope_theta)
        v = self._heads(self.v_proj(ctx), cfg.num_kv_heads)
        return torch.stack([k, v], 1).permute(0, 3, 1, 2, 4)

    def forward(self, x: torch.Tensor, block_pos: torch.Tensor, ctx: torch.Tensor, ctx_pos: torch.Tensor,
                ctx_mask: torch.Tensor, ctx_kv: torch.Tensor | None = None, queries: int | None = None) -> torch.Tensor:
        """``ctx_kv``: :meth:`context_kv` of ``ctx`` (``[B, S, 2, kv_heads, head_dim]``), when the
        caller keeps it; ``ctx`` is not read then. ``queries``: the output for the first
        ``queries`` block rows only (keys and values still come from every row)."""
        cfg = self.cfg
        hx = self.attn_norm(x)
        rows = x.shape[1] if queries is None else queries
        q = _rope(self._heads(self.q_proj(hx[:, :rows]), cfg.num_heads), block_pos[:, :rows], cfg.rope_theta)
        if ctx_kv is None:
            keys_in = torch.cat([ctx.expand(x.shape[0], -1, -1), hx], 1)
            pos = torch.cat([ctx_pos.expand(x.shape[0], -1), block_pos], 1)
            k = _rope(self._heads(self.k_proj(keys_in), cfg.num_kv_heads), pos, cfg.rope_theta)
            v = self._heads(self.v_proj(keys_in), cfg.num_kv_heads)
        else:
            ctx_kv = ctx_kv.expand(x.shape[0], -1, -1, -1, -1)
            k = torch.cat([ctx_kv[:, :, 0].transpose(1, 2),
                           _rope(self._heads(self.k_proj(hx), cfg.num_kv_heads), block_pos, cfg.rope_theta)], 2)
            v = torch.cat([ctx_kv[:, :, 1].transpose(1, 2), self._heads(self.v_proj(hx), cfg.num_kv_heads)], 2)
        visible = torch.cat([ctx_mask.expand(x.shape[0], -1),
                             torch.ones(x.shape[0], x.shape[1], dtype=torch.bool, device=x.device)], 1)
        return self.attend(x[:, :rows], q, k, v, visible[:, None, None, :])


class CorrectionHead(nn.Module):
    """The GRU causal-correction head (DESIGN.md): for a branch whose tokens so far give GRU
    state ``s`` (``s_0 = 0``; ``s = GRUCell(E[token], s_prev)`` with the target's embedding E),
    corrected logits at position d are ``L_d + fc2(SiLU(W_z H_d + b1 + W_s s))``."""

    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.gru = nn.GRUCell(cfg.hidden_size, cfg.head_state_size)
        self.w_z = nn.Linear(cfg.hidden_size, cfg.head_proj_size)
        self.w_s = nn.Linear(cfg.head_state_size, cfg.head_proj_size, bias=False)
        self.fc2 = nn.Linear(cfg.head_proj_size, cfg.vocab_size)

    def forward(self, drafter_hidden: torch.Tensor, base_logits: torch.Tensor, tokens: torch.Tensor,
                embedding: nn.Module, vocab: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced corrected logits ``[B, T, V]`` for drafter hidden states ``[B, T, H]``
        and base logits ``[B, T, V]``, where ``tokens int64[B, T]`` holds the token at each
        position (position d is corrected with the state after tokens ``< d``). With ``vocab``
        (a draft vocabulary, ``int64[V']``) the base logits and the result are over those ids."""
        batch, steps = tokens.shape
        state = drafter_hidden.new_zeros(batch, self.cfg.head_state_size)
        emb = embedding(tokens).to(drafter_hidden.dtype)
        states = []
        for d in range(steps):
            states.append(state)
            if d + 1 < steps:
                state = self.gru(emb[:, d], state)
        s = torch.stack(states, 1)
        z = F.silu(self.w_z(drafter_hidden) + self.w_s(s))
        if vocab is None:
            return base_logits + self.fc2(z)
        vocab = vocab.to(z.device)
        return base_logits + F.linear(z, self.fc2.weight[vocab], self.fc2.bias[vocab])

    def export(self, embedding: nn.Embedding, dtype: torch.dtype | None = None) -> CorrectionHeadWeights:
        """The tensors the tree ops read (the GRU input gates precomputed for the vocabulary)."""
        head = CorrectionHeadWeights.from_modules(embedding, self.gru, self.w_z, self.w_s, self.fc2)
        if dtype is not None:
            head = CorrectionHeadWeights(**{f.name: None if getattr(head, f.name) is None else
                                            getattr(head, f.name).to(dtype) for f in dataclasses.fields(head)})
        return head


class VerificationHead(nn.Module):
    """VAT's verification head: one linear layer giving, per drafted position, the logit of
    "this position and all before it are accepted"."""

    def __init__(self, cfg: BlockDrafterConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(cfg.hidden_size, 1)

    def forward(self, drafter_hidden: torch.Tensor) -> torch.Tensor:
        return self.proj(drafter_hidden).squeeze(-1)


@dataclasses.dataclass
class DraftOutput:
    hidden: torch.Tensor       # [B, D - 1, H]: drafter hidden states of the drafted positions
    base_logits: torch.Tensor  # [B, D - 1, V], or [B, D - 1, V'] over the draft vocabulary
    vocab: torch.Tensor | None = None  # int64[V']: target id of each draft-vocabulary entry (None: all V)
    # float32[B, D - 1]: P(this position and all before it are accepted), from the verification
    # head; filled in by the decoder when it uses the head (early exit, estimator="vh")
    accept_prob: torch.Tensor | None = None

    def target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """Indices into ``base_logits``' last dim -> target token ids."""
        return ids if self.vocab is None else self.vocab[ids]


DRAFT_VOCAB_NAME = "draft_vocab.json"
CALIBRATION_NAME = "calibration.json"  # acceptance counts per tree-score bin, per "method@greedy|sample"


def check_draft_vocab(ids, vocab_size: int) -> torch.Tensor:
    """A draft vocabulary as ``int64[V']``: distinct target ids in ``[0, vocab_size)``."""
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"a draft vocabulary is a non-empty 1-D list of integer token ids, got {ids.dtype}"
                         f"{list(ids.shape)}")
    ids = ids.long()
    bad = (ids < 0) | (ids >= vocab_size)
    if bool(bad.any()):
        raise ValueError(f"draft vocabulary ids must be in [0, {vocab_size}); got {int(ids[bad][0])}")
    if torch.unique(ids).numel() != ids.numel():
        raise ValueError("draft vocabulary ids must be distinct")
    return ids


def frequent_tokens(sequences, size: int, always=()) -> list[int]:
    """The ``size`` most frequent token ids in ``sequences`` (ties to the lower id), ``always``
    first (e.g. stop tokens): a draft vocabulary (FR-Spec / EAGLE-3's d2t)."""
    from collections import Counter
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    counts = Counter(int(t) for seq in sequences for t in seq)
    chosen = list(dict.fromkeys(int(a) for a in always))
    seen = set(chosen)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if tok not in seen:
            chosen.append(tok)
            seen.add(tok)
    return chosen[:size]


class TargetAttached:
    """What every drafter shares: its target's embedding and LM head (set by :meth:`attach`,
    checked against ``self.config``, never saved with the drafter) and its files
    (:meth:`save_pretrained` / :meth:`from_pretrained`)."""

    _kind = "drafter"  # how errors name it
    _target_modules: tuple | None = None

    def attach(self, target: nn.Module):
        """Use ``target``'s embedding and LM head (checked against the config)."""
        vocab, hidden, layers, _ = _target_sizes(target)
        cfg = self.config
        if (vocab, hidden, layers) != (cfg.vocab_size, cfg.hidden_size, cfg.target_num_layers):
            raise ValueError(
                f"this {self._kind} was built for a target with vocab_size={cfg.vocab_size}, hidden_size="
                f"{cfg.hidden_size}, {cfg.target_num_layers} layers; the given target has vocab_size={vocab}, "
                f"hidden_size={hidden}, {layers} layers")
        self._target_modules = _target_io(target)
        return self

    @property
    def embedding(self) -> nn.Module:
        if self._target_modules is None:
            raise RuntimeError("the drafter is not attached to a target: call drafter.attach(target)")
        return self._target_modules[0]

    @property
    def lm_head(self) -> nn.Module:
        if self._target_modules is None:
            raise RuntimeError("the drafter is not attached to a target: call drafter.attach(target)")
        return self._target_modules[1]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # persistence ---------------------------------------------------------------------------
    _config_name: str = CONFIG_NAME  # the config file, and the config class it holds
    _config_class: type = None

    def save_pretrained(self, path: str | os.PathLike, dtype: torch.dtype | None = None) -> None:
        """``path/<config json>`` + ``path/model.safetensors`` (the drafter's own weights, cast to
        ``dtype`` if given, e.g. bfloat16 to halve a shipped file), ``draft_vocab.json`` and
        ``calibration.json`` when set."""
        from safetensors.torch import save_file
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, self._config_name), "w") as f:
            json.dump(self.config.to_dict(), f, indent=2)
        if self.draft_vocab is not None:
            with open(os.path.join(path, DRAFT_VOCAB_NAME), "w") as f:
                json.dump(self.draft_vocab.tolist(), f)
        if self.calibration:
            with open(os.path.join(path, CALIBRATION_NAME), "w") as f:
                json.dump(self.calibration, f)
        save_file({k: (v.detach() if dtype is None else v.detach().to(dtype)).contiguous().cpu()
                   for k, v in self.state_dict().items()}, os.path.join(path, WEIGHTS_NAME))

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, target: nn.Module, dtype: torch.dtype | None = None,
                        use_draft_vocab: bool = True):
        """Load a drafter saved with :meth:`save_pretrained` and attach it to ``target`` (a
        vocabulary, hidden-size or depth mismatch is a ``ValueError``). A ``draft_vocab.json``
        next to the weights sets the draft vocabulary (:meth:`set_draft_vocab`) unless
        ``use_draft_vocab=False``."""
        cfg_path = os.path.join(path, cls._config_name)
        if not os.path.isfile(cfg_path):
            raise FileNotFoundError(f"no {cls._kind} at {path!r}: {cls._config_name} is missing")
        fields = read_json(cfg_path)
        try:
            config = cls._config_class(**fields)
        except TypeError as e:  # unknown or missing fields
            raise ValueError(f"{cfg_path}: not a {cls._kind} config ({e})") from None
        drafter = cls(config)
        drafter.attach(target)
        missing, unexpected = drafter.load_state_dict(read_weights(os.path.join(path, WEIGHTS_NAME)), strict=False)
        if missing or unexpected:
            raise ValueError(f"drafter weights at {path!r} do not match its config: missing {missing}, "
                             f"unexpected {unexpected}")
        vocab_path = os.path.join(path, DRAFT_VOCAB_NAME)
        if use_draft_vocab and os.path.isfile(vocab_path):
            try:
                drafter.set_draft_vocab(read_json(vocab_path))
            except ValueError as e:
                raise ValueError(e if str(e).startswith(vocab_path) else f"{vocab_path}: {e}") from None
        calibration_path = os.path.join(path, CALIBRATION_NAME)
        if os.path.isfile(calibration_path):
            drafter.calibration = read_json(calibration_path)
        param = next(target.parameters())
        return drafter.to(device=param.device, dtype=dtype or param.dtype)


class BlockDrafter(TargetAttached, nn.Module):
    """A block-parallel drafter with its correction and verification heads."""

    _config_class = BlockDrafterConfig

    def __init__(self, cfg: BlockDrafterConfig, target: nn.Module | None = None) -> None:
        super().__init__()
        self.config = cfg
        feat = cfg.hidden_size * len(cfg.target_layer_ids)
        self.context_proj = nn.Linear(feat, cfg.hidden_size, bias=False)
        self.context_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mask_embedding = nn.Parameter(torch.randn(cfg.hidden_size) * 0.02)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.correction_head = CorrectionHead(cfg)
        self.verification_head = VerificationHead(cfg)
        self._target_modules: tuple[nn.Module, nn.Module] | None = None
        self.draft_vocab: torch.Tensor | None = None
        # training: logits over the draft vocabulary too (dartree-train --draft-vocab); else the
        # draft vocabulary applies at inference only and training sees the whole vocabulary
        self.train_over_draft_vocab = False
        self._draft_head: tuple | None = None
        self.calibration: dict[str, dict] = {}  # saved acceptance counts (budget="auto" starts from them)
        if target is not None:
            self.attach(target)

    def set_draft_vocab(self, ids) -> "BlockDrafter":
        """Draft over a reduced vocabulary (``ids``: target token ids, e.g. the most frequent
        ones, :func:`frequent_tokens`): the base logits are computed for these rows of the LM
        head only and mapped back to target ids by :meth:`DraftOutput.target_ids`. Tokens
        outside it are never drafted (verification stays exact). ``None`` restores the full one."""
        self.draft_vocab = None if ids is None else check_draft_vocab(ids, self.config.vocab_size)
        self._draft_head = None
        return self

    def _draft_head_weight(self) -> torch.Tensor:
        if self._draft_head is not None and torch.compiler.is_compiling():
            return self._draft_head[1]  # traced code keeps the rows made eagerly (StaticRound makes them)
        w = self.lm_head.weight
        key = (w.data_ptr(), w.dtype, w.device, self.draft_vocab.data_ptr())
        if self._draft_head is None or self._draft_head[0] != key:
            self._draft_head = (key, w.detach()[self.draft_vocab.to(w.device)].contiguous())
        return self._draft_head[1]

    # target --------------------------------------------------------------------------------
    @classmethod
    def from_target(cls, target: nn.Module, init_from_target: bool = False, **config: Any) -> "BlockDrafter":
        """A freshly initialised drafter sized for the HF causal LM ``target`` (keyword
        arguments override :class:`BlockDrafterConfig` fields).

        ``init_from_target=True`` starts the drafter's layers as copies of the target's last
        ``num_layers`` decoder layers (and its final norm), with the context projection picking
        the last feature layer, so a context vector is exactly what the first copied layer reads
        for that token in the target (:meth:`init_from_target`)."""
        vocab, hidden, layers, model_type = _target_sizes(target)
        text = target.config.get_text_config() if hasattr(target.config, "get_text_config") else target.config
        defaults = dict(vocab_size=vocab, hidden_size=hidden, target_num_layers=layers,
                        target_layer_ids=default_target_layers(layers), target_model_type=model_type,
                        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)))
        rope = getattr(text, "rope_theta", None) or (getattr(text, "rope_parameters", None) or {}).get("rope_theta")
        if rope:
            defaults["rope_theta"] = float(rope)
        heads = int(getattr(text, "num_attention_heads", 4))
        if hidden % heads == 0:
            defaults["num_heads"] = heads
            kv = int(getattr(text, "num_key_value_heads", heads) or heads)
            defaults["num_kv_heads"] = kv if heads % kv == 0 else heads
        if init_from_target:
            defaults["intermediate_size"] = int(getattr(text, "intermediate_size", 2 * hidden))
            defaults["head_dim"] = int(getattr(text, "head_dim", None) or hidden // defaults.get("num_heads", 4))
        defaults.update(config)
        drafter = cls(BlockDrafterConfig(**defaults), target)
        if init_from_target:
            drafter.init_from_target(target)
        param = next(target.parameters())
        return drafter.to(device=param.device)

    @torch.no_grad()
    def init_from_target(self, target: nn.Module) -> "BlockDrafter":
        """Copy the target's last ``num_layers`` decoder layers into the drafter's layers, its
        final norm into :attr:`norm`, and set the context path to ``input_layernorm(h)`` of the
        last feature layer ``h`` (identity on its slice of :attr:`context_proj`, zero elsewhere).
        With ``target_layer_ids[-1]`` = the target's second-to-last layer output (the default),
        the first copied layer sees the context exactly as the target's last layer does.
        Llama-style layers only (no attention biases, no q/k norms): anything else, or sizes
        that differ from this drafter's, is a ``ValueError``."""
        cfg = self.config
        base = getattr(target, getattr(target, "base_model_prefix", "model"), None)
        layers = getattr(base, "layers", None)
        if layers is None or getattr(base, "norm", None) is None or len(layers) < cfg.num_layers:
            raise ValueError("init_from_target needs a decoder with .layers (at least num_layers of them) and a "
                             "final .norm (a llama-style *ForCausalLM)")
        pairs = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
                 "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
                 "down_proj": "mlp.down_proj", "attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
        for mine, theirs in zip(self.layers, list(layers)[-cfg.num_layers:]):
            attn = getattr(theirs, "self_attn", None)
            extra = [n for n in ("q_norm", "k_norm") if getattr(attn, n, None) is not None]
            extra += [n + ".bias" for n in ("q_proj", "k_proj", "v_proj", "o_proj")
                      if getattr(getattr(attn, n, None), "bias", None) is not None]
            if extra:
                raise ValueError(f"init_from_target supports llama-style layers only; the target's layers have "
                                 f"{', '.join(extra)}")
            for name, path in pairs.items():
                src = theirs.get_submodule(path).weight
                dst = getattr(mine, name).weight
                if src.shape != dst.shape:
                    raise ValueError(f"init_from_target: the target's {path} is {tuple(src.shape)}, the drafter's "
                                     f"{name} is {tuple(dst.shape)} (sizes must match the target's)")
                dst.copy_(src.to(dst.dtype))
        self.norm.weight.copy_(base.norm.weight.to(self.norm.weight.dtype))
        first = list(layers)[-cfg.num_layers]
        self.context_norm.weight.copy_(first.input_layernorm.weight.to(self.context_norm.weight.dtype))
        h = cfg.hidden_size
        w = torch.zeros_like(self.context_proj.weight)
        w[:, -h:] = torch.eye(h, dtype=w.dtype)
        self.context_proj.weight.copy_(w)
        return self

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the drafter's own weights (its context and hidden states)."""
        return self.context_proj.weight.dtype

    def empty_context(self, rows: int) -> torch.Tensor:
        """A context of no positions, ``[rows, 0, H]`` (a prompt of one token has no prefix)."""
        return torch.zeros(rows, 0, self.config.hidden_size, dtype=self.dtype, device=self.context_proj.weight.device)

    # forward -------------------------------------------------------------------------------
    def target_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """The concatenated target hidden states the context is made of: ``[B, T, H * n]``."""
        return torch.cat([hidden_states[i] for i in self.config.target_layer_ids], -1)

    def project_context(self, features: torch.Tensor) -> torch.Tensor:
        """Context vectors ``[B, T, H]`` from :meth:`target_features`."""
        w = self.context_proj.weight
        return self.context_norm(self.context_proj(features.to(w.dtype)))

    def context_kv(self, context: torch.Tensor, context_positions: torch.Tensor) -> list[torch.Tensor]:
        """Every layer's keys and values of context vectors (``DrafterLayer.context_kv``), for
        :meth:`forward`'s ``context_kv``."""
        return [layer.context_kv(context, context_positions) for layer in self.layers]

    def forward(self, root_tokens: torch.Tensor, root_positions: torch.Tensor, context: torch.Tensor,
                context_positions: torch.Tensor, context_mask: torch.Tensor,
                context_kv: list[torch.Tensor] | None = None, positions: int | None = None) -> DraftOutput:
        """One drafting pass. ``root_tokens int64[B]`` at ``root_positions int64[B]``; context
        vectors ``[B or 1, S, H]`` (:meth:`project_context`) at ``context_positions
        int64[B or 1, S]``, visible where ``context_mask bool[B or 1, S]``. ``context_kv``
        (:meth:`context_kv` of the same context, kept by the caller) saves projecting the context
        again; the result is the same. ``positions`` (1 .. block_size - 1): outputs for the first
        ``positions`` drafted positions only. The block's keys and values still come from all of
        it, so these equal the full pass's first positions (bit for bit where the linear layers
        are batch-invariant, as ``few_rows_linear``); the last layer's queries, MLP, norm and head
        skip the rest."""
        cfg = self.config
        if positions is not None and not 1 <= positions <= cfg.block_size - 1:
            raise ValueError(f"positions must be in [1, {cfg.block_size - 1}], got {positions}")
        batch = root_tokens.shape[0]
        dtype = self.dtype
        root = self.embedding(root_tokens).to(dtype)
        masks = self.mask_embedding.to(dtype).expand(batch, cfg.block_size - 1, -1)
        if cfg.root_in_masks:  # each drafted position sees the root directly, not only through attention
            masks = masks + root[:, None]
        x = torch.cat([root[:, None], masks], 1)
        block_pos = root_positions[:, None] + torch.arange(cfg.block_size, device=root_tokens.device)
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, block_pos, context, context_positions, context_mask,
                      None if context_kv is None else context_kv[i],
                      queries=None if positions is None or i < last else positions + 1)
        hidden = self.norm(x[:, 1:])
        head_w = self.lm_head.weight
        if self.draft_vocab is not None and (self.train_over_draft_vocab or not self.training):
            sub = self._draft_head_weight()
            logits = linear_as(self.context_proj, hidden.to(sub.dtype), sub)  # as the drafter's layers run
            bias = getattr(self.lm_head, "bias", None)
            if bias is not None:
                logits = logits + bias[self.draft_vocab.to(bias.device)]
            return DraftOutput(hidden=hidden, base_logits=logits, vocab=self.draft_vocab.to(logits.device))
        logits = self.lm_head(hidden.to(head_w.dtype))
        return DraftOutput(hidden=hidden, base_logits=logits)

    def export_head(self, dtype: torch.dtype | None = None) -> CorrectionHeadWeights:
        """The correction head's tensors for the tree ops (:meth:`CorrectionHead.export`). The
        result is reused while no weight it derives from has changed (its GRU input table costs
        about 0.1 s on a CPU for a 49k vocabulary, once per decoder otherwise)."""
        params = [self.embedding.weight, *self.correction_head.parameters()]
        try:
            key = (dtype, tuple((p.data_ptr(), p._version, p.dtype, p.device) for p in params))
        except RuntimeError:  # inference tensors keep no version counter: no reuse
            return self.correction_head.export(self.embedding, dtype)
        cached = getattr(self, "_exported_head", None)
        if cached is not None and cached[0] == key:
            return cached[1]
        head = self.correction_head.export(self.embedding, dtype)
        self._exported_head = (key, head)
        return head



