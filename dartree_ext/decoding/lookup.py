"""Context lookup: draft continuations copied from the request's own tokens.

A target model often repeats what is already in its context: names and numbers from the prompt,
code identifiers, and (small models, greedy) whole sentences it has written. When the last
tokens of a request (its prompt and what has been generated, ending with the round's root) also
occurred earlier, the tokens that followed that earlier occurrence are a likely continuation
(prompt-lookup decoding). :class:`ContextIndex` finds it in O(1) per round from an n-gram
index kept up to date token by token; :func:`graft_chains` merges each row's continuation into
the round's draft tree as one more branch (sharing the nodes the drafter already proposed), so
the target verifies both in the same forward pass. Verification is unchanged, so decoding stays
lossless at any temperature (the walk follows the target's own token at every node).

:class:`LookupStats` learns online how often a continuation is accepted, per length of the
matched n-gram and depth along the continuation; the decoder keeps a continuation's nodes only
while each one's expected acceptance pays for its verification cost.
"""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from ..tree import Tree

MAX_NGRAM = 4  # longest suffix matched; shorter ones are tried when it does not occur
CORPUS_MAX_NGRAM = 12  # longest suffix of the context matched against a corpus (CorpusIndex)


class ContextIndex:
    """One request's tokens and, for every n-gram (n <= ``max_ngram``) that ends before the last
    token, where it last ended."""

    def __init__(self, tokens: Sequence[int] = (), max_ngram: int = MAX_NGRAM) -> None:
        if max_ngram < 1:
            raise ValueError(f"max_ngram must be >= 1, got {max_ngram}")
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self._last_end: dict[tuple[int, ...], int] = {}
        self._indexed = 0  # n-grams ending at positions < _indexed are in _last_end
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(int(t) for t in tokens)
        toks, last = self.tokens, len(self.tokens) - 1
        for end in range(self._indexed, last):  # never the last token: its successor is unknown
            for n in range(1, min(self.max_ngram, end + 1) + 1):
                self._last_end[tuple(toks[end - n + 1:end + 1])] = end
        self._indexed = max(self._indexed, last)

    def propose(self, length: int) -> tuple[list[int], int]:
        """Up to ``length`` tokens that followed the latest earlier occurrence of the longest
        suffix (at most ``max_ngram`` tokens) that occurred before, and that suffix's length;
        ``([], 0)`` when not even the last token occurred before."""
        toks = self.tokens
        if length < 1 or len(toks) < 2:
            return [], 0
        for n in range(min(self.max_ngram, len(toks) - 1), 0, -1):
            end = self._last_end.get(tuple(toks[-n:]))
            if end is not None:
                return toks[end + 1:end + 1 + length], n
        return [], 0


