"""What one ``generate`` call holds while it runs: the :class:`Session` (settings, outputs,
statistics, clock, the call's sizing), the :class:`Batch` of unfinished requests and their
caches, and each round's :class:`Verdict`; and the statistics a call returns
(:class:`DecodingStats`)."""
from __future__ import annotations

import dataclasses
import time
from collections import Counter

import torch

from ..tree import Tree
from .cache import select_requests_
from .hf import pad_token_id, text_config
from .lookup import ContextIndex, LookupStats
from .stopping import emit

PHASES = ("prefill", "draft", "tree", "verify", "bookkeeping")


@dataclasses.dataclass
class RequestStats:
    """One request: ``accepted[r]`` = draft tokens accepted in round r (tau_r = that + 1)."""

    prompt_tokens: int
    accepted: list[int] = dataclasses.field(default_factory=list)
    new_tokens: int = 0
    finish_reason: str = ""

    @property
    def rounds(self) -> int:
        return len(self.accepted)

    @property
    def tau(self) -> float:
        """Tokens per round (accepted + bonus), averaged over this request's rounds."""
        return (sum(self.accepted) / len(self.accepted) + 1.0) if self.accepted else 0.0


@dataclasses.dataclass
class DecodingStats:
    """Acceptance and time of one ``generate`` call."""

    method: str
    requests: list[RequestStats]
    time: dict[str, float]                  # seconds per phase (PHASES)
    tree_nodes: list[int] = dataclasses.field(default_factory=list)   # draft nodes per verified tree
    nodes_per_depth: Counter = dataclasses.field(default_factory=Counter)
    plain_rounds: int = 0                   # budget="auto": rounds verified without a draft (n = 0)
    # budget="auto", over the rounds that verified draft nodes: what the chooser predicted
    # (tokens: rows + E[accepted]; ms: the cost model's round plus the measured overhead) and
    # what the rounds gave and took
    auto_rounds: int = 0                    # batch rounds (all rows verify together)
    predicted_tokens: float = 0.0
    predicted_ms: float = 0.0
    measured_tokens: int = 0
    measured_ms: float = 0.0
    lookup_rounds: int = 0                  # rows x rounds that verified a context-lookup continuation
    lookup_accepted: int = 0                # tokens accepted along those continuations
    corpus_rounds: int = 0                  # of lookup_rounds: continuations taken from the corpus
    corpus_accepted: int = 0                # of lookup_accepted: tokens accepted along those

    @property
    def rounds(self) -> int:
        return sum(r.rounds for r in self.requests)

    def check_prediction(self, predicted: tuple[float, float] | None, tokens: int, ms: float) -> None:
        """``budget="auto"``: a verified round's predicted ``(tokens, ms)`` against what it gave and took."""
        if predicted is None:
            return
        self.auto_rounds += 1
        self.predicted_tokens += predicted[0]
        self.predicted_ms += predicted[1]
        self.measured_tokens += tokens
        self.measured_ms += ms

    @property
    def tau(self) -> float:
        """Tokens per round over all rounds of all requests (micro average)."""
        rounds = self.rounds
        return (sum(sum(r.accepted) for r in self.requests) / rounds + 1.0) if rounds else 0.0

    @property
    def tau_macro(self) -> float:
        """Mean over requests of each request's tau."""
        taus = [r.tau for r in self.requests if r.rounds]
        return sum(taus) / len(taus) if taus else 0.0

    @property
    def new_tokens(self) -> int:
        return sum(r.new_tokens for r in self.requests)

    @property
    def total_time(self) -> float:
        return sum(self.time.values())

    def accept_histogram(self) -> list[int]:
        """``h[a]`` = rounds that accepted exactly ``a`` draft tokens."""
        counts = Counter(a for r in self.requests for a in r.accepted)
        top = max(counts, default=-1)
        return [counts.get(a, 0) for a in range(top + 1)]

    def summary(self) -> dict:
        total = self.total_time
        return {
            "method": self.method, "requests": len(self.requests), "rounds": self.rounds,
            "new_tokens": self.new_tokens, "tau": round(self.tau, 4), "tau_macro": round(self.tau_macro, 4),
            "mean_tree_nodes": round(sum(self.tree_nodes) / len(self.tree_nodes), 2) if self.tree_nodes else 0.0,
            "time_s": round(total, 4),
            "time_per_token_ms": round(1e3 * total / max(1, self.new_tokens), 4),
            "time_split": {k: round(v / total, 4) if total else 0.0 for k, v in self.time.items()},
            "accept_histogram": self.accept_histogram(),
            "plain_rounds": self.plain_rounds,
            "auto_check": {"rounds": self.auto_rounds, "predicted_tokens": round(self.predicted_tokens, 2),
                           "measured_tokens": self.measured_tokens, "predicted_ms": round(self.predicted_ms, 2),
                           "measured_ms": round(self.measured_ms, 2)} if self.auto_rounds else None,
            "lookup_rounds": self.lookup_rounds, "lookup_accepted": self.lookup_accepted,
            "corpus_rounds": self.corpus_rounds, "corpus_accepted": self.corpus_accepted,
        }


