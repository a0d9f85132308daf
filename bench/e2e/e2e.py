"""End-to-end decoding benchmark: every method on the same prompts, side by side in one run.

Per prompt set and temperature, per method: tau (tokens per round, micro and macro average),
time per token, speedup over ``ar`` (ratio of decoding time per token, measured in this run),
the round-time split, mean verified tree size, peak memory where CUDA reports it, and whether the
output equals ``ar``'s (at T = 0 it must: the script exits 1 otherwise).

    python bench/e2e/e2e.py                                   # tiny built-in target, random drafter
    python bench/e2e/e2e.py --drafter oracle                  # a drafter that knows ar's output (high tau)
    python bench/e2e/e2e.py --target smollm2 --drafter DIR --sets gsm8k,humaneval,mtbench \\
        --num-prompts 10 --temperatures 0,1 --json bench/results/e2e.json
    python bench/e2e/e2e.py ... --sweep width=4,8,12,16 --methods dartree   # tau vs W (also budget=, beta=)
    python bench/e2e/e2e.py ... --drafter vat=DIR1,dflash=DIR2 --methods chain,dartree  # drafters side by side
    python bench/e2e/e2e.py ... --methods dartree,dartree/attention=packed   # the target's attention, A/B

With several drafters (``label=DIR,...``) every method runs once per drafter, named
``method@label``. The run ends with a summary over the sets: per method and temperature, the mean
over sets of tau and of the speedup (what the README tables quote).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections import Counter

import torch

import dartree_ext.attention as attention_module
from dartree_ext.attention import restore_sdpa_attention, use_packed_attention
from dartree_ext.decoding import METHODS, SpeculativeDecoder, left_pad
from dartree_ext.decoding.decoder import AUTO_METHODS, drafter_fits
from dartree_ext.decoding.profiling import resolve_forward
from dartree_ext.linear import LINEAR_KINDS
from dartree_ext.loading import encode_prompt, load_corpus, load_drafter, load_target, stop_tokens
from dartree_ext.models import LookupDrafter, oracle_stop_rule
from dartree_ext.decoding.config import CORPUS_OFF, DEFAULT_BUDGET, TREE_DEFAULTS, DecodingConfig
from dartree_ext.cli import add_decoding_args, budget_arg, early_exit_arg
from dartree_ext.tree import parse_width

KERNEL_DEFAULT = attention_module.USE_FEW_ROWS_KERNEL  # DARTREE_FEW_ROWS_ATTENTION=0 turns the kernel off
DEFAULT_PROMPTS = [
    "Write a function that returns the n-th Fibonacci number.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many?",
    "Explain why the sky is blue in two sentences.",
    "List three uses of a binary heap.",
]


@dataclasses.dataclass
class Params:
    """One row's settings: the decoding ones (:meth:`config` makes the row's
    :class:`~dartree_ext.decoding.config.DecodingConfig` of them) and the bench's own
    (``attention``, ``early_exit="oracle"``, ``corpus`` as on/off/auto)."""
    budget: int | str = DEFAULT_BUDGET  # B, or "auto" (per-round size from the cost model)
    # None: the method's default (dartree_ext.decoding.config: W = 12, K = 64, beta = -0.2)
    width: int | tuple[int, ...] | None = None  # W, or per-depth widths (the last repeats)
    K: int | None = None
    depth_bonus: float | None = None
    early_exit: float | str | None = None  # the verification head's threshold p (None: no early exit); "oracle":
                                           # eagle3_vh stops at the true first rejection (T = 0, ar's outputs)
    estimator: str | None = None        # budget="auto": node acceptance from "score", "adaptive" or "vh"
    lookup: int | None = None           # context-lookup continuation tokens per round (None: the method's default)
    sampled_draft: int = 0              # chain at T > 0: draw each depth's token from the drafter, speculative sampling
    corpus: str = "auto"                # the drafter directory's corpus.npz with the lookup branch: "auto" at T = 0
                                        # (as dartree-generate), "on" (or "1") at any T, "off" (or "0") never
    # the target's attention: "kernel" (dartree_ext.attention: the row-invariant CPU kernel, else
    # packed SDPA), "packed" (packed SDPA only) or "sdpa" (transformers' own)
    attention: str = "kernel"
    max_budget: int | None = None       # budget="auto": nodes built before the cut (None: 64)

    def config(self, method: str, corpus: bool, early_exit=None) -> DecodingConfig:
        """The row's config for ``method`` (``corpus``: whether a corpus index is handed to the
        decoder; ``early_exit``: the stop rule standing in for ``"oracle"``)."""
        return DecodingConfig(method=method, budget=self.budget, width=self.width, K=self.K, max_budget=self.max_budget,
                              depth_bonus=self.depth_bonus,
                              early_exit=early_exit if self.early_exit == "oracle" else self.early_exit,
                              estimator=self.estimator, lookup=self.lookup if method != "ar" else None,
                              corpus="given" if corpus else CORPUS_OFF, corpus_sampling=self.corpus in ("on", "1"),
                              sampled_draft=True if self.sampled_draft else None)


def _or(value, name: str):
    """A flag's value, or the default the decoder fills in for it."""
    return TREE_DEFAULTS[name] if value is None else value


