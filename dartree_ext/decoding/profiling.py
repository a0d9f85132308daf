"""Measuring the costs :mod:`~dartree_ext.decoding.cost` predicts with, and keeping them: the
cost model's verification curve and drafter times (:func:`measure_cost_model`, timed on the
machine at hand; :func:`cached_cost_model`, kept on disk keyed by everything that changes it:
model config, dtype, device model, threads, torch and library versions), and the target's dtype
and linear layers (:func:`resolve_forward`, measured once and cached)."""
from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence

import torch


from .calibration import isotonic
from .cost import CostModel

log = logging.getLogger(__name__)

COST_MODEL_VERSION = 14  # 2: set-ups with few_rows_linear; 3: its bf16 kernel widens 32 at a time, drafter patched too;
# 4: grouped-query attention without copied keys/values (dartree_ext.attention); 5: the drafter pass
# timed with its context's keys and values kept, as the decoder keeps them; 6: the fastest repetition of
# each point (not the median), and the curve fitted non-decreasing (pooled, not raised to a noisy maximum);
# 7: the points of all contexts timed in a new random order each repetition (not in ascending order);
# 8: attention over few rows by the row-invariant CPU kernel (ops.few_rows_attention);
# 9: few_rows also runs the RMSNorms, rotary embedding and SwiGLU through the per-row ops (dartree_ext.row_layers);
# 10: silu_mul on vector selects (an AVX-512 build; no denormal arm): a row's activation 3-5x cheaper
# 11: each tree size timed in pairs with a plain step, the median of the differences (fit_curve)
# 12: few_rows_linear in bfloat16 prefetches in every pass over a weight block: 7+ rows cheaper
# 13: the flat forward's plan (direct row and block ops, q/k/v and gate/up blocks in one call)
# 14: the layers on GGUF blocks as one C++ loop (_C.DecoderStack); quant_linear_int8 cheaper on short groups
# (which few_rows_linear path runs, avx512 / avx2 / generic, is part of the key itself)
TreeBuilder = Callable[..., object]  # (hidden, base_logits, root, vocab) -> Tree
DEFAULT_NODES = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DEFAULT_CONTEXTS = (64, 512)
CURVE_FITS = ("paired", "fastest")  # see fit_curve


def cache_dir() -> str:
    root = os.environ.get("DARTREE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dartree_ext")
    return os.path.join(root, "cost")


def device_name(device: torch.device | str) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return name


