"""One DARTree decoding round with static shapes, for ``torch.compile`` and CUDA graphs.

:class:`StaticRound` runs a whole round as one function of tensors: the drafter pass from each
row's root, :func:`~dartree_ext.tree.build_dartree` (a fixed budget B), the tree-attention mask,
the target's forward over root + B nodes on a transformers ``StaticCache``, ``verify_tree``,
KV compaction of the accepted path, and the drafter's context for it. Every shape is fixed by
(batch, B, cache length), nothing reads a value back to the host, and the library's ops have
fake kernels, so ``torch.compile(fullgraph=True)`` takes the round without a graph break and a
GPU can capture it (``mode="reduce-overhead"``). :meth:`StaticRound.generate` drives it, one
host read per round (the emitted tokens).

What it leaves to :class:`~dartree_ext.decoding.SpeculativeDecoder`: the automatic budget
(a tree size chosen per round needs a host decision), the context-lookup branch, early exit,
the other methods, top-k / top-p sampling, and retiring finished rows (a static batch keeps
them, and their tokens are dropped). Greedy decoding (T = 0) takes the target's argmax;
``temperature > 0`` samples each node's token from ``softmax(logits / T)`` by inverting its
distribution function at a uniform number drawn outside the round (:func:`sample_tokens`), so
verification stays lossless and the round's randomness comes from the caller's generator.

Cache layout. Slot ``j`` of row ``b`` of the target's static cache (and of the drafter's
context keys/values) holds a committed token for ``pad[b] <= j < length[b]``. A round writes
its tree at slots ``write .. write + N - 1`` with ``write = max(length)``, so shorter rows have
a masked gap before their tree; compaction then moves each row's accepted path to
``length[b] ..`` and the gap closes. The drafter's context buffers have one extra slot at the
end, where the rows of a path past its accepted length are written and never read.
"""
from __future__ import annotations

import dataclasses
import inspect
import time
from collections.abc import Sequence

import torch

from .. import ops
from .._widths import depth_widths
from ..models.drafter import BlockDrafter
from ..tree import build_dartree
from .cache import cache_layers
from .config import COMPILED, TREE_DEFAULTS, DecodingConfig, resolve
from .cost import running_average
from .state import PHASES, DecodingStats, RequestStats
from .stopping import Backoff, emit
from .hf import additive_mask, text_config


