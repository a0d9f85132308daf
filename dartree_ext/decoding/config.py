"""What a decoding run is asked to do, as one frozen :class:`DecodingConfig`, and the one place
where it is resolved (:func:`resolve`).

The command line (``dartree-generate``, ``bench/e2e/e2e.py``), the Python API
(:meth:`SpeculativeDecoder.from_config <dartree_ext.decoding.SpeculativeDecoder.from_config>`
and the constructor, which builds a config from its arguments) and the compiled round all go
through :func:`resolve`. A field left ``None`` takes the method's default, silently (the
defaults are documented below); a value the user gave that the method, the temperature or the
compiled round does not use is reported by a :class:`DecodingConfigWarning` naming the setting,
or refused with a ``ValueError`` where ignoring it would change what the user asked for.

Defaults, for every entry point:

* ``budget``: :data:`DEFAULT_BUDGET` (``"auto"``: each round's tree sized by the measured cost
  model). Methods that cannot size their trees (``seq_heap``) take :data:`FIXED_BUDGET` nodes;
  compiled rounds are a fixed size, :data:`COMPILED["budget"] <COMPILED>`.
* ``width`` 12, ``K`` 64, ``depth_bonus`` -0.2 (:data:`TREE_DEFAULTS`); compiled rounds W = 4,
  K = 8 and 6 drafted positions (:data:`COMPILED`), unless given.
* ``lookup``: 10 continuation tokens for method ``lookup`` and wherever trees are sized by cost
  (the branch is cut by cost too), else 0: a fixed budget is the papers' tree, exactly
  ``budget`` nodes.
* ``early_exit``: none (``eagle3_vh``: 0.5); ``estimator``: ``"score"``; ``max_budget`` 64.
* ``corpus``: ``"auto"`` (the drafter's corpus if it ships one), consulted at T = 0 only;
  a corpus named explicitly is consulted at any temperature (``corpus_sampling``).
"""
from __future__ import annotations

import dataclasses
import numbers
import warnings

from .._widths import canonical_width, depth_widths
from .methods import REGISTRY, Method, method as method_entry

DEFAULT_BUDGET = "auto"
FIXED_BUDGET = 64  # a method that cannot size its trees, under the default budget
DEFAULT_MAX_BUDGET = 64  # budget="auto": nodes a tree is built with before it is cut
DEFAULT_LOOKUP = 10  # continuation tokens per round where the lookup branch is on by default
TREE_DEFAULTS = dict(width=12, K=64, depth_bonus=-0.2)
COMPILED = dict(budget=8, width=4, K=8, depth=6)  # StaticRound's fixed-size rounds
ESTIMATORS = ("score", "adaptive", "vh")
CORPUS_OFF = "none"


class DecodingConfigWarning(UserWarning):
    """A setting the user gave is not used as given (the message names it and says why)."""


@dataclasses.dataclass(frozen=True)
class DecodingConfig:
    """One decoding run's settings. ``None`` is "the method's default" (see the module's
    docstring); :func:`resolve` fills every default and checks every combination.

    ``corpus``: ``"auto"``, ``"none"``, a path (a ``CorpusIndex`` ``.npz`` or a drafter
    directory holding ``corpus.npz``) for the loaders, or ``"given"`` (a ``CorpusIndex`` handed
    to the decoder). ``dtype`` and ``linear`` are the loader's (``"auto"``: measured once per
    machine). ``compile``: decode in :class:`~dartree_ext.decoding.StaticRound`'s compiled
    rounds (``compile_mode``: ``torch.compile``'s mode)."""

    method: str = "dartree"
    budget: int | str | None = None
    width: int | tuple[int, ...] | None = None
    K: int | None = None
    depth_bonus: float | None = None
    early_exit: object = None  # a threshold in (0, 1), or (eagle3_vh) a StopRule
    estimator: str | None = None
    lookup: int | None = None
    corpus: str = "auto"
    corpus_sampling: bool | None = None
    sampled_draft: bool | None = None
    max_budget: int | None = None
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    dtype: str = "auto"
    linear: str = "auto"
    compile: bool = False
    compile_mode: str | None = None
    depth: int | None = None  # compiled rounds: drafted positions
    resolved: bool = dataclasses.field(default=False, compare=False)  # set by resolve()

    def replace(self, **changes) -> "DecodingConfig":
        """A copy with ``changes`` (not resolved, unless ``resolved=True`` is among them)."""
        return dataclasses.replace(self, **{"resolved": False, **changes})

    @property
    def spec(self) -> Method:
        return method_entry(self.method)

    @property
    def auto(self) -> bool:
        """Whether trees are sized per round (a resolved config)."""
        return self.budget == "auto" and self.method != "ar"