def prompt_sets(names: str, num: int | None) -> dict[str, list[str]]:
    sets = {}
    for name in [n for n in names.split(",") if n]:
        if name == "default":
            texts = DEFAULT_PROMPTS
        elif os.path.isfile(name):
            with open(name) as f:
                texts = [line.rstrip("\n") for line in f if line.strip()]
            name = os.path.basename(name)
        else:
            from dartree_ext.data import prompts as shipped
            texts = [p.text for p in getattr(shipped, name)()]
        sets[name] = texts[:num] if num else texts
    return sets


def oracle_misfit(method: str, params: Params, temperature: float) -> bool:
    """``early_exit=oracle`` where it cannot run: it follows ar's greedy outputs, so only
    ``eagle3_vh`` at T = 0."""
    return params.early_exit == "oracle" and (method != "eagle3_vh" or temperature != 0)


class Runner:
    """One method on the prompt groups, one group per :meth:`step`, so every method can run on a
    group before any runs on the next (interleaved: the machine's drift affects all alike)."""

    def __init__(self, target, drafter, method: str, params: Params, temperature: float, max_new_tokens: int,
                 stops: list[int], device: str, seed: int = 0, corpus=None) -> None:
        if params.attention not in ("kernel", "packed", "sdpa"):
            raise SystemExit(f"attention must be 'kernel', 'packed' or 'sdpa', got {params.attention!r}")
        if params.corpus not in ("auto", "on", "off", "1", "0"):
            raise SystemExit(f"corpus must be 'auto', 'on' (1) or 'off' (0), got {params.corpus!r}")
        self.oracle_exit = params.early_exit == "oracle"
        if oracle_misfit(method, params, temperature):
            raise SystemExit("early_exit=oracle is for eagle3_vh at T = 0 (the stop rule follows ar's greedy outputs)")
        self.references = None  # early_exit=oracle: g -> the group's reference sequences (set by main)
        corpus = corpus if params.corpus not in ("off", "0") and method != "ar" else None
        self.dec = SpeculativeDecoder.from_config(
            target, drafter, params.config(method, corpus is not None, oracle_stop_rule([])), corpus=corpus)
        self.method, self.params, self.temperature = method, params, temperature
        self.max_new_tokens, self.stops, self.device, self.seed = max_new_tokens, stops, device, seed
        self.seconds = self.tokens = self.rounds = self.accepted = 0
        self.split, self.hist, self.depth_nodes = Counter(), Counter(), Counter()
        self.nodes, self.taus, self.outputs = [], [], []
        self.peak = 0.0
        self.plain, self.auto = 0, Counter()  # budget="auto": plain rounds; prediction vs measurement

    def step(self, g: int, group: list[list[int]]) -> None:
        # the target attends as this row asks (an A/B inside one run: dartree/attention=packed)
        (restore_sdpa_attention if self.params.attention == "sdpa" else use_packed_attention)(self.dec.target)
        attention_module.USE_FEW_ROWS_KERNEL = self.params.attention == "kernel" and KERNEL_DEFAULT
        ids, mask = left_pad(group)
        if self.oracle_exit:
            self.dec.early_exit = oracle_stop_rule(self.references(g))
        gen = torch.Generator(device=self.device).manual_seed(self.seed + g)
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        out = self.dec.generate(ids, mask, max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                stop_token_ids=self.stops, generator=gen)
        if self.device == "cuda":
            self.peak = max(self.peak, torch.cuda.max_memory_allocated() / 2 ** 20)
        st = out.stats
        self.seconds += st.total_time - st.time["prefill"]
        self.tokens += st.new_tokens
        self.rounds += st.rounds
        self.accepted += sum(sum(r.accepted) for r in st.requests)
        self.taus += [r.tau for r in st.requests if r.rounds]
        self.nodes += st.tree_nodes
        self.hist.update(a for r in st.requests for a in r.accepted)
        self.depth_nodes.update(st.nodes_per_depth)
        self.split.update(st.time)
        self.plain += st.plain_rounds
        self.auto.update(rounds=st.auto_rounds, predicted_tokens=st.predicted_tokens, predicted_ms=st.predicted_ms,
                         measured_tokens=st.measured_tokens, measured_ms=st.measured_ms)
        self.outputs.append([out.sequences[b, ids.shape[1]:ids.shape[1] + r.new_tokens].tolist()
                             for b, r in enumerate(st.requests)])

    def result(self) -> dict:
        rounds, split = self.rounds, self.split
        return dict(method=self.method, temperature=self.temperature, params=dataclasses.asdict(self.params),
                    tau=self.accepted / rounds + 1 if rounds else 0.0,
                    tau_macro=sum(self.taus) / len(self.taus) if self.taus else 0.0,
                    seconds=self.seconds, tokens=self.tokens, rounds=rounds,
                    ms_per_token=1e3 * self.seconds / max(1, self.tokens),
                    mean_tree_nodes=sum(self.nodes) / max(1, len(self.nodes)),
                    split={k: v / max(1e-12, sum(split.values())) for k, v in split.items()},
                    accept_hist={int(k): v for k, v in sorted(self.hist.items())},
                    nodes_per_depth={int(k): v / max(1, rounds) for k, v in sorted(self.depth_nodes.items())},
                    plain_rounds=self.plain, auto_check=dict(self.auto) if self.auto.get("rounds") else None,
                    peak_mib=self.peak if self.device == "cuda" else None, outputs=self.outputs)