class LookupStats:
    """P(a continuation's token at depth ``d`` is accepted | the one before it was), per matched
    n-gram length, learned online from a Beta prior of weight ``prior_weight``; in two tables:
    tokens the drafter's tree did not have (new nodes: ``hits`` / ``trials``) and tokens it had
    (``agree_hits`` / ``agree_trials``). The two differ: where the continuation agrees with the
    drafter's tree both are likely right, and where it departs from it the drafter's own node was
    often the right one, so one table over both would price a new node too high. Only new nodes
    add expected tokens to a round (:meth:`AutoBudget.lookup_steps <dartree_ext.decoding.sizing.AutoBudget.lookup_steps>`)."""

    # The prior's centre: depth 1 by n-gram length 1, 2, 3, >= 4, then every depth >= 2; per
    # regime ("greedy": T = 0, "sample": T > 0), rounded from what SmolLM2's decoding learned for
    # new nodes on prompts outside the evaluation tables (`bench/analysis/lookup_stats.py --decode 0|1`).
    PRIORS = {"greedy": ((0.15, 0.45, 0.7, 0.8), 0.75), "sample": ((0.15, 0.2, 0.35, 0.8), 0.6),
              # continuations from a corpus (:class:`CorpusIndex`), by matched length 1..12, rounded
              # from held-out SmolLM2 responses against a corpus of the others (`bench/analysis/corpus_lookup.py`)
              "corpus-greedy": ((0.15, 0.3, 0.4, 0.45, 0.5, 0.55, 0.6, 0.6, 0.6, 0.7, 0.7, 0.8), 0.65),
              "corpus-sample": ((0.1, 0.2, 0.2, 0.25, 0.25, 0.4), 0.25)}
    PRIOR, PRIOR_DEEPER = PRIORS["greedy"]

    def __init__(self, max_depth: int = 16, max_ngram: int | None = None, prior_weight: float = 4.0,
                 regime: str = "greedy") -> None:
        if regime not in self.PRIORS:
            raise ValueError(f"regime must be one of {', '.join(self.PRIORS)}, got {regime!r}")
        if max_ngram is None:  # the longest match its source tries
            max_ngram = CORPUS_MAX_NGRAM if regime.startswith("corpus") else MAX_NGRAM
        self.max_ngram, self.max_depth, self.prior_weight = max_ngram, max_depth, float(prior_weight)
        first, deeper = self.PRIORS[regime]
        rows = [first[min(n, len(first)) - 1] for n in range(1, max_ngram + 1)]
        self.prior = torch.tensor([[r] + [deeper] * (max_depth - 1) for r in rows], dtype=torch.float64)
        self.hits = torch.zeros(max_ngram, max_depth, dtype=torch.float64)
        self.trials = torch.zeros(max_ngram, max_depth, dtype=torch.float64)
        self.agree_hits = torch.zeros(max_ngram, max_depth, dtype=torch.float64)
        self.agree_trials = torch.zeros(max_ngram, max_depth, dtype=torch.float64)

    def conditional(self, ngram: int, agree: bool = False) -> list[float]:
        """Per depth 1..max_depth: P(accepted | the previous continuation token accepted), for
        new nodes, or (``agree``) for tokens the drafter's tree had."""
        i, w = min(ngram, self.max_ngram) - 1, self.prior_weight
        hits, trials = (self.agree_hits, self.agree_trials) if agree else (self.hits, self.trials)
        return ((hits[i] + w * self.prior[i]) / (trials[i] + w)).tolist()

    def path_probs(self, ngram: int, length: int, new: Sequence[bool] | None = None) -> list[float]:
        """P(the first ``d`` continuation tokens are all accepted), d = 1..length; ``new[d - 1]``:
        whether token ``d`` is a new node (default: every one)."""
        out, p = [], 1.0
        novel, agreeing = self.conditional(ngram), self.conditional(ngram, agree=True)
        for d in range(min(length, self.max_depth)):
            p *= novel[d] if new is None or new[d] else agreeing[d]
            out.append(p)
        return out

    def update(self, ngram: int, proposed: int, accepted: int, new: Sequence[bool] | None = None) -> None:
        """A continuation of ``proposed`` tokens verified, its first ``accepted`` accepted;
        ``new[d]``: whether token ``d + 1`` was a new node (default: every one)."""
        if proposed <= 0:
            return
        i = min(ngram, self.max_ngram) - 1
        tried = min(accepted + 1, proposed, self.max_depth)
        for d in range(tried):
            novel = new is None or new[d]
            (self.trials if novel else self.agree_trials)[i, d] += 1
            if d < accepted:
                (self.hits if novel else self.agree_hits)[i, d] += 1


class ChainGraft:
    """Each row's chain (tokens after the root) merged into ``tree`` as a branch: the chain
    follows existing nodes while their tokens agree and continues as new nodes after the row's
    last node (parents stay before children). The walk runs once, on the host; ``added[b][d]`` is
    how many nodes row ``b``'s first ``d + 1`` chain tokens add (what keeping the chain up to there
    costs), and :meth:`tree` builds the grafted tree cut to any number of chain tokens. New nodes
    score ``-inf``: they are not the drafter's."""

    def __init__(self, tree: Tree, chains: Sequence[Sequence[int]]) -> None:
        rows = tree.tokens.shape[0]
        if len(chains) != rows:
            raise ValueError(f"need one chain per row: {len(chains)} chains for {rows} rows")
        self.base, self.chains = tree, chains
        self.added: list[list[int]] = [[] for _ in range(rows)]
        if not any(len(c) for c in chains):
            return
        tokens, parents, depths, self.num = (t.tolist() for t in (tree.tokens, tree.parents, tree.depths,
                                                                    tree.num_nodes))
        self.rows = []
        for b, chain in enumerate(chains):
            n = self.num[b]
            tok, par, dep = tokens[b][:n], parents[b][:n], depths[b][:n]
            child = {(par[i], tok[i]): i for i in range(1, n)}
            cur = 0
            for t in chain:
                t = int(t)
                nxt = child.get((cur, t))
                if nxt is None:
                    nxt = len(tok)
                    tok.append(t)
                    par.append(cur)
                    dep.append(dep[cur] + 1)
                    child[(cur, t)] = nxt
                cur = nxt
                self.added[b].append(len(tok) - n)
            self.rows.append((tok, par, dep))

    def tree(self, steps: int | None = None) -> Tree:
        """The tree with each row's first ``steps`` chain tokens grafted in (all of them for
        ``None``); the base tree itself when that adds nothing."""
        def kept(added: list[int]) -> int:  # nodes the row's kept chain tokens add
            if not added or steps == 0:
                return 0
            return added[-1] if steps is None else added[min(steps, len(added)) - 1]

        keep = [kept(a) for a in self.added]
        if not any(keep):
            return self.base
        rows, dev = len(self.rows), self.base.tokens.device
        lengths = [self.num[b] + keep[b] for b in range(rows)]
        width = max(max(lengths), self.base.tokens.shape[1])

        def padded(field: int, fill: int) -> list[list[int]]:
            return [r[field][:n] + [fill] * (width - n) for r, n in zip(self.rows, lengths)]

        scores = torch.full((rows, width), float("-inf"), device=dev)
        for b in range(rows):
            scores[b, :self.num[b]] = self.base.scores[b, :self.num[b]]
        return Tree(tokens=torch.tensor(padded(0, 0), dtype=torch.int64, device=dev),
                    parents=torch.tensor(padded(1, -1), dtype=torch.int32, device=dev),
                    depths=torch.tensor(padded(2, -1), dtype=torch.int32, device=dev),
                    scores=scores, num_nodes=torch.tensor(lengths, dtype=torch.int32, device=dev))