PRESETS: dict[str, DecodingConfig] = {
    # the main command: DARTree sized per round, with the lookup branch and the drafter's corpus
    "default": DecodingConfig(),
    # the DARTree paper's setting: B = 64, W = 12, K = 64, no lookup branch
    "paper": DecodingConfig(budget=64, width=12, K=64, lookup=0),
    # compiled fixed-size rounds (StaticRound)
    "compiled": DecodingConfig(compile=True),
    # plain decoding
    "plain": DecodingConfig(method="ar"),
}


def preset(name: str, **changes) -> DecodingConfig:
    """The named preset (:data:`PRESETS`) with ``changes``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}")
    return PRESETS[name].replace(**changes)


def _warn(message: str) -> None:
    warnings.warn(message, DecodingConfigWarning, stacklevel=3)


def _flag(name: str) -> str:
    """A setting's name as both its API argument and its command-line flag."""
    return f"{name} (--{name.replace('_', '-')})"


def _check_values(c: DecodingConfig) -> None:
    """Values that are wrong whatever the method (a ValueError naming the setting)."""
    if c.budget is not None and not (c.budget == "auto" or (isinstance(c.budget, numbers.Integral)
                                                            and not isinstance(c.budget, bool))):
        raise ValueError(f"budget must be an int >= 1 or 'auto', got {c.budget!r}")
    if isinstance(c.budget, numbers.Integral) and c.budget < 1:
        raise ValueError(f"budget must be >= 1, got {c.budget}")
    if c.max_budget is not None and c.max_budget < 1:
        raise ValueError(f"max_budget must be >= 1, got {c.max_budget}")
    if c.K is not None and c.K < 1:
        raise ValueError(f"K must be >= 1, got K={c.K}")
    if c.width is not None:
        depth_widths(c.width, 1)  # raises on a width < 1
    if c.estimator is not None and c.estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {', '.join(ESTIMATORS)}, got {c.estimator!r}")
    if c.lookup is not None and (isinstance(c.lookup, bool) or not isinstance(c.lookup, numbers.Integral)
                                 or c.lookup < 0):
        raise ValueError(f"lookup must be an int >= 0 (continuation tokens per round), got {c.lookup!r}")
    if c.early_exit is not None and not callable(c.early_exit) and not 0.0 < c.early_exit < 1.0:
        raise ValueError(f"early_exit is a probability threshold in (0, 1), got {c.early_exit}")
    if c.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {c.temperature}")


def _resolve_budget(c: DecodingConfig, m: Method) -> tuple[int | str, int]:
    """``(budget, max_budget)``: ``"auto"`` where trees are sized per round."""
    max_budget = DEFAULT_MAX_BUDGET if c.max_budget is None else int(c.max_budget)
    if c.budget is None:  # the default: sized where the method can be
        return ("auto" if m.sizes else FIXED_BUDGET), max_budget
    if c.budget == "auto":
        if not m.sizes and m.drafts:
            auto = ", ".join(n for n, e in REGISTRY.items() if e.sizes)
            raise ValueError(f"budget='auto' supports {auto}, not {m.name!r}")
        return "auto", max_budget
    if c.max_budget is not None:
        _warn(f"{_flag('max_budget')}={c.max_budget} is read with budget='auto' only; the budget is {c.budget}")
    if m.drafts and not m.fixed_budget:
        _warn(f"{_flag('budget')}={c.budget} does not size method {m.name!r}'s draft (a chain of the drafter's "
              f"whole block); it only turns per-round sizing off (budget='auto' sizes it)")
    elif not m.drafts and m.name != "ar":
        _warn(f"{_flag('budget')}={c.budget}: method {m.name!r} has no tree to build; a fixed budget only turns "
              f"the cut of its lookup branch by cost off")
    return int(c.budget), max_budget