def run(target, drafter, method: str, groups: list[list[list[int]]], params: Params, temperature: float,
        max_new_tokens: int, stops: list[int], device: str, seed: int = 0) -> dict:
    """One method on every group (see :class:`Runner`)."""
    runner = Runner(target, drafter, method, params, temperature, max_new_tokens, stops, device, seed)
    for g, group in enumerate(groups):
        runner.step(g, group)
    return runner.result()


class HFRunner:
    """HF ``generate`` on the same prompts (greedy, or sampling at T > 0), timed like
    :class:`Runner` and stepped with it, one group at a time between the methods: the baseline
    that shows the ``ar`` loop is not a slow strawman. ``prompt_lookup=N``: HF's own prompt-lookup
    decoding (``prompt_lookup_num_tokens=N``), row ``hf_prompt_lookup``."""

    def __init__(self, target, temperature: float, max_new_tokens: int, stops: list[int], device: str,
                 seed: int = 0, prompt_lookup: int | None = None) -> None:
        self.target, self.temperature, self.max_new_tokens = target, temperature, max_new_tokens
        self.stops, self.device, self.seed, self.prompt_lookup = stops, device, seed, prompt_lookup
        self.seconds = self.tokens = 0
        self.outputs = []

    def step(self, g: int, group: list[list[int]]) -> None:
        import time
        use_packed_attention(self.target)  # (its masks are bool or None: SDPA's path, not the kernel)
        attention_module.USE_FEW_ROWS_KERNEL = KERNEL_DEFAULT
        ids, mask = left_pad(group, device=self.device)
        stops = self.stops
        kw = dict(max_new_tokens=self.max_new_tokens, attention_mask=mask, eos_token_id=stops or None,
                  pad_token_id=stops[0] if stops else 0)
        if self.prompt_lookup:
            kw["prompt_lookup_num_tokens"] = self.prompt_lookup
        if self.temperature > 0:
            kw.update(do_sample=True, temperature=self.temperature, top_k=0, top_p=1.0)
        else:
            kw.update(do_sample=False)

        def timed(n):
            if self.temperature > 0:
                torch.manual_seed(self.seed + g)
            if self.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            with torch.no_grad():
                seq = self.target.generate(ids, **dict(kw, max_new_tokens=n))
            if self.device == "cuda":
                torch.cuda.synchronize()
            return seq, time.perf_counter() - start

        _, first = timed(1)        # prefill + the first token: left out, as the decoder's prefill is
        seq, total = timed(self.max_new_tokens)
        outs = []
        for row in seq[:, ids.shape[1]:].tolist():  # up to and including the first stop token, as the decoder
            cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            outs.append(row[:cut])
        self.seconds += max(0.0, total - first)
        self.tokens += sum(len(o) for o in outs) - len(outs)
        self.outputs.append(outs)

    def result(self) -> dict:
        return dict(method="hf_prompt_lookup" if self.prompt_lookup else "hf_generate", temperature=self.temperature,
                    params={}, tau=1.0, tau_macro=1.0, seconds=self.seconds, tokens=self.tokens, rounds=self.tokens,
                    ms_per_token=1e3 * self.seconds / max(1, self.tokens), mean_tree_nodes=0.0, split={},
                    accept_hist={}, nodes_per_depth={}, peak_mib=None, outputs=self.outputs)


