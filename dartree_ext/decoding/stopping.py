"""When a request is done, and the back-off after a round that did not pay: shared by the eager
loop (:class:`~dartree_ext.decoding.SpeculativeDecoder`) and the compiled round
(:class:`~dartree_ext.decoding.StaticRound`)."""
from __future__ import annotations

from collections.abc import Container, Iterable

from .cost import next_backoff


def emit(out: list[int], tokens: Iterable[int], stop: Container[int], max_new_tokens: int,
         max_total: int | None = None, prompt_tokens: int = 0) -> str:
    """Append ``tokens`` to a request's output ``out`` up to where it ends, and why it ended:
    ``"stop"`` (a stop token, kept), ``"length"`` (``max_new_tokens``), ``"context"`` (the
    prompt and output fill ``max_total`` positions), or ``""`` (not done)."""
    for tok in tokens:
        out.append(tok)
        if tok in stop:
            return "stop"
        if len(out) >= max_new_tokens:
            return "length"
        if max_total is not None and prompt_tokens + len(out) >= max_total:
            return "context"
    return ""


class Backoff:
    """Rest after a loss: after a round that did not pay, the next 1, 2, 4, ... 16 chances are
    skipped (doubling while rounds keep losing); a round that pays resets it."""

    def __init__(self) -> None:
        self.skip = self.backoff = 0

    def rests(self) -> bool:
        """Whether this chance is skipped (counting it off)."""
        if self.skip:
            self.skip -= 1
            return True
        return False

    def lost(self) -> None:
        self.backoff = next_backoff(self.backoff)
        self.skip = self.backoff

    def paid(self) -> None:
        self.backoff = 0
