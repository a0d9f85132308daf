"""DecodingConfig and resolve(): one default budget everywhere, every documented interaction
reported (a DecodingConfigWarning naming the setting) or refused, and the method registry."""
from __future__ import annotations

import argparse
import dataclasses
import inspect
import warnings

import pytest

from dartree_ext.decoding import config as cfg
from dartree_ext.decoding.config import DecodingConfig, DecodingConfigWarning, resolve
from dartree_ext.decoding.methods import AUTO_METHODS, REGISTRY, method


def resolved(**fields) -> DecodingConfig:
    """resolve() that must not warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DecodingConfigWarning)
        return resolve(DecodingConfig(**fields))


def warns(match: str, **fields) -> DecodingConfig:
    with pytest.warns(DecodingConfigWarning, match=match):
        return resolve(DecodingConfig(**fields))


# --- defaults --------------------------------------------------------------------------------

def test_defaults_are_filled_silently():
    c = resolved()
    assert (c.method, c.budget, c.width, c.K, c.depth_bonus, c.max_budget) == ("dartree", "auto", 12, 64, -0.2, 64)
    assert c.auto and c.lookup == 10 and c.estimator == "score" and c.early_exit is None and c.resolved
    assert resolved(method="eagle3_vh").early_exit == 0.5
    assert resolved(method="seq_heap").budget == cfg.FIXED_BUDGET  # cannot be sized: a fixed default
    assert not resolved(method="seq_heap").auto
    assert resolved(method="ar").lookup == 0 and not resolved(method="ar").auto
    assert resolved(method="lookup").lookup == 10
    assert resolved(budget=64).lookup == 0  # a fixed budget is the papers' tree: no branch by default


def test_one_default_budget_everywhere():
    """The constructor, the command line and the config share one default; the compiled round's
    default is the compiled preset's (a fixed size)."""
    from dartree_ext.cli import build_generate_parser
    from dartree_ext.decoding import SpeculativeDecoder, StaticRound
    assert DecodingConfig().budget is None and resolved().budget == cfg.DEFAULT_BUDGET == "auto"
    assert inspect.signature(SpeculativeDecoder).parameters["budget"].default is None
    args = build_generate_parser().parse_args([])
    assert args.budget is None and cfg.resolve(cfg.from_args(args)).budget == "auto"
    static = inspect.signature(StaticRound).parameters
    compiled = resolved(compile=True)
    assert static["budget"].default == compiled.budget == cfg.COMPILED["budget"]
    assert (static["width"].default, static["K"].default) == (compiled.width, compiled.K)


def test_presets():
    assert resolved(**dataclasses.asdict(cfg.PRESETS["default"])) == resolved()
    paper = resolve(cfg.preset("paper"))
    assert (paper.budget, paper.width, paper.K, paper.lookup) == (64, 12, 64, 0)
    assert resolve(cfg.preset("plain")).method == "ar"
    assert resolve(cfg.preset("compiled")).budget == 8
    assert resolve(cfg.preset("paper", K=32)).K == 32
    with pytest.raises(ValueError, match="unknown preset"):
        cfg.preset("fastest")


def test_resolve_is_idempotent_and_replace_unresolves():
    c = resolved(method="chain")
    with warnings.catch_warnings():
        warnings.simplefilter("error", DecodingConfigWarning)
        assert resolve(c) is c  # a resolved config sets width etc.: it is not re-checked
    assert not c.replace(method="ddtree").resolved


# --- reported interactions -----------------------------------------------------------------

@pytest.mark.parametrize("name, value, methods", [
    ("width", 8, ["chain", "chain_corrected", "ddtree", "dartree_fixed", "seq_heap", "ar", "lookup"]),
    ("K", 8, ["chain", "ar", "lookup"]),
    ("depth_bonus", -0.5, ["chain", "chain_corrected", "ddtree", "eagle3", "ar"]),
    ("early_exit", 0.6, ["ar", "lookup", "eagle3"]),
])
def test_a_knob_the_method_does_not_read_is_reported(name, value, methods):
    for m in methods:
        if m == "eagle3" and name == "early_exit":
            with pytest.raises(ValueError, match="eagle3_vh"):
                resolve(DecodingConfig(method=m, **{name: value}))
            continue
        warns(rf"{name} \(--{name.replace('_', '-')}\)", method=m, **{name: value})
    for m, spec in REGISTRY.items():
        if name in spec.knobs:  # the methods that read it take it silently
            assert getattr(resolved(method=m, **{name: value}), name) == value