class LlamaCppRunner:
    """llama.cpp's plain greedy decoding (llama-cpp-python) of the same prompts, same threads, on
    the target's GGUF (or ``path``), stepped with the other runners; row ``llama_cpp``, timed past
    the first token as the others. Its outputs are compared with ``ar``'s but never fail the run
    (llama.cpp multiplies Q4_1 weights by 8-bit activations)."""

    def __init__(self, path: str, max_new_tokens: int, stops: list[int]) -> None:
        from dartree_ext.llama_cpp import LlamaCppBaseline
        self.base, self.max_new_tokens, self.stops = LlamaCppBaseline(path), max_new_tokens, stops
        self.seconds = self.tokens = 0
        self.outputs = []
        self.warm = False

    def step(self, g: int, group: list[list[int]]) -> None:
        outs = []
        for prompt in group:
            if not self.warm:
                self.base.generate(prompt, 2, self.stops)
                self.warm = True
            run = self.base.generate(prompt, self.max_new_tokens, self.stops)
            self.seconds += run.total_s - run.first_s
            self.tokens += len(run.tokens) - 1
            outs.append(run.tokens)
        self.outputs.append(outs)

    def result(self) -> dict:
        return dict(method="llama_cpp", temperature=0.0, params={}, tau=1.0, tau_macro=1.0, seconds=self.seconds,
                    tokens=self.tokens, rounds=self.tokens, ms_per_token=1e3 * self.seconds / max(1, self.tokens),
                    mean_tree_nodes=0.0, split={}, accept_hist={}, nodes_per_depth={}, peak_mib=None,
                    outputs=self.outputs)


def first_divergence(outputs: list, reference: list) -> list:
    """Per response: the index of the first token that differs from the reference (None if equal)."""
    firsts = []
    for group, ref_group in zip(outputs, reference):
        for out, ref in zip(group, ref_group):
            i = next((j for j, (a, b) in enumerate(zip(out, ref)) if a != b), None)
            if i is None and len(out) != len(ref):
                i = min(len(out), len(ref))
            firsts.append(i)
    return firsts


def method_params(spec: str, params: Params) -> tuple[str, Params]:
    """``method`` or ``method/name=value`` (one parameter overridden for that method alone, e.g.
    ``dartree/lookup=0``; the row keeps the whole spec as its name)."""
    method, sep, override = spec.partition("/")
    if not sep:
        return method, params
    name, eq, value = override.partition("=")
    if not eq or name not in {f.name for f in dataclasses.fields(Params)}:
        raise SystemExit(f"--methods: expected method/name=value with a Params field, got {spec!r}")
    return method, dataclasses.replace(params, **{name: param_kind(name, params)(value)})


def param_kind(name: str, params: Params):
    """How a command-line value of Params field ``name`` is parsed (sweeps and overrides)."""
    if name == "width":
        return lambda v: parse_width(v.replace("/", ","))
    return {"budget": budget_arg, "early_exit": lambda v: v if v == "oracle" else early_exit_arg(v),
            "lookup": int, "K": int, "depth_bonus": float, "estimator": str}.get(name, type(getattr(params, name)))