@dataclasses.dataclass
class GenerationOutput:
    sequences: torch.Tensor  # int64[B, prompt + generated], as HF ``generate`` returns them
    stats: DecodingStats


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What verifying one round's trees decided, per row (:meth:`read`)."""

    accept_nodes: torch.Tensor  # int32[B, N]: the accepted path's node indices (root first, -1 after)
    accept_len: torch.Tensor    # int32[B]: accepted draft tokens
    bonus: torch.Tensor         # int64[B]: the target's token after the path (the next root)
    target_tokens: torch.Tensor  # int64[B, N]: the target's token after every node
    hidden_states: tuple | None  # the target's hidden states over the tree (for the drafter's context)
    # host copies, fetched in one transfer: accepted draft tokens, bonus token, draft nodes, the
    # tokens along each row's accepted path (root first) and every node's depth
    accepted: list[int]
    bonus_tokens: list[int]
    sizes: list[int]
    paths: list[list[int]]
    depths: list[list[int]]

    @classmethod
    def read(cls, tree: Tree, accept_nodes: torch.Tensor, accept_len: torch.Tensor, bonus: torch.Tensor,
             target_tokens: torch.Tensor, hidden_states: tuple | None) -> "Verdict":
        """The verdict on ``tree``, with everything the host needs from the round fetched in one
        device-to-host transfer."""
        n = tree.tokens.shape[1]
        path = tree.tokens.gather(1, accept_nodes.long().clamp(min=0))
        host = torch.cat([accept_len.long()[:, None], bonus[:, None], (tree.num_nodes - 1).long()[:, None],
                          path, tree.depths.long()], 1).tolist()
        return cls(accept_nodes, accept_len, bonus, target_tokens, hidden_states,
                   accepted=[h[0] for h in host], bonus_tokens=[h[1] for h in host], sizes=[h[2] for h in host],
                   paths=[h[3:3 + n] for h in host], depths=[h[3 + n:] for h in host])


class PhaseHook:
    """Observes the phases of a ``generate`` call (``SpeculativeDecoder.generate(..., hook=...)``):
    :meth:`enter` before and :meth:`exit` after each of :data:`HOOK_PHASES`. ``batch`` is the
    call's :class:`Batch` (``None`` when entering ``prefill``, which makes it), ``result`` what the
    phase returned (the draft, ``(tree, chosen)``, the :class:`Verdict`, ...). Subclass and
    override either; a hook is for timing, profiling and inspection: it must not change what it is
    given."""

    def enter(self, phase: str, batch: "Batch | None") -> None:
        pass

    def exit(self, phase: str, batch: "Batch | None", result) -> None:
        pass


# the phases a PhaseHook sees: the round's, and inside them the drafter's context made for
# committed slots ("context") and the lookup branch grafted ("lookup")
HOOK_PHASES = ("prefill", "draft", "tree", "verify", "commit", "retire", "context", "lookup")


