"""A drafter that knows the answers: a testing and benchmarking tool, not a model to decode with.

It lives in the package so that the tests and the benchmarks (``bench/e2e/e2e.py --drafter oracle``)
share it; nothing in the library's decoding or training path uses it.

:class:`LookupDrafter` looks up the root (token, position) in given reference sequences (e.g.
the target's own greedy output) and puts its logit mass on what follows; with probability
``miss`` a position's right token is only second best, so a chain breaks where a tree still
catches it. It measures the loop at a chosen acceptance profile; it is not a real drafter.
Correctness never depends on a drafter's quality.

:func:`oracle_stop_rule` is the oracle early exit for ``eagle3_vh``: drafting stops at the true
first rejection, the first step none of whose candidates continues the reference. It bounds what
a verification head's early exit can save.
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
            seq = _reference_of(self.sequences, tok, pos)
            if seq is None:
                continue
            for i in range(logits.shape[1]):
                if pos + 1 + i < len(seq):
                    right = seq[pos + 1 + i]
                    logits[row, i, right] = 30.0
                    if torch.rand((), generator=self.gen) < self.miss:
                        logits[row, i, (right + 1) % logits.shape[-1]] = 31.0
        return DraftOutput(hidden=out.hidden, base_logits=logits.to(device=out.base_logits.device, dtype=out.base_logits.dtype))


def _reference_of(sequences: list[list[int]], token: int, pos: int) -> list[int] | None:
    """The first reference with ``token`` at ``pos`` (the root's own position in its request)."""
    return next((s for s in sequences if pos < len(s) and s[pos] == token), None)


def oracle_stop_rule(sequences: list[torch.Tensor]):
    """A :data:`~dartree_ext.decoding.eagle.StopRule` that stops a row before the first drafting
    step none of whose candidate children continues its reference (found as by
    :class:`LookupDrafter`; a row without one stops at once). At T = 0 with the target's greedy
    output as references it keeps every token verification would accept."""
    refs = [s.tolist() for s in sequences]

    def rule(step: int, root: torch.Tensor, position: torch.Tensor, paths: torch.Tensor) -> torch.Tensor:
        stop = []
        for r, (tok, pos) in enumerate(zip(root.tolist(), position.tolist())):
            seq = _reference_of(refs, tok, pos)
            if seq is None or pos + step >= len(seq):
                stop.append(True)
                continue
            want = torch.tensor(seq[pos + 1:pos + 1 + step], device=paths.device)
            stop.append(not bool((paths[r] == want).all(-1).any()))
        return torch.tensor(stop, dtype=torch.bool)

    return rule