def parse_drafters(spec: str) -> list[tuple[str, str]]:
    """``random`` / ``oracle`` / ``DIR`` -> one unlabelled drafter; ``a=DIR1,b=DIR2`` -> several."""
    if "=" not in spec:
        return [("", spec)]
    pairs = []
    for item in spec.split(","):
        label, sep, path = item.partition("=")
        if not sep or not label or not path:
            raise SystemExit(f"--drafter: expected label=DIR[,label=DIR...], got {item!r}")
        pairs.append((label, path))
    if len({label for label, _ in pairs}) != len(pairs):
        raise SystemExit(f"--drafter: repeated label in {spec!r}")
    return pairs


def summarize(results: list[dict]) -> list[dict]:
    """Mean over prompt sets of tau, macro tau and speedup, per (method, temperature)."""
    groups: dict[tuple[str, float], list[dict]] = {}
    for r in results:
        groups.setdefault((r["method"], r["temperature"]), []).append(r)
    rows = []
    for (method, temperature), rs in groups.items():
        n = len(rs)
        rows.append(dict(method=method, temperature=temperature, sets=[r["set"] for r in rs],
                         tau={r["set"]: r["tau"] for r in rs}, mean_tau=sum(r["tau"] for r in rs) / n,
                         mean_tau_macro=sum(r["tau_macro"] for r in rs) / n,
                         mean_speedup=sum(r["speedup"] for r in rs) / n,
                         prompts=sum(r["prompts"] for r in rs),
                         all_same_as_ar=all(r["same_as_ar"] for r in rs) if temperature == 0 else None))
    return rows


def print_summary(rows: list[dict]) -> None:
    print("\n[summary: mean over sets]")
    print(f"{'method':28s} {'T':>4s} {'prompts':>7s} {'mean_tau':>8s} {'tau_mac':>7s} {'speedup':>7s} same_as_ar  per set")
    for r in rows:
        per_set = " ".join(f"{k}={v:.3f}" for k, v in r["tau"].items())
        print(f"{r['method']:28s} {r['temperature']:4g} {r['prompts']:7d} {r['mean_tau']:8.3f} "
              f"{r['mean_tau_macro']:7.3f} {r['mean_speedup']:7.3f} {str(r['all_same_as_ar']):10s} {per_set}")