def _resolve_lookup(c: DecodingConfig, m: Method, auto: bool) -> int:
    if c.lookup is None:
        return DEFAULT_LOOKUP if m.name == "lookup" or (auto and m.name != "ar") else 0
    if m.name == "ar" and c.lookup:
        raise ValueError("method 'ar' is plain decoding: it takes no lookup continuation (use method 'lookup')")
    if m.name == "lookup" and not c.lookup:
        raise ValueError("method 'lookup' needs lookup >= 1")
    return int(c.lookup)


def _resolve_knobs(c: DecodingConfig, m: Method, auto: bool) -> dict:
    """Width, K, depth bonus, early exit, estimator and sampled draft: the method's defaults,
    and a warning (or a refusal) for each one given that it does not read."""
    given = {k: getattr(c, k) for k in ("width", "K", "depth_bonus", "early_exit", "sampled_draft")
             if getattr(c, k) is not None and getattr(c, k) is not False}
    if callable(c.early_exit) and m.name != "eagle3_vh":
        raise ValueError(f"a stop rule as early_exit (a callable) is for method 'eagle3_vh', not {m.name!r}; "
                         f"other methods take a probability threshold")
    for name, value in given.items():
        if name not in m.knobs:
            if name == "early_exit" and m.name == "eagle3":
                raise ValueError("method 'eagle3' drafts every step; the verification head's early exit is "
                                 "method 'eagle3_vh'")
            if name == "sampled_draft":
                raise ValueError(f"sampled_draft (speculative sampling of a drafted chain) is for method 'chain', "
                                 f"not {m.name!r}")
            _warn(f"method {m.name!r} does not read {_flag(name)}: {name}={value!r} is ignored")
    estimator = c.estimator or "score"
    if c.estimator not in (None, "score") and not auto:
        _warn(f"{_flag('estimator')}={c.estimator!r} is read with budget='auto' only: ignored")
    if estimator == "vh" and m.eagle3:
        raise ValueError(f"estimator 'vh' reads a block drafter's per-position head probabilities; {m.name!r} "
                         f"sizes its trees by calibrated scores ('score' or 'adaptive')")
    width = TREE_DEFAULTS["width"] if c.width is None else canonical_width(c.width)
    if m.eagle3 and not isinstance(width, int):
        raise ValueError(f"method {m.name!r} takes one width (frontier nodes per step), got {width}")
    return dict(width=width, K=TREE_DEFAULTS["K"] if c.K is None else int(c.K),
                depth_bonus=TREE_DEFAULTS["depth_bonus"] if c.depth_bonus is None else float(c.depth_bonus),
                early_exit=m.early_exit if c.early_exit is None else c.early_exit, estimator=estimator,
                sampled_draft=bool(c.sampled_draft))


def _resolve_sampling(c: DecodingConfig) -> None:
    if c.temperature == 0:
        for name in ("top_k", "top_p"):
            if getattr(c, name) is not None:
                _warn(f"{_flag(name)} is ignored at temperature 0 (greedy decoding)")


