"""The decoding methods, one entry each: what a method drafts with, which knobs it reads, and how
its tree is sized.

:class:`~dartree_ext.decoding.SpeculativeDecoder` and :func:`~dartree_ext.decoding.config.resolve`
decide by these entries, not by comparing method names: adding a method is adding an entry here
(and, for a new kind of tree, its builder in :mod:`~dartree_ext.decoding.trees`).
"""
from __future__ import annotations

import dataclasses

BLOCK, EAGLE3 = "block", "eagle3"  # the drafter kinds


@dataclasses.dataclass(frozen=True)
class Method:
    """One decoding method.

    ``drafter``: the drafter kind it takes (:data:`BLOCK`, :data:`EAGLE3`) or ``None`` (no
    drafter); ``sizes``: ``budget="auto"`` can size its trees; ``head``: it rescores with the
    drafter's correction head; ``chain``: its draft is one chain (a per-row early-exit cut);
    ``capped``: its best ``n <= cap`` nodes are those of a build at ``cap`` nodes (the auto
    budget builds less); ``knobs``: the settings it reads besides ``budget`` (a setting the user
    gives a method that does not read it is reported); ``fixed_budget``: whether a fixed
    ``budget`` sets its tree's size; ``early_exit``: its default early-exit threshold."""

    name: str
    drafter: str | None = BLOCK
    sizes: bool = True
    head: bool = False
    chain: bool = False
    capped: bool = False
    knobs: frozenset = frozenset()
    fixed_budget: bool = True
    early_exit: float | None = None
    tree: str | None = None

    @property
    def drafts(self) -> bool:
        """Whether it runs a drafter."""
        return self.drafter is not None

    @property
    def eagle3(self) -> bool:
        return self.drafter == EAGLE3

    @property
    def plain(self) -> bool:
        """Plain decoding: no draft at all (no drafter, no lookup branch)."""
        return not self.drafts and "lookup" not in self.knobs


def _knobs(*names: str) -> frozenset:
    return frozenset(names)


_TREE = ("K", "early_exit")
REGISTRY: dict[str, Method] = {m.name: m for m in (
    Method("ar", drafter=None, sizes=False, fixed_budget=False),
    Method("lookup", drafter=None, fixed_budget=False, knobs=_knobs("lookup")),
    Method("chain", tree="chain", chain=True, fixed_budget=False, knobs=_knobs("early_exit", "lookup", "sampled_draft")),
    Method("chain_corrected", tree="corrected_chain", head=True, chain=True, fixed_budget=False, knobs=_knobs(*_TREE, "lookup")),
    Method("ddtree", tree="ddtree", capped=True, knobs=_knobs(*_TREE, "lookup")),
    Method("dartree_fixed", tree="dartree_fixed", head=True, knobs=_knobs(*_TREE, "depth_bonus", "lookup")),
    Method("dartree", tree="dartree", head=True, capped=True, knobs=_knobs(*_TREE, "width", "depth_bonus", "lookup")),
    Method("seq_heap", tree="seq_heap", head=True, sizes=False, knobs=_knobs(*_TREE, "depth_bonus", "lookup")),
    Method("eagle3", drafter=EAGLE3, knobs=_knobs("width", "K", "lookup")),
    Method("eagle3_vh", drafter=EAGLE3, knobs=_knobs("width", "K", "early_exit", "lookup"), early_exit=0.5),
)}

METHODS = tuple(n for n, m in REGISTRY.items() if m.drafter != EAGLE3)  # a block drafter or none
EAGLE3_METHODS = tuple(n for n, m in REGISTRY.items() if m.drafter == EAGLE3)
ALL_METHODS = tuple(REGISTRY)
AUTO_METHODS = tuple(n for n, m in REGISTRY.items() if m.sizes)  # budget="auto"
DRAFTERLESS = tuple(n for n, m in REGISTRY.items() if not m.drafts)


def method(name: str) -> Method:
    """The registry's entry for ``name``, or a ValueError naming the methods there are."""
    try:
        return REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; expected one of {', '.join(ALL_METHODS)}") from None