def test_lookup_interactions():
    assert resolved(budget="auto", lookup=None).lookup == 10  # None: 10 where sized by cost
    assert resolved(budget=16, lookup=None).lookup == 0       # ... 0 with a fixed budget
    assert resolved(budget=16, lookup=6).lookup == 6
    with pytest.raises(ValueError, match="plain decoding"):
        resolve(DecodingConfig(method="ar", lookup=4))
    with pytest.raises(ValueError, match="lookup >= 1"):
        resolve(DecodingConfig(method="lookup", lookup=0))
    with pytest.raises(ValueError, match="lookup must be"):
        resolve(DecodingConfig(lookup=-1))


def test_corpus_interactions():
    assert resolved().corpus == "auto" and not resolved().corpus_sampling     # the drafter's, T = 0 only
    assert resolved(corpus="/x/corpus.npz").corpus_sampling                   # named: any temperature
    assert not resolved(corpus="/x/corpus.npz", corpus_sampling=False).corpus_sampling
    off = warns(r"corpus \(--corpus\).*lookup=0", corpus="/x/corpus.npz", lookup=0)
    assert off.corpus == cfg.CORPUS_OFF
    assert resolved(budget=16).corpus == cfg.CORPUS_OFF  # no branch, no corpus (the default: silent)


def test_budget_interactions():
    warns(r"budget \(--budget\)=16 does not size method 'chain'", method="chain", budget=16)
    warns(r"budget \(--budget\)=16: method 'lookup' has no tree", method="lookup", budget=16)
    warns(r"max_budget \(--max-budget\)=32 is read with budget='auto' only", budget=16, max_budget=32)
    assert resolved(max_budget=32).max_budget == 32
    with pytest.raises(ValueError, match="budget='auto' supports"):
        resolve(DecodingConfig(method="seq_heap", budget="auto"))
    for bad in (0, -3, "big", True):
        with pytest.raises(ValueError, match="budget must be"):
            resolve(DecodingConfig(budget=bad))


def test_estimator_and_sampling_interactions():
    warns(r"estimator \(--estimator\)='vh' is read with budget='auto' only", budget=16, estimator="vh")
    assert resolved(estimator="adaptive").estimator == "adaptive"
    with pytest.raises(ValueError, match="estimator 'vh'"):
        resolve(DecodingConfig(method="eagle3", estimator="vh"))
    with pytest.raises(ValueError, match="estimator must be"):
        resolve(DecodingConfig(estimator="oracle"))
    warns(r"top_k \(--top-k\) is ignored at temperature 0", top_k=5)
    warns(r"top_p \(--top-p\) is ignored at temperature 0", top_p=0.9)
    resolved(top_k=5, temperature=1.0)
    with pytest.raises(ValueError, match="sampled_draft"):
        resolve(DecodingConfig(method="dartree", sampled_draft=True))
    assert resolved(method="chain", sampled_draft=True).sampled_draft
    with pytest.raises(ValueError, match="stop rule"):
        resolve(DecodingConfig(method="chain", early_exit=lambda *a: None))
    with pytest.raises(ValueError, match="one width"):
        resolve(DecodingConfig(method="eagle3", width=(4, 2)))


# --- compiled rounds: each flag honoured or named ---------------------------------------------

def test_compile_honours_the_tree_flags():
    c = resolved(compile=True, budget=12, width=3, K=16, depth_bonus=-0.5)
    assert (c.budget, c.width, c.K, c.depth_bonus, c.depth) == (12, 3, 16, -0.5, cfg.COMPILED["depth"])
    assert resolved(compile=True).budget == cfg.COMPILED["budget"]
    warns(r"compiled rounds are a fixed size: budget='auto'", compile=True, budget="auto")
    warns(r"max_budget \(--max-budget\) is ignored by compiled rounds", compile=True, max_budget=32)
    warns(r"corpus \(--corpus\)='/c.npz' is ignored by compiled rounds", compile=True, corpus="/c.npz")
    warns(r"depth \(--depth\) is read by compiled rounds only", depth=4)


@pytest.mark.parametrize("name, value", [("early_exit", 0.6), ("lookup", 4), ("estimator", "vh"),
                                         ("sampled_draft", True), ("top_k", 5), ("top_p", 0.9)])
def test_compile_refuses_what_needs_the_host(name, value):
    extra = {"temperature": 1.0} if name in ("top_k", "top_p") else {}
    with pytest.raises(ValueError, match=rf"--compile.*{name} \(--{name.replace('_', '-')}\)"):
        resolve(DecodingConfig(compile=True, **{name: value}, **extra))