class StaticRound(torch.nn.Module):
    """``target`` (a transformers causal LM) with a :class:`BlockDrafter`; ``batch_size`` rows of
    ``max_length`` cache slots (the longest prompt + ``max_new_tokens`` + B hold any decode:
    finished rows stop growing). ``budget``, ``width``, ``K``, ``depth_bonus``: :func:`build_dartree`'s B, W, K and
    beta; ``depth``: drafted positions (default: the drafter's block minus the root)."""

    def __init__(self, target: torch.nn.Module, drafter: BlockDrafter, *, max_length: int, batch_size: int = 1,
                 budget: int = COMPILED["budget"], width: int = COMPILED["width"], K: int = COMPILED["K"],
                 depth: int | None = None, depth_bonus: float = TREE_DEFAULTS["depth_bonus"]) -> None:
        super().__init__()
        depth = _checked_depth(target, drafter, depth, budget, width, K, batch_size, max_length)
        self.target, self.drafter = target, drafter
        self.depth, self.budget, self.width, self.K, self.depth_bonus = depth, budget, width, K, depth_bonus
        self.max_length, self.batch_size = max_length, batch_size
        param = next(target.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.head = drafter.export_head(dtype=drafter.dtype)
        if drafter.draft_vocab is not None:
            drafter._draft_head_weight()  # the head's rows over the draft vocabulary, made once here

        self.cache = _static_cache(target, batch_size, max_length, self.dtype, self.device)
        self._cache_tensors = [t for layer in cache_layers(self.cache) for t in (layer.keys, layer.values)]
        dcfg, ddev, ddt = drafter.config, self.device, drafter.dtype
        kv_shape = (batch_size, max_length + 1, 2, dcfg.num_kv_heads, dcfg.head_dim)
        self.context_kv = [torch.zeros(kv_shape, dtype=ddt, device=ddev) for _ in drafter.layers]
        self.valid = torch.zeros(batch_size, max_length + 1, dtype=torch.bool, device=ddev)
        self.length = torch.zeros(batch_size, dtype=torch.int64, device=ddev)
        self.pad = torch.zeros(batch_size, dtype=torch.int64, device=ddev)
        self.root = torch.zeros(batch_size, dtype=torch.int64, device=ddev)
        self.write = torch.zeros((), dtype=torch.int64, device=ddev)
        self.live = torch.ones(batch_size, dtype=torch.bool, device=ddev)  # rows still decoding
        for t in self.context_kv + [self.valid, self.length, self.pad, self.root, self.write, self.live]:
            torch._dynamo.mark_static_address(t)  # updated in place: fixed addresses for CUDA graphs
        self._no_context = drafter.empty_context(batch_size)
        self._root_state = torch.zeros(batch_size, self.head.w_s.shape[1], dtype=self.head.w_s.dtype, device=ddev)
        self._compiled = {}
        params = inspect.signature(target.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.nodes = budget + 1  # root + tree nodes a round verifies (the pruned tree's columns)

    @classmethod
    def from_config(cls, target: torch.nn.Module, drafter: BlockDrafter, config: DecodingConfig,
                    prompts: Sequence[torch.Tensor], max_new_tokens: int) -> "StaticRound":
        """A round for ``config`` (resolved with ``compile=True``: its budget, width, K, depth bonus
        and drafted positions, :data:`~dartree_ext.decoding.config.COMPILED` where not given; the
        depth at most the drafter's block) sized for ``prompts`` and ``max_new_tokens``."""
        config = resolve(dataclasses.replace(config, compile=True, resolved=False) if not config.compile else config)
        if not isinstance(drafter, BlockDrafter):
            raise TypeError(f"compiled rounds need a BlockDrafter, got {type(drafter).__name__}")
        depth = min(config.depth, drafter.config.block_size - 1)  # a drafter with a shorter block
        size = max(p.numel() for p in prompts) + max_new_tokens + config.budget + 2
        return cls(target, drafter, max_length=size, batch_size=len(prompts), budget=config.budget,
                   width=config.width, K=config.K, depth=depth, depth_bonus=config.depth_bonus)

    # prefill ------------------------------------------------------------------------------
    @torch.no_grad()
    def prefill(self, prompts: list[torch.Tensor]) -> None:
        """Start ``batch_size`` prompts (int64 1-D each): every token but the last into the
        caches, left-padded; the last is each row's first root."""
        if len(prompts) != self.batch_size:
            raise ValueError(f"expected {self.batch_size} prompts (batch_size), got {len(prompts)}")
        if any(p.dim() != 1 or p.numel() < 1 for p in prompts):
            raise ValueError("every prompt must be a non-empty 1-D tensor of token ids")
        device, batch, size = self.device, self.batch_size, self.max_length
        prefix = max(p.numel() for p in prompts) - 1
        if prefix + self.nodes > size:
            raise ValueError(f"the longest prompt ({prefix + 1} tokens) leaves no room for a tree of "
                             f"{self.budget + 1} nodes in max_length={size}")
        pad = torch.tensor([prefix - (p.numel() - 1) for p in prompts], dtype=torch.int64, device=device)
        for t in self._cache_tensors + self.context_kv:
            t.zero_()
        self.valid.zero_()
        self.live.fill_(True)
        self.pad.copy_(pad)
        self.length.fill_(prefix)
        self.write.fill_(prefix)
        self.root.copy_(torch.stack([p[-1] for p in prompts]).to(device))
        if prefix == 0:
            return
        ids = torch.zeros(batch, prefix, dtype=torch.int64, device=device)
        for b, p in enumerate(prompts):
            ids[b, int(pad[b]):] = p[:-1].to(device)
        slot = torch.arange(prefix, device=device)
        column = torch.arange(size, device=device)
        visible = (column[None, None, :] <= slot[None, :, None]) & (column[None, None, :] >= pad[:, None, None])
        visible |= column[None, None, :] == slot[None, :, None]  # pad rows see themselves: no NaN
        positions = (slot[None] - pad[:, None]).clamp(min=0)
        self._set_write(torch.zeros((), dtype=torch.int64, device=device))
        out = self.target(input_ids=ids, attention_mask=additive_mask(visible, self.dtype)[:, None],
                          position_ids=positions, cache_position=slot, use_cache=True, output_hidden_states=True,
                          logits_to_keep=1, **self._cache_arg())
        vectors = self.drafter.project_context(self.drafter.target_features(out.hidden_states))
        for buf, kv in zip(self.context_kv, self.drafter.context_kv(vectors, positions)):
            buf[:, :prefix] = kv.to(buf.dtype)
        self.valid[:, :prefix] = slot[None] >= pad[:, None]

    def _cache_arg(self) -> dict:
        return {self._cache_kw: self.cache}

    def _set_write(self, write: torch.Tensor) -> None:
        for layer in self.cache.layers:
            layer.cumulative_length.copy_(write)

    # the round ----------------------------------------------------------------------------
    def forward(self, uniform: torch.Tensor | None = None,
                temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One round. ``uniform float32[B, N]`` in [0, 1) and ``temperature`` (a 0-d tensor):
        sample the target's token at each node (:func:`sample_tokens`); ``None``: greedy.
        Returns ``tokens int64[B, P]`` (P = min(budget, depth) + 1: the accepted draft tokens,
        then the bonus token) and ``count int64[B]`` (how many of them are new: accepted + 1).
        Rows no longer ``live`` (finished) leave their caches as they are."""
        size, batch = self.max_length, self.batch_size
        drafter = self.drafter
        position = self.length - self.pad
        with torch.no_grad():
            block = drafter.config.block_size - 1
            draft = drafter(self.root, position, self._no_context, self.pad.new_zeros(batch, 0), self.valid,
                            context_kv=self.context_kv, positions=None if self.depth == block else self.depth)
            tree = build_dartree(self.head, draft.hidden, draft.base_logits, self.root, self._root_state, k=self.K,
                                 width=self.width, budget=self.budget, depth_bonus=self.depth_bonus, vocab=draft.vocab)
            n = tree.tokens.shape[1]
            slots = self.write + torch.arange(n, device=self.write.device)
            full = ops.tree_attention_mask(tree.parents, tree.num_nodes, self.valid[:, :size].contiguous(), self.dtype,
                                          validate=False)
            mask = full[..., :size].index_copy(3, slots, full[..., size:])
            self._set_write(self.write)
            out = self.target(input_ids=tree.tokens, attention_mask=mask,
                              position_ids=position[:, None] + tree.depths.clamp(min=0).long(),
                              cache_position=slots, use_cache=True, output_hidden_states=True, **self._cache_arg())
            target_tokens = sample_tokens(out.logits, uniform, temperature)
            accept_nodes, accept_len, bonus = ops.verify_tree(tree.tokens, tree.parents, tree.num_nodes, target_tokens,
                                                             validate=False)
            width = min(n, self.depth + 1)
            path_len = accept_len.long() + 1
            lengths = torch.where(self.live, path_len, 0)  # a finished row's caches stay as they are
            step = torch.arange(width, device=lengths.device)
            in_path = step[None] < path_len[:, None]
            nodes = accept_nodes[:, :width].long()
            nodes = torch.where(in_path, nodes, nodes.gather(1, (path_len - 1)[:, None]))
            in_path &= self.live[:, None]
            ops.compact_kv_layers_(self._cache_tensors, self.write + nodes, self.length, lengths.to(torch.int32))
            # the accepted path's context for the drafter (rows past a path go to the spare slot)
            feats = drafter.target_features(out.hidden_states)
            feats = feats.gather(1, nodes[..., None].expand(-1, -1, feats.shape[-1]))
            vectors = drafter.project_context(feats)
            dst = torch.where(in_path, self.length[:, None] + step, size)
            rows = torch.arange(batch, device=dst.device)[:, None].expand(-1, width)
            for buf, kv in zip(self.context_kv, drafter.context_kv(vectors, position[:, None] + step)):
                buf.index_put_((rows, dst), kv.to(buf.dtype))
            self.valid.index_put_((rows, dst), in_path)
            path = tree.tokens.gather(1, nodes)
            tokens = torch.cat([path[:, 1:], bonus[:, None]], 1).scatter(1, accept_len.long()[:, None], bonus[:, None])
            self.length.add_(lengths)
            self.root.copy_(torch.where(self.live, bonus, self.root))
            self.write.copy_(torch.where(self.live, self.length, 0).max())
        return tokens, path_len

    def plain_step(self, uniform: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
                   context: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One plain decoding step on the same caches: no drafter pass, one token per row.
        ``uniform float32[B, 1]`` and ``temperature`` as in :meth:`forward`. ``context``: also add the step's token
        to the drafter's context (the target's hidden states at it), so rounds can follow;
        without it a decode uses plain steps throughout (the baseline a round is measured
        against). Returns ``tokens int64[B, 1]`` and ``count int64[B]`` (ones)."""
        size, batch = self.max_length, self.batch_size
        with torch.no_grad():
            slots = self.write[None]
            position = self.length - self.pad
            visible = self.valid[:, :size].index_fill(1, slots, True)
            self._set_write(self.write)
            out = self.target(input_ids=self.root[:, None], attention_mask=additive_mask(visible, self.dtype)[:, None, None],
                              position_ids=position[:, None], cache_position=slots, use_cache=True,
                              output_hidden_states=context, **self._cache_arg())
            tokens = sample_tokens(out.logits[:, -1:], uniform, temperature)
            ones = torch.ones(batch, dtype=torch.int64, device=tokens.device)
            lengths = self.live.long()  # a finished row's caches stay as they are
            src = self.write.expand(batch)[:, None].contiguous()
            ops.compact_kv_layers_(self._cache_tensors, src, self.length, lengths.to(torch.int32))
            rows = torch.arange(batch, device=tokens.device)
            dst = torch.where(self.live, self.length, size)
            if context:
                vectors = self.drafter.project_context(self.drafter.target_features(out.hidden_states))
                for buf, kv in zip(self.context_kv, self.drafter.context_kv(vectors, position[:, None])):
                    buf.index_put_((rows, dst), kv[:, 0].to(buf.dtype))
            self.valid.index_put_((rows, dst), self.live)
            self.length.add_(lengths)
            self.root.copy_(torch.where(self.live, tokens[:, 0], self.root))
            self.write.copy_(torch.where(self.live, self.length, 0).max())
        return tokens, ones

    def _plain_with_context(self, uniform: torch.Tensor | None = None,
                            temperature: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # A function of its own (not a partial of plain_step): dynamo keys its cache by code
        # object, so the two plain kinds compile as separate functions, each with one version,
        # which is what running them unguarded (_unguarded) relies on.
        return self.plain_step(uniform, temperature, context=True)

    def _step(self, kind: str, compile: bool, mode: str | None):
        """The function of a step kind ("round", "plain", "plain+context"), compiled or not."""
        fn = {"round": self.forward, "plain": self.plain_step, "plain+context": self._plain_with_context}[kind]
        if not compile:
            return fn
        if (mode, kind) not in self._compiled:
            self._compiled[(mode, kind)] = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
        return self._compiled[(mode, kind)]

    def compiled(self, mode: str | None = None, plain: bool = False):
        """:meth:`forward` (or :meth:`plain_step`) under ``torch.compile(fullgraph=True)``
        (``mode``: e.g. ``"reduce-overhead"`` for CUDA graphs on a GPU), compiled once per
        (mode, function) and shape."""
        return self._step("plain" if plain else "round", True, mode)

    # driving it ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[torch.Tensor], max_new_tokens: int, *, temperature: float = 0.0,
                 generator: torch.Generator | None = None, compile: bool = False, mode: str | None = None,
                 eos_token_id: int | Sequence[int] | None = None, plain: bool = False,
                 adaptive: bool = False) -> tuple[list[torch.Tensor], dict]:
        """Decode every prompt for ``max_new_tokens`` tokens (fewer at a stop token in
        ``eos_token_id``, an id or several, which is kept). Returns the new tokens per prompt and
        ``{"rounds", "plain_steps", "tau", "stats"}``: tau is new tokens per call, rounds and plain
        steps together, averaged over rows; ``stats`` the call's
        :class:`~dartree_ext.decoding.state.DecodingStats`, as the eager decoder returns them (per
        request the draft tokens accepted per call and why it finished; the prefill's time, each
        compiled call's under ``verify``, the host's bookkeeping under ``bookkeeping``).
        ``compile``: compiled rounds and steps (:meth:`compiled`); ``plain``: plain steps only
        (:meth:`plain_step`); ``adaptive``: a plain step instead of a round while rounds, by
        their measured tokens per second, do not pay (:class:`_Pacer`: 1, 2, 4 ... 16 plain
        steps, then a round again; the drafter's context is kept through them)."""
        _check_generate(max_new_tokens, temperature, plain, adaptive)
        stops = set() if eos_token_id is None else {eos_token_id} if isinstance(eos_token_id, int) else set(eos_token_id)
        clock = time.perf_counter()
        self.prefill(prompts)
        stats = DecodingStats("ar" if plain else "dartree", [RequestStats(int(p.numel())) for p in prompts],
                              {p: 0.0 for p in PHASES})
        stats.time["prefill"] = time.perf_counter() - clock
        temper = torch.tensor(float(temperature), device=self.device)
        out: list[list[int]] = [[] for _ in prompts]
        counts = {"round": 0, "plain": 0}
        write = int(self.write)
        checked: set[str] = set()  # step kinds that have run once, with their guards, in this call
        pacer = _Pacer() if adaptive else None
        while not all(r.finish_reason for r in stats.requests):
            kind = "plain" if plain else "round" if pacer is None or pacer.round_next() else "plain+context"
            host, seconds = self._call(kind, compile and kind in checked, self._step(kind, compile, mode),
                                       temperature, temper, generator, write)
            clock = time.perf_counter()
            live = [b for b, r in enumerate(stats.requests) if not r.finish_reason]
            if pacer is not None and (kind in checked or not compile):  # a first compiled call compiles
                pacer.observe(kind == "round", sum(host[b][0] for b in live) / len(live), seconds)
            checked.add(kind)
            counts["round" if kind == "round" else "plain"] += 1
            write = self._retire(host, live, out, stats, stops, max_new_tokens, write)
            stats.time["verify"] += seconds
            stats.time["bookkeeping"] += time.perf_counter() - clock
        tau = stats.new_tokens / max(1, stats.rounds)
        return ([torch.tensor(o, dtype=torch.int64) for o in out],
                {"rounds": counts["round"], "plain_steps": counts["plain"], "tau": tau, "stats": stats})

    def _call(self, kind: str, unguarded: bool, fn, temperature: float, temper: torch.Tensor,
              generator: torch.Generator | None, write: int) -> tuple[list[list[int]], float]:
        """One round or plain step (``fn``, compiled or not; ``unguarded``: its guards passed
        earlier in the call): per row, the count of new tokens, the tokens and the row's cache
        length, read in one device-to-host transfer, and the call's seconds."""
        nodes = self.nodes if kind == "round" else 1
        if write + nodes > self.max_length:
            raise RuntimeError(f"the cache is full ({self.max_length} slots): raise max_length")
        args = ()
        if temperature > 0:
            args = (torch.rand(self.batch_size, nodes, generator=generator, device=self.device), temper)
        start = time.perf_counter()
        tokens, count = _unguarded(fn, args) if unguarded else fn(*args)
        host = torch.cat([count[:, None], tokens, self.length[:, None]], 1).tolist()
        return host, time.perf_counter() - start

    def _retire(self, host: list[list[int]], live: list[int], out: list[list[int]], stats: DecodingStats,
                stops: set[int], max_new_tokens: int, write: int) -> int:
        """One call's tokens into each live row's output and statistics (:func:`emit`: a stop token
        or ``max_new_tokens`` finishes a row, whose caches stay but no longer move the write
        slot); the next write slot."""
        for b in live:
            rs = stats.requests[b]
            rs.accepted.append(host[b][0] - 1)
            done = emit(out[b], host[b][1:1 + host[b][0]], stops, max_new_tokens)
            rs.new_tokens = len(out[b])
            if done:
                rs.finish_reason = done
                self.live[b] = False
        live_lengths = [host[b][-1] for b, r in enumerate(stats.requests) if not r.finish_reason]
        if live_lengths and len(live_lengths) < len(live):  # a row finished: the write slot follows the rest
            self.write.fill_(max(live_lengths))
        return max(live_lengths, default=write)


def _check_generate(max_new_tokens: int, temperature: float, plain: bool, adaptive: bool) -> None:
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if plain and adaptive:
        raise ValueError("plain=True runs plain steps only; adaptive=True chooses between them and rounds")


class _Pacer:
    """``generate(adaptive=True)``'s choice between a round and a plain step. It keeps running
    averages of a round's new tokens (weight 0.15: one round's count is noisy), of a round's
    time and of a plain step's (weight 0.3). Once ``MIN_ROUNDS`` rounds are seen, a round whose
    averages give fewer tokens per second than plain steps starts a back-off: the next 1, 2, 4
    ... 16 calls are plain steps (doubling while rounds keep losing), then a round again. The
    first round is followed by one plain step, to measure one."""

    TOKENS_WEIGHT, TIME_WEIGHT, MIN_ROUNDS = 0.15, 0.3, 4

    def __init__(self) -> None:
        self.tokens: float | None = None
        self.round_s: float | None = None
        self.plain_s: float | None = None
        self.rounds = 0
        self.pause = Backoff()

    @property
    def backoff(self) -> int:
        return self.pause.backoff

    def round_next(self) -> bool:
        return not self.pause.rests()

    def observe(self, was_round: bool, tokens: float, seconds: float) -> None:
        if not was_round:
            self.plain_s = running_average(self.plain_s, seconds, self.TIME_WEIGHT)
            return
        self.rounds += 1
        self.tokens = running_average(self.tokens, tokens, self.TOKENS_WEIGHT)
        self.round_s = running_average(self.round_s, seconds, self.TIME_WEIGHT)
        if self.plain_s is None:
            self.pause.skip = 1  # measure a plain step once
        elif self.rounds >= self.MIN_ROUNDS and self.tokens / self.round_s < 1.0 / self.plain_s:
            self.pause.lost()
        else:
            self.pause.paid()


def _unguarded(fn, args: tuple):
    """``fn(*args)`` for a compiled ``fn`` whose guards passed on these same buffers earlier in
    the call, without evaluating dynamo's guards again (2-3 ms a call for a 30-layer target on
    a CPU). Safe only because nothing a guard reads (shapes, dtypes, devices, the module's
    attributes, grad mode) changes within a ``generate`` call: with one compiled version of
    ``fn``, torch runs it unchecked; with several, it checks only what tells them apart, and a
    call matching none raises before running anything (it then runs with its guards). The
    stance is process-wide: not for concurrent use from several threads."""
    try:
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return fn(*args)
    except RuntimeError as err:
        if "skip_guard_eval_unsafe" not in str(err):
            raise
        return fn(*args)


def _checked_depth(target, drafter, depth: int | None, budget: int, width, K: int, batch_size: int,
                   max_length: int) -> int:
    """StaticRound's arguments checked (the drafter attached to ``target``); the drafted depth."""
    if not isinstance(drafter, BlockDrafter):
        raise TypeError(f"StaticRound needs a BlockDrafter, got {type(drafter).__name__}")
    drafter.attach(target)  # raises on a target mismatch
    block = drafter.config.block_size - 1
    depth = block if depth is None else depth
    if not 1 <= depth <= block:
        raise ValueError(f"depth must be in [1, {block}] (the drafter's block minus the root), got {depth}")
    if budget < 1 or width < 1 or K < 1:
        raise ValueError(f"need budget, width and K >= 1, got budget={budget}, width={width}, K={K}")
    depth_widths(width, depth)  # raises on a bad width
    if batch_size < 1 or max_length < budget + 2:
        raise ValueError(f"need batch_size >= 1 and max_length >= budget + 2, got {batch_size} and {max_length}")
    return depth


def _static_cache(target, batch_size: int, max_length: int, dtype: torch.dtype, device: torch.device):
    """A transformers ``StaticCache`` for ``target``, allocated, whose layers keep a tensor write
    offset (where a round places its tree)."""
    from transformers import StaticCache

    cfg = text_config(target)
    heads = cfg.num_key_value_heads or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = StaticCache(config=target.config, max_cache_len=max_length)
    cache.early_initialization(batch_size, heads, head_dim, dtype, device)
    for i, layer in enumerate(cache_layers(cache)):
        if not torch.is_tensor(getattr(layer, "cumulative_length", None)):
            raise NotImplementedError(f"cache layer {i} ({type(layer).__name__}) keeps no tensor write offset "
                                      "(transformers >= 5 StaticCache): cannot place a tree in it")
    return cache


def sample_tokens(logits: torch.Tensor, uniform: torch.Tensor | None = None,
                  temperature: torch.Tensor | None = None) -> torch.Tensor:
    """The target's token at each position of ``logits [..., V]``: the argmax when ``uniform`` is
    None, else a sample of ``softmax(logits / temperature)`` -- the first token whose cumulative
    probability exceeds ``uniform [...]`` (in [0, 1)) times the total, so that one uniform
    number per position, drawn by the caller, is all the randomness (no generator inside a
    compiled graph). Ties and the float32 sum's rounding aside, exact."""
    if uniform is None:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, -1)
    cdf = probs.cumsum(-1)
    point = (uniform * cdf[..., -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, point, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
