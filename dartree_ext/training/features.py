"""Cached target features: the frozen target's hidden states are the same at every epoch, so
they can be computed once (one forward per sequence) instead of at every step, which on a CPU
is most of a step's cost. Per sequence: the drafter's context features (the chosen target layers,
concatenated) and the target's final (normalised) hidden state, from which the target's logits
at any position are one LM-head product. Stored as float16 shards of ``batch_size`` sequences in
a directory (resumable: finished shards are kept; a shard is written atomically). Sequences are
batched by length, so little of a forward is padding, within windows in the data's order, so new
data appended to old keeps the old shards.
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)

WINDOW = 64  # batches per length-sorted window (see FeatureCache.build)


class FeatureCache:
    """``features[i] float16[T_i, F]`` and ``final[i] float16[T_i, H]`` for sequence ``i``."""

    def __init__(self, features: list[torch.Tensor], final: list[torch.Tensor]) -> None:
        self.features, self.final = features, final

    def __len__(self) -> int:
        return len(self.features)

    @classmethod
    def build(cls, target, layer_ids: tuple[int, ...], seqs: list[list[int]], path: str, batch_size: int = 8,
              progress: bool = True) -> "FeatureCache":
        """Compute (or read back) the features of ``seqs``, in their order. The target runs on
        ``batch_size`` sequences of similar length at a time (longest first within each window of
        ``WINDOW`` batches' worth of sequences, in order), so a batch pads to little more than its
        own length; shard ``k`` holds the ``k``-th such batch. Sequences appended to ``seqs`` leave
        the shards of every earlier full window valid."""
        os.makedirs(path, exist_ok=True)
        device = next(target.parameters()).device
        base = getattr(target, target.base_model_prefix)
        span = WINDOW * batch_size
        order = [i for w in range(0, len(seqs), span)
                 for i in sorted(range(w, min(w + span, len(seqs))), key=lambda i: (-len(seqs[i]), i))]
        features: list = [None] * len(seqs)
        final: list = [None] * len(seqs)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc="target features", unit="seq")
        for start in range(0, len(seqs), batch_size):
            picked = order[start:start + batch_size]
            chunk = [seqs[i] for i in picked]
            shard = os.path.join(path, f"shard_{start // batch_size:05d}.pt")
            data = torch.load(shard) if os.path.exists(shard) else None
            if data is not None and (data["tokens"] != chunk or tuple(data.get("layer_ids", ())) != tuple(layer_ids)):
                log.warning("%s holds other sequences or layers (the data changed?): recomputing it", shard)
                data = None
            if data is None:
                data = _shard(base, layer_ids, chunk, device)
                tmp = shard + ".tmp"
                torch.save(data, tmp)
                os.replace(tmp, shard)
            for i, f, h in zip(picked, data["features"], data["final"]):
                features[i], final[i] = f, h
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return cls(features, final)


def _shard(base, layer_ids: tuple[int, ...], chunk: list[list[int]], device) -> dict:
    """One batch through the target's body: the chosen layers' hidden states (concatenated) and
    the final normalised one, per sequence, as float16 on the CPU."""
    width = max(len(s) for s in chunk)
    ids = torch.zeros(len(chunk), width, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, seq in enumerate(chunk):
        ids[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = 1
    with torch.no_grad():
        out = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i] for i in layer_ids], -1)
    return {"tokens": chunk, "layer_ids": list(layer_ids),
            "features": [feats[r, :len(s)].half().cpu() for r, s in enumerate(chunk)],
            "final": [out.last_hidden_state[r, :len(s)].half().cpu() for r, s in enumerate(chunk)]}