def graft_chains(tree: Tree, chains: Sequence[Sequence[int]]) -> tuple[Tree, list[list[int]]]:
    """``tree`` with every row's whole chain grafted in, and :attr:`ChainGraft.added`."""
    graft = ChainGraft(tree, chains)
    return graft.tree(), graft.added


CORPUS_FILE = "corpus.npz"  # a drafter directory's corpus (:meth:`CorpusIndex.save`)
_SAMPLED_NEXT = 4096  # past this many occurrences, the next token's counts come from an even sample


def suffix_array(tokens) -> np.ndarray:
    """The suffix array of ``tokens`` (int64[N], any values): int64[N], the suffix start positions
    in lexicographic order of the suffixes (prefix doubling: O(N log^2 N) in NumPy)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    n = len(tokens)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    rank = np.unique(tokens, return_inverse=True)[1].astype(np.int64)
    k = 1
    while True:
        second = np.full(n, -1, dtype=np.int64)
        second[:n - k] = rank[k:]
        order = np.lexsort((second, rank))
        first, nxt = rank[order], second[order]
        fresh = np.empty(n, dtype=bool)
        fresh[0] = True
        fresh[1:] = (first[1:] != first[:-1]) | (nxt[1:] != nxt[:-1])
        rank = np.empty(n, dtype=np.int64)
        rank[order] = np.cumsum(fresh) - 1
        if rank[order[-1]] == n - 1 or k >= n:
            return order
        k *= 2


class _Suffixes:
    """The suffix array as a sorted sequence of byte strings, for :mod:`bisect`: item ``i`` is the
    first ``width`` bytes of suffix ``i`` (``size`` bytes a token, big-endian, so byte order is
    token order). One view per lookup: the width is never changed after construction, so
    lookups in several threads over one index do not interfere."""

    __slots__ = ("data", "sa", "size", "width")

    def __init__(self, data: bytes, sa, size: int, width: int) -> None:
        self.data, self.sa, self.size, self.width = data, sa, size, width

    def __len__(self) -> int:
        return len(self.sa)

    def __getitem__(self, i: int) -> bytes:
        start = int(self.sa[i]) * self.size
        return self.data[start:start + self.width]


class CorpusIndex:
    """Continuations looked up in a fixed corpus of the target's own outputs (retrieval drafting,
    as REST and SuffixDecoding do): a small model answers in the same phrases across requests, so
    the longest suffix of a request's context (at most :data:`CORPUS_MAX_NGRAM` tokens) that
    occurs in the corpus is often followed by what the target writes next. A suffix array over
    the corpus finds that suffix in O(n log N); the continuation then follows, token by token, the
    most frequent next token among the matching occurrences.

    ``sequences`` are the corpus's token lists (each one a separate document: no match crosses
    two); ids must be in ``[0, 2^32 - 1)``."""

    def __init__(self, sequences: Sequence[Sequence[int]] = (), *, _arrays=None) -> None:
        if _arrays is not None:
            tokens, sa = _arrays
        else:
            parts = [np.asarray(list(s), dtype=np.int64) for s in sequences]
            for p in parts:
                if len(p) and (p.min() < 0 or p.max() >= 2 ** 32 - 1):
                    raise ValueError(f"corpus token ids must be in [0, 2^32 - 1), got {int(p.min())}..{int(p.max())}")
            sep = 2 ** 32 - 1
            tokens = np.concatenate([np.append(p, sep) for p in parts]) if parts else np.zeros(0, np.int64)
            sa = suffix_array(tokens)
        self.tokens = np.asarray(tokens, dtype=np.int64)
        self.sa = np.asarray(sa, dtype=np.int64)
        if self.tokens.shape != self.sa.shape:
            raise ValueError(f"a corpus needs one suffix per token: {len(self.tokens)} tokens, {len(self.sa)} suffixes")
        self.separator = 2 ** 32 - 1
        self._bytes = self.tokens.astype(">u4").tobytes()

    @property
    def documents(self) -> int:
        return int((self.tokens == self.separator).sum())

    def __len__(self) -> int:
        """Tokens in the corpus, separators included."""
        return len(self.tokens)

    def save(self, path: str) -> None:
        """Tokens and suffix array in one ``.npz`` (uint16 tokens where every id fits)."""
        tokens = self.tokens
        small = len(tokens) == 0 or int(tokens[tokens != self.separator].max(initial=0)) < 2 ** 16 - 1
        stored = np.where(tokens == self.separator, 2 ** 16 - 1, tokens).astype(np.uint16) if small else \
            tokens.astype(np.uint32)
        np.savez_compressed(path, tokens=stored, sa=self.sa.astype(np.int32 if len(tokens) < 2 ** 31 else np.int64))

    @classmethod
    def load(cls, path: str) -> "CorpusIndex":
        with np.load(path) as f:
            stored, sa = f["tokens"], f["sa"]
        sep = 2 ** 16 - 1 if stored.dtype == np.uint16 else 2 ** 32 - 1
        tokens = stored.astype(np.int64)
        tokens[tokens == sep] = 2 ** 32 - 1
        return cls(_arrays=(tokens, sa))

    def _range(self, pattern: Sequence[int], lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        """Suffix-array rows ``[lo, hi)`` of the suffixes that start with ``pattern``."""
        key = b"".join(int(t).to_bytes(4, "big") for t in pattern)
        suffixes = _Suffixes(self._bytes, self.sa, 4, len(key))
        hi = len(suffixes) if hi is None else hi
        first = bisect.bisect_left(suffixes, key, lo, hi)
        return first, bisect.bisect_right(suffixes, key, first, hi)

    def longest_match(self, context: Sequence[int], max_ngram: int = CORPUS_MAX_NGRAM) -> tuple[int, int, int]:
        """The longest suffix of ``context`` (at most ``max_ngram`` tokens) in the corpus: its
        length ``n`` and suffix-array rows ``[lo, hi)`` (``(0, 0, 0)`` if not even the last token
        occurs). A suffix occurs only if every shorter one does, so ``n`` is found by bisection."""
        top = min(max_ngram, len(context))
        found, rows = 0, (0, 0)
        low, high = 1, top
        while low <= high:
            mid = (low + high) // 2
            lo, hi = self._range(context[len(context) - mid:])
            if hi > lo:
                found, rows, low = mid, (lo, hi), mid + 1
            else:
                high = mid - 1
        return found, rows[0], rows[1]

    def propose(self, context: Sequence[int], length: int, max_ngram: int = CORPUS_MAX_NGRAM) -> tuple[list[int], int]:
        """Up to ``length`` tokens continuing the longest suffix of ``context`` found in the
        corpus, each the most frequent next token among the occurrences that match so far (ties:
        the smallest id), and that suffix's length; ``([], 0)`` when nothing matches."""
        if length < 1 or not len(context) or not len(self.tokens):
            return [], 0
        n, lo, hi = self.longest_match(context, max_ngram)
        if n == 0:
            return [], 0
        pattern, out = [int(t) for t in context[len(context) - n:]], []
        while len(out) < length:
            if hi - lo == 1:  # one occurrence left: what follows it, up to its document's end
                start = int(self.sa[lo]) + len(pattern)
                rest = self.tokens[start:start + length - len(out)].tolist()
                return out + rest[:rest.index(self.separator)] if self.separator in rest else out + rest, n
            rows = self.sa[lo:hi] if hi - lo <= _SAMPLED_NEXT else \
                self.sa[np.linspace(lo, hi - 1, _SAMPLED_NEXT).astype(np.int64)]
            at = rows + len(pattern)
            nxt = self.tokens[at[at < len(self.tokens)]]
            if not len(nxt):
                break
            values, counts = np.unique(nxt, return_counts=True)
            tok = int(values[int(counts.argmax())])
            if tok == self.separator:
                break
            out.append(tok)
            pattern.append(tok)
            lo, hi = self._range(pattern, lo, hi)
        return out, n


def new_nodes(added: Sequence[int]) -> list[bool]:
    """Whether each continuation token is a new node, from :class:`ChainGraft`'s cumulative
    counts of the nodes its first ``d + 1`` tokens add."""
    return [a > (added[d - 1] if d else 0) for d, a in enumerate(added)]
