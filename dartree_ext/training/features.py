"""Cached target features: the frozen target's hidden states are the same at every epoch, so
they can be computed once (one forward per sequence) instead of at every step, which on a CPU
is most of a step's cost. Per sequence: the drafter's context features (the chosen target layers,
concatenated) and the target's final (normalised) hidden state, from which the target's logits
at any position are one LM-head product. Stored as float16 shards of ``batch_size`` sequences in
a directory (resumable: finished shards are kept; a shard is written atomically).
"""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger(__name__)


class FeatureCache:
    """``features[i] float16[T_i, F]`` and ``final[i] float16[T_i, H]`` for sequence ``i``."""

    def __init__(self, features: list[torch.Tensor], final: list[torch.Tensor]) -> None:
        self.features, self.final = features, final

    def __len__(self) -> int:
        return len(self.features)

    @classmethod
    def build(cls, target, layer_ids: tuple[int, ...], seqs: list[list[int]], path: str, batch_size: int = 8,
              progress: bool = True) -> "FeatureCache":
        os.makedirs(path, exist_ok=True)
        device = next(target.parameters()).device
        base = getattr(target, target.base_model_prefix)
        features, final = [], []
        shards = range(0, len(seqs), batch_size)
        bar = None
        if progress:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc="target features", unit="seq")
        for start in shards:
            chunk = seqs[start:start + batch_size]
            shard = os.path.join(path, f"shard_{start // batch_size:05d}.pt")
            data = torch.load(shard) if os.path.exists(shard) else None
            if data is not None and (data["tokens"] != chunk or tuple(data.get("layer_ids", ())) != tuple(layer_ids)):
                log.warning("%s holds other sequences or layers (the data changed?): recomputing it", shard)
                data = None
            if data is None:
                width = max(len(s) for s in chunk)
                ids = torch.zeros(len(chunk), width, dtype=torch.int64)
                mask = torch.zeros_like(ids)
                for row, seq in enumerate(chunk):
                    ids[row, :len(seq)] = torch.tensor(seq)
                    mask[row, :len(seq)] = 1
                with torch.no_grad():
                    out = base(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
                feats = torch.cat([out.hidden_states[i] for i in layer_ids], -1)
                data = {"tokens": chunk, "layer_ids": list(layer_ids),
                        "features": [feats[r, :len(s)].half().cpu() for r, s in enumerate(chunk)],
                        "final": [out.last_hidden_state[r, :len(s)].half().cpu() for r, s in enumerate(chunk)]}
                tmp = shard + ".tmp"
                torch.save(data, tmp)
                os.replace(tmp, shard)
            features += data["features"]
            final += data["final"]
            if bar is not None:
                bar.update(len(chunk))
        if bar is not None:
            bar.close()
        return cls(features, final)