def _resolve_compiled(c: DecodingConfig, m: Method) -> DecodingConfig:
    """Compiled rounds (:class:`~dartree_ext.decoding.StaticRound`): dartree of a fixed size on a
    static cache. ``budget``, ``width``, ``K``, ``depth_bonus`` and ``depth`` are honoured when
    given (else :data:`COMPILED`); what needs the host every round is refused."""
    if m.name != "dartree":
        raise ValueError(f"compile runs dartree rounds (StaticRound), not method {m.name!r}")
    refused = {"early_exit": c.early_exit is not None, "lookup": bool(c.lookup),
               "estimator": c.estimator not in (None, "score"), "sampled_draft": bool(c.sampled_draft),
               "top_k": c.top_k is not None, "top_p": c.top_p is not None}
    for name, given in refused.items():
        if given:
            raise ValueError(f"compiled rounds (--compile) are fixed-size dartree rounds on the device: they take no "
                             f"{_flag(name)}")
    if c.corpus not in ("auto", CORPUS_OFF):
        _warn(f"{_flag('corpus')}={c.corpus!r} is ignored by compiled rounds (no lookup branch)")
    if c.max_budget is not None:
        _warn(f"{_flag('max_budget')} is ignored by compiled rounds (a fixed size)")
    budget = c.budget
    if budget == "auto":
        _warn(f"compiled rounds are a fixed size: budget='auto' is {COMPILED['budget']} (give --budget N)")
    if budget is None or budget == "auto":
        budget = COMPILED["budget"]
    width = COMPILED["width"] if c.width is None else canonical_width(c.width)
    if not isinstance(width, int):
        raise ValueError(f"compiled rounds take one width, got {width}")
    return c.replace(budget=int(budget), width=width, K=COMPILED["K"] if c.K is None else int(c.K),
                     depth_bonus=TREE_DEFAULTS["depth_bonus"] if c.depth_bonus is None else float(c.depth_bonus),
                     depth=COMPILED["depth"] if c.depth is None else int(c.depth), estimator="score", lookup=0,
                     max_budget=0, sampled_draft=False, corpus=CORPUS_OFF, corpus_sampling=False)


def resolve(config: DecodingConfig) -> DecodingConfig:
    """``config`` with every default filled and every combination checked (see the module's
    docstring): a config whose fields are all concrete (``early_exit``, ``top_k``, ``top_p``
    and ``compile_mode`` may stay ``None``). Each setting given that will not be used as given
    is reported by a :class:`DecodingConfigWarning`, or refused with a ``ValueError``."""
    c = config
    if c.resolved:
        return c
    m = method_entry(c.method)
    _check_values(c)
    _resolve_sampling(c)
    if c.compile:
        return _resolve_compiled(c, m).replace(resolved=True)
    if c.depth is not None:
        _warn(f"{_flag('depth')} is read by compiled rounds only: ignored")
    budget, max_budget = _resolve_budget(c, m)
    auto = c.replace(budget=budget).auto
    lookup = _resolve_lookup(c, m, auto)
    knobs = _resolve_knobs(c, m, auto)
    corpus = c.corpus
    if c.corpus not in ("auto", CORPUS_OFF) and not lookup:
        _warn(f"{_flag('corpus')}={c.corpus!r} feeds the lookup branch, which is off (lookup=0): ignored")
    if not lookup or m.name == "ar":
        corpus = CORPUS_OFF
    sampling = c.corpus not in ("auto", CORPUS_OFF, "given") if c.corpus_sampling is None else bool(c.corpus_sampling)
    return c.replace(budget=budget, max_budget=max_budget, lookup=lookup, corpus=corpus, corpus_sampling=sampling,
                     resolved=True, **knobs)


def from_args(args, **changes) -> DecodingConfig:
    """The :class:`DecodingConfig` of parsed command-line arguments (the flags of
    :func:`dartree_ext.cli.add_decoding_args`; ``--preset`` first, the flags given on top)."""
    base = preset(getattr(args, "preset", None) or "default")
    fields = {f.name for f in dataclasses.fields(DecodingConfig)}
    given = {k: v for k, v in vars(args).items() if k in fields - {"resolved"} and v is not None}
    return base.replace(**{**given, **changes})


__all__ = ["COMPILED", "DEFAULT_BUDGET", "DecodingConfig", "DecodingConfigWarning", "PRESETS",
           "from_args", "preset", "resolve"]
