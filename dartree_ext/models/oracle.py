"""A drafter that knows the answers: a testing and benchmarking tool, not a model to decode with.

It lives in the package so that the tests and the benchmarks (``bench/e2e.py --drafter oracle``)
share it; nothing in the library's decoding or training path uses it.

:class:`LookupDrafter` looks up the root (token, position) in given reference sequences (e.g.
the target's own greedy output) and puts its logit mass on what follows; with probability
``miss`` a position's right token is only second best, so a chain breaks where a tree still
catches it. It measures the loop at a chosen acceptance profile; it is not a real drafter.
Correctness never depends on a drafter's quality.
"""
from __future__ import annotations

import torch

from .drafter import BlockDrafter, DraftOutput


class LookupDrafter(BlockDrafter):
    """See the module docstring. ``base`` gives the weights (hidden states still come from it),
    their device and their dtype."""

    def __init__(self, base: BlockDrafter, sequences: list[torch.Tensor], miss: float = 0.3, seed: int = 0) -> None:
        super().__init__(base.config)
        weight = next(base.parameters())
        self.to(device=weight.device, dtype=weight.dtype)
        self.load_state_dict(base.state_dict())
        self._target_modules = base._target_modules
        self.sequences = [s.tolist() for s in sequences]
        self.miss, self.gen = miss, torch.Generator().manual_seed(seed)

    def forward(self, root_tokens, root_positions, context, context_positions, context_mask,
                context_kv=None, positions=None) -> DraftOutput:
        out = super().forward(root_tokens, root_positions, context, context_positions, context_mask, context_kv,
                              positions)
        logits = torch.randn(tuple(out.base_logits.shape), generator=self.gen)
        for row, (tok, pos) in enumerate(zip(root_tokens.tolist(), root_positions.tolist())):
            seq = next((s for s in self.sequences if pos < len(s) and s[pos] == tok), None)
            if seq is None:
                continue
            for i in range(logits.shape[1]):
                if pos + 1 + i < len(seq):
                    right = seq[pos + 1 + i]
                    logits[row, i, right] = 30.0
                    if torch.rand((), generator=self.gen) < self.miss:
                        logits[row, i, (right + 1) % logits.shape[-1]] = 31.0
        return DraftOutput(hidden=out.hidden, base_logits=logits.to(device=out.base_logits.device, dtype=out.base_logits.dtype))