def test_compile_names_every_flag():
    """Every DecodingConfig field is honoured by compiled rounds, or named by a warning or an
    error when given: none is dropped silently."""
    honoured = {"method", "budget", "width", "K", "depth_bonus", "temperature", "dtype", "linear", "compile",
                "compile_mode", "depth", "resolved", "corpus_sampling"}
    named = {"early_exit": 0.6, "lookup": 4, "estimator": "vh", "sampled_draft": True, "top_k": 5, "top_p": 0.9,
             "max_budget": 32, "corpus": "/c.npz"}
    assert {f.name for f in dataclasses.fields(DecodingConfig)} == honoured | set(named)
    for name, value in named.items():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            try:
                resolve(DecodingConfig(compile=True, temperature=1.0, **{name: value}))
            except ValueError as e:
                assert name in str(e)
                continue
        assert any(name in str(w.message) for w in seen), name
    with pytest.raises(ValueError, match="dartree rounds"):
        resolve(DecodingConfig(compile=True, method="ddtree"))


# --- the command line and the registry -------------------------------------------------------

def test_from_args_starts_from_the_preset():
    from dartree_ext.cli import build_generate_parser
    parser = build_generate_parser()
    c = resolve(cfg.from_args(parser.parse_args(["--preset", "paper", "--K", "16"])))
    assert (c.budget, c.width, c.K, c.lookup) == (64, 12, 16, 0)
    c = resolve(cfg.from_args(parser.parse_args(["--compile", "--width", "3"])))
    assert c.compile and c.width == 3 and c.budget == 8
    assert cfg.from_args(argparse.Namespace(budget=None, method="ddtree")).method == "ddtree"


def test_cli_refuses_with_the_flag_named(capsys):
    from dartree_ext.cli import generate_main
    for argv, flag in ((["--compile", "--early-exit", "0.6"], "--early-exit"), (["--method", "ar", "--lookup", "3"],
                                                                               "lookup")):
        with pytest.raises(SystemExit):
            generate_main(["--target", "tiny", *argv])
        assert flag in capsys.readouterr().err


def test_registry():
    assert set(AUTO_METHODS) == {n for n, m in REGISTRY.items() if m.sizes}
    assert method("dartree").head and method("dartree").capped and not method("ar").drafts
    assert method("ar").plain and not method("lookup").plain
    from dartree_ext.decoding.trees import BUILDERS
    for m in REGISTRY.values():  # every block-drafter method has a builder; the others none
        assert (m.tree in BUILDERS) == (m.drafts and not m.eagle3), m.name
        assert m.knobs <= {"width", "K", "depth_bonus", "early_exit", "lookup", "sampled_draft"}
    with pytest.raises(ValueError, match="unknown method 'beam'"):
        method("beam")


def test_decoder_reports_through_resolve():
    """The constructor resolves its arguments the same way: a setting the method does not read is
    reported, and the corpus's skip at T > 0 is said when the user gave the corpus."""
    import torch
    from dartree_ext.decoding import SpeculativeDecoder
    from dartree_ext.decoding.lookup import CorpusIndex

    from models import tiny_drafter, tiny_target
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.warns(DecodingConfigWarning, match="width"):
        SpeculativeDecoder(target, drafter, "ddtree", budget=16, width=4)
    dec = SpeculativeDecoder(target, drafter, "dartree", budget=8)
    assert dec.config.budget == 8 and dec.config.resolved and dec.spec is method("dartree")
    assert SpeculativeDecoder.from_config(target, drafter, cfg.preset("paper", budget=8)).config.K == 64
    with pytest.raises(ValueError, match="StaticRound"):
        SpeculativeDecoder.from_config(target, drafter, cfg.preset("compiled"))
    from dartree_ext.decoding.cost import CostModel
    corpus = CorpusIndex([[1, 2, 3, 4, 5, 6]] * 3)
    cost = CostModel.from_curve({0: 1.0, 64: 2.0})
    dec = SpeculativeDecoder(target, None, "lookup", lookup=4, corpus=corpus, cost_model=cost)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.warns(DecodingConfigWarning, match="corpus is not consulted at temperature > 0"):
        dec.generate(ids, max_new_tokens=3, temperature=1.0, generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("error", DecodingConfigWarning)
        dec.generate(ids, max_new_tokens=3)
        SpeculativeDecoder(target, None, "lookup", lookup=4, corpus=corpus, cost_model=cost,
                           corpus_sampling=True).generate(ids, max_new_tokens=3, temperature=1.0)