def print_table(title: str, results: list[dict]) -> None:
    ar = next(r for r in results if r["method"] == "ar")
    print(title)
    print(f"{'method':16s} {'tau':>6s} {'tau_mac':>7s} {'ms/tok':>8s} {'speedup':>7s} {'nodes':>6s} "
          f"{'draft':>6s} {'tree':>6s} {'verify':>6s} {'book':>6s} {'peakMiB':>8s} same_as_ar")
    for r in results:
        s = r["split"]
        peak = f"{r['peak_mib']:8.1f}" if r["peak_mib"] is not None else f"{'-':>8s}"
        print(f"{r['method']:16s} {r['tau']:6.3f} {r['tau_macro']:7.3f} {r['ms_per_token']:8.3f} {r['speedup']:7.3f} "
              f"{r['mean_tree_nodes']:6.1f} {s.get('draft', 0):6.1%} {s.get('tree', 0):6.1%} "
              f"{s.get('verify', 0):6.1%} {s.get('bookkeeping', 0):6.1%} {peak} {r['same_as_ar']}")
    del ar


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny", help="'tiny', 'smollm2' or a local HF model directory")
    parser.add_argument("--drafter", default="random",
                        help="a drafter directory (block or EAGLE-3), 'random', 'random-eagle3', 'oracle' (knows ar's outputs), "
                             "or label=DIR,label=DIR,... to compare drafters (each method runs with the drafters of its kind)")
    parser.add_argument("--oracle-miss", type=float, default=0.3)
    parser.add_argument("--sets", default="default", help="comma list: default, gsm8k, humaneval, mtbench, or files")
    parser.add_argument("--num-prompts", type=int, default=None, help="first N prompts of each set")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--temperatures", default="0")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_decoding_args(parser, budget_default=64, presets=False)
    parser.add_argument("--sweep", default=None, help="name=v1,v2,... over width, budget, depth_bonus, early_exit "
                        "(none = off), lookup or estimator (per-depth widths in a sweep: width=12,32/12)")
    parser.add_argument("--batch", action="store_true", help="decode each set as one batch (default: one by one)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])  # (--linear gguf: the GGUF's blocks)
    parser.add_argument("--hf", action="store_true", help="also time HF generate on the same prompts (row "
                        "'hf_generate': the time past the first token, as the decoder's rows leave prefill out)")
    parser.add_argument("--hf-lookup", type=int, default=None, metavar="N",
                        help="also time HF generate with its prompt-lookup decoding (prompt_lookup_num_tokens=N; "
                             "row 'hf_prompt_lookup')")
    parser.add_argument("--llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                        help="also time llama.cpp's plain greedy decoding (llama-cpp-python; row 'llama_cpp', at T = 0) "
                             "on GGUF (default: the target's own, SmolLM2's shipped Q4_1)")
    parser.add_argument("--draft-vocab", default="on", choices=["on", "off", "both"],
                        help="use the drafter's saved draft vocabulary (draft_vocab.json), ignore it, or run both "
                             "(the second labelled '@fullvocab')")
    parser.add_argument("--linear", default="auto", choices=["auto", *LINEAR_KINDS],
                        help="the target's linear layers on a CPU (as dartree-generate --linear): 'auto' measures "
                             "torch's GEMM against few_rows_linear in --dtype once (cached); every row, ar "
                             "included, runs the same target")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None, help="write every result (without outputs) here")
    args = parser.parse_args(argv)

    loaded = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
    target, tok = loaded.target, loaded.tokenizer
    target, _, args.linear, _ = resolve_forward(target, target.dtype, args.linear)
    stops = stop_tokens(tok, target)
    methods = [m for m in args.methods.split(",") if m and m != "ar"]
    drafters, corpora = [], {}
    for label, spec in parse_drafters(args.drafter):
        path = None if spec in ("random", "random-eagle3", "oracle") else spec
        corpora[label] = corpora[f"{label}fullvocab"] = load_corpus(path)
        eagle3 = spec == "random-eagle3"
        if args.draft_vocab in ("on", "both"):
            drafters.append((label, load_drafter(path, target, eagle3=eagle3)))
        if args.draft_vocab in ("off", "both"):
            drafters.append((f"{label}fullvocab" if args.draft_vocab == "both" else label,
                             load_drafter(path, target, draft_vocab=False, eagle3=eagle3)))
    oracle = args.drafter == "oracle"
    temps = [float(t) for t in args.temperatures.split(",")]
    base_params = Params(args.budget, args.width, args.K, args.depth_bonus, args.early_exit, args.estimator,
                         args.lookup, max_budget=args.max_budget)
    variants = [base_params]
    if args.sweep:
        name, values = args.sweep.split("=")
        name = {"W": "width", "B": "budget", "beta": "depth_bonus"}.get(name, name)
        kind = param_kind(name, base_params)
        variants = [dataclasses.replace(base_params, **{name: kind(v)}) for v in values.split(",")]
    print(f"target={loaded.name} drafter={args.drafter} device={args.device} dtype={args.dtype} linear={args.linear} "
          f"max_new_tokens={args.max_new_tokens} threads={torch.get_num_threads()} "
          f"batch={'set' if args.batch else 1}")

    everything, failed = [], []
    for set_name, texts in prompt_sets(args.sets, args.num_prompts).items():
        prompts = [encode_prompt(tok, t) for t in texts]
        groups = [prompts] if args.batch else [[p] for p in prompts]
        # warm-up: one-time costs (allocator, first kernel calls) stay out of the figures
        warm = "dartree" if drafter_fits("dartree", drafters[0][1]) else "eagle3"
        SpeculativeDecoder(target, drafters[0][1], warm, budget=16).generate(*left_pad(groups[0]), max_new_tokens=4)
        for temperature in temps:
            # every method on a group before any on the next (interleaved against the machine's drift);
            # the oracle drafter needs ar's outputs first
            ar_runner = Runner(target, None, "ar", base_params, temperature, args.max_new_tokens, stops, args.device)
            if oracle:
                for g, group in enumerate(groups):
                    ar_runner.step(g, group)
            runners = []
            for label, drafter in drafters:
                if oracle:
                    refs = [torch.tensor(p + o) for g, outs in zip(groups, ar_runner.outputs) for p, o in zip(g, outs)]
                    drafter = LookupDrafter(drafter, refs, miss=args.oracle_miss)
                for params in variants:
                    for spec in methods:
                        method, run_params = method_params(spec, params)
                        if method == "lookup" and run_params.lookup == 0:
                            continue  # method lookup is the continuation alone: lookup=0 leaves nothing
                        if not drafter_fits(method, drafter):
                            continue  # an EAGLE-3 method with a block drafter, or the other way round
                        if run_params.budget == "auto" and method not in AUTO_METHODS:
                            print(f"skipping {spec}{'@' + label if label else ''}: budget='auto' is for "
                                  f"{', '.join(AUTO_METHODS)}; give it a fixed one ({spec}/budget=16)")
                            continue
                        if oracle_misfit(method, run_params, temperature):
                            print(f"skipping {spec}{'@' + label if label else ''} at T={temperature}: early_exit=oracle "
                                  f"is for eagle3_vh at T = 0")
                            continue
                        runner = Runner(target, drafter, method, run_params, temperature, args.max_new_tokens,
                                        stops, args.device, corpus=corpora.get(label))
                        runner.references = lambda g, ar=ar_runner, groups=groups: [
                            torch.tensor(p + o) for p, o in zip(groups[g], ar.outputs[g])]
                        runner.method = spec
                        runners.append((label, runner))
            hf_runners = ([HFRunner(target, temperature, args.max_new_tokens, stops, args.device)] if args.hf else []) \
                + ([HFRunner(target, temperature, args.max_new_tokens, stops, args.device, prompt_lookup=args.hf_lookup)]
                   if args.hf_lookup else [])
            if args.llama_cpp and temperature == 0:
                from dartree_ext.quant import gguf_source
                path = gguf_source(target) if args.llama_cpp == "auto" else args.llama_cpp
                if path is None:
                    parser.error("--llama-cpp: the target was not loaded from a GGUF; name one (--llama-cpp FILE)")
                hf_runners.append(LlamaCppRunner(path, args.max_new_tokens, stops))
            for g, group in enumerate(groups):
                if not oracle:
                    ar_runner.step(g, group)
                for runner in hf_runners:
                    runner.step(g, group)
                for _, runner in runners:
                    runner.step(g, group)
            ar = ar_runner.result()
            results = [ar] + [runner.result() for runner in hf_runners]
            for label, runner in runners:
                r = runner.result()
                r["drafter"] = label or args.drafter
                if label:
                    r["method"] = f"{r['method']}@{label}"
                results.append(r)
            for r in results:
                r["set"], r["prompts"] = set_name, len(prompts)
                r["speedup"] = ar["ms_per_token"] / r["ms_per_token"] if r["ms_per_token"] else 0.0
                r["same_as_ar"] = r["outputs"] == ar["outputs"] if temperature == 0 else None
                if temperature == 0:
                    firsts = first_divergence(r["outputs"], ar["outputs"])
                    r["first_divergence"] = firsts
                    r["diverged_responses"] = sum(f is not None for f in firsts)
                # float32 must be exact; bf16 is lossless up to rounding (near-ties), so it is reported
                if r["same_as_ar"] is False and args.dtype == "float32" and r["method"] != "llama_cpp":
                    failed.append((set_name, r["method"]))
            label = f"\n[{set_name}: {len(prompts)} prompts, T={temperature}"
            label += f", sweep {args.sweep}]" if args.sweep else f", B={args.budget} W={_or(args.width, 'width')} " \
                f"K={_or(args.K, 'K')} beta={_or(args.depth_bonus, 'depth_bonus')}]"
            if args.sweep:
                for r in results:
                    r["method"] = r["method"] if r["method"] == "ar" else \
                        f"{r['method']}:{','.join(f'{k}={v}' for k, v in r['params'].items())}"
            print_table(label, results)
            everything += results
    summary = summarize(everything)
    print_summary(summary)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump([{**{k: v for k, v in r.items() if k != "outputs"}, "dtype": args.dtype, "linear": args.linear}
                       for r in everything], f, indent=1)
        with open(os.path.splitext(args.json)[0] + ".summary.json", "w") as f:
            json.dump(summary, f, indent=1)
    if failed:
        print(f"ERROR: outputs differ from ar at T = 0 for {failed}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