def cpu_bf16_native() -> bool:
    """Whether this CPU has bf16 arithmetic (AMX or avx512_bf16)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def model_digest(model: torch.nn.Module) -> str:
    """A short hash of a model's full config: the architecture part of a cached measurement's key."""
    cfg = model.config.to_json_string(use_diff=False) if hasattr(model.config, "to_json_string") else str(model.config)
    return hashlib.sha256(cfg.encode()).hexdigest()[:16]


def _transformers_version() -> str:
    """The installed transformers' version ("" without it): its modeling code is part of every
    forward a curve times (transformers 5.25 wraps the rotary embedding in a module, for one)."""
    try:
        import transformers
    except ImportError:
        return ""
    return transformers.__version__


def cost_key(target: torch.nn.Module, drafter: torch.nn.Module | None, device: torch.device | str,
             nodes: Sequence[int], contexts: Sequence[int], methods: Sequence[str]) -> dict:
    """What a measured cost model depends on; a change in any of it is a different cache entry."""
    from .. import __version__, build_info
    from ..attention import attention_kind
    from ..flat_forward import flat
    from ..linear import linear_kind
    from ..row_layers import row_layers_used
    kind, drafter_kind = linear_kind(target), linear_kind(drafter) if drafter is not None else None
    few_rows = kind != "torch" or drafter_kind == "few_rows"
    param = next(target.parameters())
    dcfg = json.dumps(drafter.config.to_dict(), sort_keys=True) if drafter is not None and hasattr(
        drafter, "config") and hasattr(drafter.config, "to_dict") else ""
    dparam = next(drafter.parameters()).dtype if drafter is not None and any(True for _ in drafter.parameters()) \
        else None
    return {
        "version": COST_MODEL_VERSION, "dartree_ext": __version__, "torch": torch.__version__,
        "transformers": _transformers_version(),
        "model": model_digest(target), "drafter": hashlib.sha256(dcfg.encode()).hexdigest()[:16],
        "dtype": str(param.dtype).replace("torch.", ""), "drafter_dtype": str(dparam).replace("torch.", ""),
        "device": device_name(device), "threads": torch.get_num_threads() if torch.device(device).type == "cpu" else 0,
        "nodes": list(nodes), "contexts": list(contexts), "methods": sorted(methods),
        "attention": attention_kind(target), "flat_forward": flat(target),
        **({"linear": kind} if kind != "torch" else {}),
        **({"row_layers": True} if row_layers_used(target) else {}),
        **({"drafter_linear": "few_rows"} if drafter_kind == "few_rows" else {}),
        **({"few_rows_linear": build_info().get("few_rows_linear")} if few_rows else {}),
        **({"quant_linear": build_info().get("quant_linear"), "quant_linear_int8": build_info().get("quant_linear_int8")}
           if kind.startswith("gguf") else {}),
    }


def _key_path(key: dict) -> str:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return os.path.join(cache_dir(), f"{digest}.json")


def _drop_last(cache, count: int) -> None:
    """Remove the last ``count`` entries of every layer of a DynamicCache (views: a growing
    layer writes the next entries in place)."""
    for layer in cache.layers:
        layer.keys = layer.keys[..., :-count, :]
        layer.values = layer.values[..., :-count, :]


class _Timer:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)


def _vocab_size(model: torch.nn.Module) -> int:
    cfg = model.config
    return int(cfg.get_text_config().vocab_size if hasattr(cfg, "get_text_config") else cfg.vocab_size)


def _primed_caches(target: torch.nn.Module, contexts: list[int], vocab: int, cache_kw: str,
                   gen: torch.Generator) -> tuple[list, list[torch.Tensor]]:
    """Per context length: a cache holding that many random tokens, and its ``bool[1, ctx]``
    visibility."""
    from .hf import new_cache

    device = next(target.parameters()).device
    caches, pasts = [], []
    for ctx in contexts:
        cache = new_cache(target)  # the loop's cache
        if ctx > 0:
            ids = torch.randint(0, vocab, (1, ctx), generator=gen).to(device)
            target(input_ids=ids, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        caches.append(cache)
        pasts.append(torch.ones(1, ctx, dtype=torch.bool, device=device))
    return caches, pasts


def _curve_samples(target: torch.nn.Module, need_hidden: bool, nodes: list[int], contexts: list[int], reps: int,
                   progress: bool, timer: _Timer, gen: torch.Generator) -> list[dict[int, list[tuple[float, float]]]]:
    """Per context: ``{n: [(plain ms, tree ms), ...]}``, ``reps`` pairs for each ``n > 0`` in ``nodes``:
    the target forward over the root alone and over root + ``n`` nodes, timed back to back (see
    :func:`measure_cost_model`)."""
    from .. import ops
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    vocab = _vocab_size(target)
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    points = [(c, n) for c in range(len(contexts)) for n in nodes if n > 0]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(points) * (reps + 1) * 2, desc="cost model: target", unit="fwd")
    caches, pasts = _primed_caches(target, contexts, vocab, cache_kw, gen)

    def time_point(c: int, n: int) -> float:
        ctx, cache = contexts[c], caches[c]
        parents = (torch.arange(n + 1, dtype=torch.int32) - 1)[None].to(device)
        mask = ops.tree_attention_mask(parents, torch.tensor([n + 1], dtype=torch.int32, device=device),
                                       pasts[c], dtype, validate=False)
        ids = torch.randint(0, vocab, (1, n + 1), generator=gen).to(device)
        pos = torch.arange(ctx, ctx + n + 1, device=device)[None]

        def fwd():
            target(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                   output_hidden_states=need_hidden, **{cache_kw: cache})

        ms = timer(fwd)
        _drop_last(cache, n + 1)
        if bar is not None:
            bar.update(1)
        return ms

    pairs: list[dict[int, list[tuple[float, float]]]] = [{n: [] for n in nodes if n > 0} for _ in contexts]
    for rep in range(reps + 1):  # the first pass warms up
        # every point of every context in a new random order each pass (a slow spell of the machine,
        # or a forward slowed by the one before it, falls on different points each time), each point
        # a plain step and the tree back to back, which goes first flipping from pass to pass: the
        # machine's speed drifts by more than a few nodes cost, and alike over both forwards of a pair
        for i in torch.randperm(len(points), generator=gen).tolist():
            c, n = points[i]
            if (rep + i) % 2:  # each point's order flips from pass to pass; half the points each way a pass
                plain = time_point(c, 0)
                tree = time_point(c, n)
            else:
                tree = time_point(c, n)
                plain = time_point(c, 0)
            if rep:
                pairs[c][n].append((plain, tree))
    if bar is not None:
        bar.close()
    return pairs


def fit_curve(nodes: Sequence[int], pairs: Mapping[int, Sequence[tuple[float, float]]],
              fit: str = "paired") -> list[float]:
    """A verification curve over ``nodes`` (``nodes[0] == 0``) from :func:`_curve_samples`'s pairs.

    * ``"paired"``: the plain step's fastest repetition, plus for each ``n`` the median of its
      pairs' differences (a stall inflates one forward of a pair, a slow minute both), fitted
      non-decreasing (:func:`isotonic`);
    * ``"fastest"``: the fastest repetition of each point on its own (noise only adds time), fitted
      non-decreasing; the plain step's over every pair, so with more samples than each size (its
      differences lean high)."""
    if fit not in CURVE_FITS:
        raise ValueError(f"cost model: fit must be one of {CURVE_FITS}, got {fit!r}")
    if len(nodes) < 2 or nodes[0] != 0:
        raise ValueError(f"cost model: need nodes starting at 0 with a tree size after it, got {list(nodes)}")
    missing = [n for n in nodes[1:] if not pairs.get(n)]
    if missing:
        raise ValueError(f"cost model: no pairs timed for tree sizes {missing}")
    plains = [p for n in nodes[1:] for p, _ in pairs[n]]
    if fit == "fastest":
        return isotonic([min(plains)] + [min(t for _, t in pairs[n]) for n in nodes[1:]])
    base = min(plains)
    extra = isotonic([0.0] + [statistics.median(t - p for p, t in pairs[n]) for n in nodes[1:]])
    return [base + max(e, 0.0) for e in extra]


def _drafter_times(target: torch.nn.Module, drafter: torch.nn.Module, contexts: list[int], methods: Sequence[str],
                   tree_builders: Mapping[str, TreeBuilder] | None, reps: int, timer: _Timer,
                   gen: torch.Generator) -> tuple[float, dict[str, float]]:
    """The drafter pass's ms and each method's tree construction ms (see :func:`measure_cost_model`)."""
    device = next(target.parameters()).device
    vocab = _vocab_size(target)
    tree_ms = {}
    ctx = contexts[-1] if contexts[-1] > 0 else 64
    hidden_size = drafter.config.hidden_size
    wdtype = drafter.dtype
    context = torch.randn(1, ctx, hidden_size, generator=gen).to(device=device, dtype=wdtype)
    cpos = torch.arange(ctx, device=device)[None]
    cmask = torch.ones(1, ctx, dtype=torch.bool, device=device)
    root = torch.randint(0, vocab, (1,), generator=gen).to(device)
    rpos = torch.tensor([ctx], device=device)
    out = None
    # the decoder keeps each committed slot's drafter keys and values (computed once per slot, when
    # it is committed), so a round's pass projects only its block: time it so
    kw = {"context_kv": drafter.context_kv(context, cpos)} if callable(getattr(drafter, "context_kv", None)) else {}

    def draft():
        nonlocal out
        out = drafter(root, rpos, context, cpos, cmask, **kw)

    draft()
    draft_ms = min(timer(draft) for _ in range(reps))
    for method in methods:
        build = (tree_builders or {}).get(method)
        if method == "ar" or build is None:
            continue
        build(out.hidden, out.base_logits, root, out.vocab)
        tree_ms[method] = min(timer(lambda: build(out.hidden, out.base_logits, root, out.vocab)) for _ in range(reps))
    return draft_ms, tree_ms


@torch.no_grad()
def measure_cost_model(target: torch.nn.Module, drafter: torch.nn.Module | None = None,
                       methods: Sequence[str] = ("dartree",), nodes: Sequence[int] = DEFAULT_NODES,
                       contexts: Sequence[int] = DEFAULT_CONTEXTS, reps: int = 10, progress: bool = False,
                       tree_builders: Mapping[str, TreeBuilder] | None = None, fit: str = "paired") -> CostModel:
    """Time this machine: the target forward over root + ``n`` nodes (an additive tree mask, a
    cache of each context length, hidden states out, as a decoding round runs it), the drafter
    pass and each method's tree construction: ``tree_builders[method](hidden, base_logits, root,
    vocab)`` (a :meth:`SpeculativeDecoder.build_tree <dartree_ext.decoding.SpeculativeDecoder.build_tree>`
    at ``max(nodes)`` nodes; methods without a builder get no tree time). Each repetition times
    every (context, n > 0) point once, in a new random order (the machine's speed drifts, and a
    forward can slow the next), as a pair: the plain step and the tree back to back, which goes
    first flipping from one repetition to the next. ``fit`` (:func:`fit_curve`) makes the curve of the pairs: ``"paired"`` (the
    default) adds the median of each size's differences to the plain step's fastest time, so a
    slow minute, which slows both forwards of a pair, does not move it; ``"fastest"`` keeps the
    fastest time of each point on its own. Either is fitted non-decreasing (:func:`isotonic`).
    ``bench/analysis/cost_curve.py`` compares the fits over repeated measurements. An EAGLE-3 drafter's
    drafting (several sequential drafter steps, as many as the decoder's rounds need) is not
    timed here: ``draft_ms`` stays 0 and the decoder prices it by its own drafted rounds
    (:meth:`SpeculativeDecoder._running_costs <dartree_ext.decoding.SpeculativeDecoder>`)."""
    from ..models.eagle3 import Eagle3Drafter
    nodes, contexts = sorted(set(int(n) for n in nodes) | {0}), sorted(set(int(c) for c in contexts))
    param = next(target.parameters())
    device, dtype = param.device, param.dtype
    timer = _Timer(device)
    gen = torch.Generator().manual_seed(0)
    if fit not in CURVE_FITS:
        raise ValueError(f"cost model: fit must be one of {CURVE_FITS}, got {fit!r}")
    if len(nodes) < 2 or reps < 1:
        raise ValueError(f"cost model: need a tree size besides 0 (each is timed against a plain step) and reps >= 1, "
                         f"got nodes {nodes} and reps {reps}")
    pairs = _curve_samples(target, drafter is not None, nodes, contexts, reps, progress, timer, gen)
    verify = [fit_curve(nodes, p, fit) for p in pairs]
    draft_ms, tree_ms = 0.0, {}
    if drafter is not None and not isinstance(drafter, Eagle3Drafter):
        draft_ms, tree_ms = _drafter_times(target, drafter, contexts, methods, tree_builders, reps, timer, gen)
    meta = {"device": device_name(device), "dtype": str(dtype).replace("torch.", ""), "reps": reps,
            "fit": fit,
            "threads": torch.get_num_threads() if device.type == "cpu" else 0, "torch": torch.__version__,
            "bf16_native": cpu_bf16_native() if device.type == "cpu" else None,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return CostModel(nodes=nodes, contexts=contexts, verify_ms=verify, draft_ms=draft_ms, tree_ms=tree_ms, meta=meta)


def cached_cost_model(target: torch.nn.Module, drafter: torch.nn.Module | None = None,
                      methods: Sequence[str] = ("dartree",), nodes: Sequence[int] = DEFAULT_NODES,
                      contexts: Sequence[int] = DEFAULT_CONTEXTS, reps: int = 10, refresh: bool = False,
                      progress: bool = False, tree_builders: Mapping[str, TreeBuilder] | None = None) -> CostModel:
    """:func:`measure_cost_model`, measured once per key (:func:`cost_key`) and kept in
    ``$DARTREE_CACHE/cost/`` (default ``~/.cache/dartree_ext/cost``); ``refresh=True`` re-measures."""
    device = next(target.parameters()).device
    key = cost_key(target, drafter, device, nodes, contexts, methods)
    path = _key_path(key)
    if not refresh and os.path.isfile(path):
        try:
            model = CostModel.load(path)
            if model.meta.get("key") == key:
                return model
        except (OSError, ValueError, TypeError, KeyError) as e:
            log.warning("ignoring an unreadable cost model %s (%s)", path, e)
    log.info("measuring the cost model for %s on %s (once; cached in %s)", key["dtype"], key["device"], path)
    model = measure_cost_model(target, drafter, methods, nodes, contexts, reps, progress, tree_builders)
    model.meta["key"] = key
    model.save(path)
    return model


# choosing the dtype --------------------------------------------------------------------------------
@torch.no_grad()
def forward_ms(model: torch.nn.Module, tokens: int, reps: int, context: int = 64) -> float:
    """Median time (ms) of ``model``'s forward over ``tokens`` new tokens after ``context`` cached ones
    (random ids; each of ``reps`` repetitions on a fresh cache, after one warm-up)."""
    from .hf import additive_mask, new_cache
    param = next(model.parameters())
    timer = _Timer(param.device)
    vocab = int(model.config.vocab_size)
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(0, vocab, (1, context), generator=gen).to(param.device)
    ids = torch.randint(0, vocab, (1, tokens), generator=gen).to(param.device)
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    # as the decoding loops call it: a 4D additive mask (causal over the new tokens) and positions
    visible = torch.ones(1, 1, tokens, context + tokens, dtype=torch.bool, device=param.device)
    visible[..., context:] = torch.ones(tokens, tokens, dtype=torch.bool, device=param.device).tril()
    mask = additive_mask(visible, param.dtype)
    positions = torch.arange(context, context + tokens, device=param.device)[None]
    samples = []
    for rep in range(reps + 1):
        cache = new_cache(model)
        model(input_ids=ctx, use_cache=True, logits_to_keep=1, **{cache_kw: cache})
        ms = timer(lambda: model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                                 **{cache_kw: cache}))
        if rep:
            samples.append(ms)
    return statistics.median(samples)


def choose_forward(model: torch.nn.Module, dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                   linears: Sequence[str] = ("torch", "few_rows"), tokens: Sequence[int] = (1, 9), reps: int = 5,
                   refresh: bool = False) -> tuple[torch.dtype, str, dict]:
    """The fastest target set-up on this machine: a dtype of ``dtypes`` and how the linear layers
    run (``"torch"``, or ``"few_rows"``: :func:`dartree_ext.linear.use_few_rows_linear`), by the
    sum of the forward times over ``tokens`` new tokens (a plain step and a small tree), measured
    on copies of ``model`` (every set-up in turn, ``reps`` times; the median) and cached like the
    cost model. Off the CPU: torch's linear, and
    bfloat16 (if a candidate) without measuring. Returns ``(dtype, linear, {"<dtype>[+few_rows|+amx|+gguf|+gguf_int8]": ms})``
    (``"amx"`` is measured in bfloat16 only)."""
    from .. import __version__, build_info
    from ..attention import attention_kind
    from ..flat_forward import flat
    from ..linear import LINEAR_KINDS
    param = next(model.parameters())
    if not dtypes or not linears:
        raise ValueError("choose_forward needs at least one dtype and one linear")
    for kind in linears:
        if kind not in LINEAR_KINDS:
            raise ValueError(f"linears must be among {', '.join(LINEAR_KINDS)}, got {kind!r}")
    if param.device.type != "cpu":
        linears = ("torch",)
        if torch.bfloat16 in dtypes:
            return torch.bfloat16, "torch", {}
    key = {"kind": "dtype", "version": COST_MODEL_VERSION, "dartree_ext": __version__, "torch": torch.__version__,
           "model": model_digest(model), "device": device_name(param.device),
           "threads": torch.get_num_threads(), "candidates": [str(c) for c in dtypes], "tokens": list(tokens),
           "attention": attention_kind(model), "flat_forward": flat(model), "masked": True}
    if list(linears) != ["torch"]:
        key["linears"] = list(linears)
        key["few_rows_linear"] = build_info().get("few_rows_linear")
    if "amx" in linears:
        key["amx_linear"] = build_info().get("amx_linear")
    if any(k.startswith("gguf") for k in linears):
        key["quant_linear"] = build_info().get("quant_linear")
        key["quant_linear_int8"] = build_info().get("quant_linear_int8")
    path = _key_path(key)
    times = None if refresh else _read_choice(path, key)
    if times is None:
        times = _time_setups(model, dtypes, linears, tokens, reps)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump({"key": key, "ms": times}, f)
    best = min(times, key=times.get)
    name, _, kind = best.partition("+")
    return getattr(torch, name), (kind or "torch"), times


def _read_choice(path: str, key: dict) -> dict | None:
    """The cached forward times of :func:`choose_forward` for ``key``, or ``None``."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            saved = json.load(f)
        return saved["ms"] if saved.get("key") == key else None
    except (OSError, ValueError, KeyError) as e:
        log.warning("ignoring an unreadable dtype choice %s (%s)", path, e)
        return None


def _time_setups(model, dtypes, linears, tokens, reps) -> dict:
    """Median forward ms of every (dtype, linear) set-up, each timed once per repetition in turn
    (so the machine's drift touches all alike), on copies of ``model`` in the other dtypes;
    ``model``'s own linear set-up is restored."""
    import copy

    from ..linear import DEFAULT_MAX_ROWS, few_rows_max_rows, linear_kind, set_linear
    param = next(model.parameters())
    original, max_rows = linear_kind(model), few_rows_max_rows(model)
    samples: dict[str, list[float]] = {}
    try:
        trials = [(dtype, model if param.dtype == dtype else copy.deepcopy(model).to(dtype)) for dtype in dtypes]
        for _ in range(reps):
            for dtype, trial in trials:
                for kind in linears:
                    if kind == "amx" and dtype != torch.bfloat16:  # AMX tiles take bfloat16 only
                        continue
                    set_linear(trial, kind)
                    name = str(dtype).replace("torch.", "") + ("" if kind == "torch" else "+" + kind)
                    samples.setdefault(name, []).append(sum(forward_ms(trial, n, 1) for n in tokens))
    finally:
        set_linear(model, original, max_rows or DEFAULT_MAX_ROWS)
    return {name: statistics.median(values) for name, values in samples.items()}


PLAIN_TOKENS = (1,)  # what a set-up is chosen by for plain decoding: one-token forwards
TREE_TOKENS = (1, 9)  # ... for the tree methods: a plain step (a rest round) and a small tree
# (1, 9, 25) would rate bfloat16 + amx (cheap wide verifications, 270 MB a step) first on a Xeon where
# float32 + gguf decodes as fast: docs/results/flat_forward_amx_xeon.md


def resolve_forward(model: torch.nn.Module, dtype: str | torch.dtype = "auto", linear: str = "auto",
                    tokens: Sequence[int] = TREE_TOKENS) -> tuple[torch.nn.Module, torch.dtype, str, dict]:
    """Apply the target set-up a command line asks for: ``dtype`` (``"auto"``, a dtype name or a
    ``torch.dtype``) and ``linear`` (``"auto"`` or one of ``LINEAR_KINDS``). Each ``"auto"`` is
    :func:`choose_forward`'s pick by the forwards over ``tokens`` new tokens (:data:`TREE_TOKENS`
    for a tree method, :data:`PLAIN_TOKENS` for plain decoding; measured once, cached); off the
    CPU the linear layers are torch's. ``model`` is moved to the dtype in place. Returns ``(model,
    dtype, linear, ms)`` with ``ms`` the measured forward times (``{}`` when nothing was measured)."""
    from ..linear import LINEAR_KINDS, linear_kinds, set_linear
    if linear != "auto" and linear not in LINEAR_KINDS:
        raise ValueError(f"linear must be 'auto' or one of {', '.join(LINEAR_KINDS)}, got {linear!r}")
    if isinstance(dtype, str) and dtype != "auto":
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32' or 'bfloat16', got {dtype!r}")
        dtype = getattr(torch, dtype)
    if next(model.parameters()).device.type != "cpu":
        linear = "torch"
    ms: dict = {}
    if dtype == "auto" or linear == "auto":
        dtypes = (torch.float32, torch.bfloat16) if dtype == "auto" else (dtype,)
        dtype, linear, ms = choose_forward(model, dtypes, linear_kinds(model, auto=True) if linear == "auto" else (linear,),
                                           tokens=tuple(tokens))
    model = model.to(dtype)
    set_linear(model, linear)
    return model, dtype, linear, ms


def choose_dtype(model: torch.nn.Module, candidates: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
                 tokens: Sequence[int] = (1, 9), reps: int = 3, refresh: bool = False) -> tuple[torch.dtype, dict]:
    """The fastest of ``candidates`` for this model on this machine with torch's linear layers
    (:func:`choose_forward` with ``linears=("torch",)``). Returns ``(dtype, {dtype name: ms})``."""
    dtype, _, times = choose_forward(model, candidates, ("torch",), tokens, reps, refresh)
    return dtype, times