def context_vectors(drafter, eagle3: bool, features: torch.Tensor, next_tokens: torch.Tensor | None) -> torch.Tensor:
    """The drafter's context vectors of committed slots from the target's features there (an
    EAGLE-3 drafter also reads the token after each slot: ``next_tokens``)."""
    if eagle3:
        return drafter.project_context(features, next_tokens)
    return drafter.project_context(features)


@dataclasses.dataclass
class Batch:
    """The unfinished requests of one ``generate`` call, a row each, and their cache.

    Slot ``j`` of row ``b`` holds a committed token for ``pad[b] <= j < length[b]``; ``root[b]``
    (the last committed token) is not in the cache yet."""

    active: torch.Tensor     # int64[R]: the request of each row
    pad: torch.Tensor        # int64[R]: left padding
    length: torch.Tensor     # int64[R]: cache slots in use (pad included)
    root: torch.Tensor       # int64[R]
    cache: object            # the target's KV cache (transformers Cache)
    host_length: list[int] = dataclasses.field(default_factory=list)  # ``length`` on the host
    context: torch.Tensor | None = None  # [R, S, H]: the drafter's context, slot by slot
    context_kv: list[torch.Tensor] | None = None  # per drafter layer, its keys/values of ``context``
    # committed slots whose context vectors are not made yet (stage_context: while the drafter
    # rests, the target's features wait here and are projected in one batch before it drafts)
    pending: list[tuple] = dataclasses.field(default_factory=list)
    # the current round's view of the cache (begin_round) and its results
    cache_len: int = 0
    past_valid: torch.Tensor | None = None  # bool[R, cache_len]: committed slots
    position: torch.Tensor | None = None    # int64[R]: the root's position
    full_tree: Tree | None = None           # budget="auto": the tree before it was cut
    # lookup: per row, the continuation grafted this round and the length of the n-gram it matched
    chains: list[list[int]] | None = None
    ngrams: list[int] | None = None
    drafted: list[int] | None = None  # per row, the nodes before the graft (the drafter's)
    chain_new: list[list[bool]] | None = None  # per row, which continuation tokens are new nodes
    chain_stats: list[LookupStats] | None = None  # per row, the statistics of its continuation's source

    @property
    def rows(self) -> int:
        return int(self.active.numel())

    def begin_round(self, cache_slots: int) -> None:
        self.cache_len = max(max(self.host_length), cache_slots)
        slot = torch.arange(self.cache_len, device=self.length.device)
        self.past_valid = (slot[None] >= self.pad[:, None]) & (slot[None] < self.length[:, None])
        self.position = self.length - self.pad
        self.full_tree = None
        self.chains = self.ngrams = self.drafted = self.chain_new = self.chain_stats = None
        self.draft_q = None  # sampled_draft: the round's chain distributions (DraftQ)

    def stage_context(self, features: torch.Tensor, next_tokens: torch.Tensor | None,
                      in_path: torch.Tensor | None) -> None:
        """Queue the target's ``features [R, W, F]`` of the slots ``length ..`` (where ``in_path``;
        ``None``: the first slot of every row;
        ``next_tokens [R, W]`` for an EAGLE-3 drafter) until :meth:`flush_context`
        turns them into context vectors: a row and slot, the position and the feature per slot."""
        if in_path is None:  # one slot a row
            self.pending.append((torch.arange(self.rows, device=features.device), self.length, self.length - self.pad,
                                 features[:, 0], None if next_tokens is None else next_tokens[:, 0]))
            return
        rows, width = in_path.shape
        steps = torch.arange(width, device=features.device)[None]
        dst = (self.length[:, None] + steps)[in_path]
        pos = ((self.length - self.pad)[:, None] + steps)[in_path]
        row = torch.arange(rows, device=features.device)[:, None].expand(-1, width)[in_path]
        self.pending.append((row, dst, pos, features[in_path], None if next_tokens is None else next_tokens[in_path]))

    def write_context(self, row: torch.Tensor, dst: torch.Tensor, vectors: torch.Tensor,
                      kv: list[torch.Tensor]) -> None:
        """Write context ``vectors [N, H]`` (and each drafter layer's keys/values ``[N, ...]``) at
        slots ``(row, dst)``. The buffers grow by half their size at a time (readers slice them to
        the round's cache length), not by a copy every round."""
        need = max(self.host_length)
        slots = [self.context] + (self.context_kv or [])
        if need > self.context.shape[1]:
            size = max(need, self.context.shape[1] + max(64, self.context.shape[1] // 2))
            slots = [torch.cat([old, old.new_zeros((old.shape[0], size - old.shape[1]) + tuple(old.shape[2:]))], 1)
                     for old in slots]
        for old, add in zip(slots, [vectors] + kv):
            old[row, dst] = add.to(old.dtype)
        self.context = slots[0]
        if self.context_kv is not None:
            self.context_kv = slots[1:]

    def ensure_context(self, drafter, with_kv: bool) -> None:
        """An empty drafter context when there is none yet (a prompt of one token has no prefix)."""
        if self.context is None:
            self.context = drafter.empty_context(self.rows)
            if with_kv:
                self.context_kv = drafter.context_kv(self.context, self.pad.new_zeros(self.rows, 0))

    def flush_context(self, drafter, eagle3: bool, with_kv: bool) -> None:
        """The queued slots' context vectors (and keys/values), made in one batch and written."""
        row, dst, pos, feats, nxt = (None if parts[0] is None else parts[0] if len(parts) == 1 else torch.cat(parts)
                                     for parts in zip(*self.pending))  # one entry (every drafting round): no copy
        self.pending = []
        self.ensure_context(drafter, with_kv)
        vectors = context_vectors(drafter, eagle3, feats[None], None if nxt is None else nxt[None])
        kv = [t[0] for t in drafter.context_kv(vectors, pos[None])] if with_kv else []
        self.write_context(row, dst, vectors[0], kv)

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only the rows ``idx`` (int64), in the cache too."""
        if self.pending:  # the kept rows' queued slots, renumbered
            renumber = torch.full((self.rows,), -1, dtype=torch.int64, device=idx.device)
            renumber[idx] = torch.arange(idx.numel(), device=idx.device)
            kept = []
            for row, *rest in self.pending:
                new = renumber[row]
                live = new >= 0
                kept.append((new[live], *(None if t is None else t[live] for t in rest)))
            self.pending = kept
        self.active, self.pad, self.length, self.root = self.active[idx], self.pad[idx], self.length[idx], self.root[idx]
        self.host_length = [self.host_length[i] for i in idx.tolist()]
        if self.context is not None:
            self.context = self.context[idx]
        if self.context_kv is not None:
            self.context_kv = [kv[idx] for kv in self.context_kv]
        if idx.numel():
            select_requests_(self.cache, idx)


class Session:
    """One ``generate`` call: its settings, output tokens, stats, phase clock and the per-call
    state of its sizing (:attr:`sizing`) and lookup branch (:attr:`corpus`, :attr:`lookup_stats`,
    :attr:`corpus_stats`). The decoder's rounds read and write this, not the decoder, which keeps
    only what outlives a call (its calibrators, lookup statistics and running costs)."""

    def __init__(self, decoder, prompts: list[torch.Tensor], max_new_tokens: int,
                 stop: set[int], sampling: dict, sizing=None, corpus=None,
                 hook: PhaseHook | None = None) -> None:
        target = decoder.target
        self.hook = hook
        self.device = prompts[0].device
        self.dtype = next(target.parameters()).dtype
        self.drafting = decoder.drafter is not None and decoder.spec.drafts
        self.pad_id = pad_token_id(target)
        self.max_new_tokens, self.stop, self.sampling = max_new_tokens, stop, sampling
        self.sizing = decoder.sizing if sizing is None else sizing  # the call's AutoBudget or FixedBudget
        # the lookup branch's corpus (None: not consulted in this call) and its statistics' regime
        self.corpus = corpus
        # the lookup statistics of the call's regime, kept across calls by decoder.learned
        regime = "greedy" if not sampling.get("temperature") else "sample"
        self.lookup_stats = decoder.learned.lookup_stats(regime)
        self.corpus_stats = decoder.learned.lookup_stats(f"corpus-{regime}")
        self.max_pos = int(getattr(text_config(target), "max_position_embeddings", 0) or 0) or None
        self.generated: list[list[int]] = [[] for _ in prompts]
        # lookup: every request's prompt and output so far, indexed by n-gram
        self.index = [ContextIndex(p.tolist()) for p in prompts] if decoder.lookup else None
        self.stats = DecodingStats(decoder.method, [RequestStats(int(p.numel())) for p in prompts],
                                   {p: 0.0 for p in PHASES})
        self._sync = decoder.sync_timing and self.device.type == "cuda"
        self._clock = time.perf_counter()

    def propose_continuations(self, requests: list[int], lookup: int) -> tuple[list, list, list]:
        """Each row's lookup continuation (at most ``lookup`` tokens, and no more than the request
        has room for), the n-gram length it matched and its source's statistics: the context's,
        or the corpus's where that source expects more tokens."""
        chains, ngrams, sources = [], [], []
        for req in requests:
            room = self.max_new_tokens - len(self.generated[req]) - 1  # the bonus token comes after the chain
            if self.max_pos is not None:
                room = min(room, self.max_pos - self.stats.requests[req].prompt_tokens - len(self.generated[req]) - 1)
            chain, n = self.index[req].propose(min(lookup, room))
            source = self.lookup_stats
            if self.corpus is not None:  # the continuation expected to give more tokens
                other, m = self.corpus.propose(self.index[req].tokens, min(lookup, room))
                if other and sum(self.corpus_stats.path_probs(m, len(other))) > \
                        (sum(self.lookup_stats.path_probs(n, len(chain))) if chain else 0.0):
                    chain, n, source = other, m, self.corpus_stats
            chains.append(chain)
            ngrams.append(n)
            sources.append(source)
        return chains, ngrams, sources

    def learn_continuations(self, state: "Batch", accepted: list[int], paths: list[list[int]]) -> None:
        """What the round's continuations gave (the accepted path's agreeing prefix), to their
        sources' statistics and the call's."""
        stats = self.stats
        for row, (chain, n, new, source) in enumerate(zip(state.chains, state.ngrams, state.chain_new,
                                                          state.chain_stats)):
            if chain:
                path, got = paths[row][1:accepted[row] + 1], 0
                while got < min(len(chain), len(path)) and chain[got] == path[got]:
                    got += 1
                source.update(n, len(chain), got, new)
                stats.lookup_rounds += 1
                stats.lookup_accepted += got
                if source is not self.lookup_stats:
                    stats.corpus_rounds += 1
                    stats.corpus_accepted += got

    def tick(self, phase: str) -> float:
        """Charge the time since the last tick to ``phase``."""
        if self._sync:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats.time[phase] += now - self._clock
        self._clock = now
        return now

    def emit(self, req: int, tokens: list[int]) -> str:
        """Append ``tokens`` to request ``req`` up to where it ends; why it ended ("" if not)."""
        rs, out = self.stats.requests[req], self.generated[req]
        done = emit(out, tokens, self.stop, self.max_new_tokens, self.max_pos, rs.prompt_tokens)
        if self.index is not None:
            self.index[req].extend(out[rs.new_tokens:])
        rs.new_tokens = len(out)
        return done

    def sequences(self, input_ids: torch.Tensor) -> torch.Tensor:
        width = max(len(g) for g in self.generated)
        tail = torch.full((len(self.generated), width), self.pad_id, dtype=torch.int64, device=self.device)
        for b, g in enumerate(self.generated):
            tail[b, :len(g)] = torch.tensor(g, dtype=torch.int64)
        return torch.cat([input_ids.to(self.device), tail], 1)
