"""The drafter training loop: schedule, data (resumable generation, deterministic anchors),
resume from a checkpoint, and DDP (2 CPU processes, gloo) = one process on the global batch."""
from __future__ import annotations

import json
import math
import os
import re
import socket

import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext.training import (BlockSampler, TrainConfig, Trainer, generate_responses, lr_at,  # noqa: E402
                                  read_records, setup_distributed)

from dartree_ext.models import BlockDrafter  # noqa: E402
from models import tiny_drafter, tiny_target  # noqa: E402


def synthetic_records(n: int = 8, seed: int = 0) -> list[dict]:
    gen = torch.Generator().manual_seed(seed)
    return [{"id": f"r{i}", "prompt": torch.randint(1, 97, (int(torch.randint(3, 8, (), generator=gen)),),
                                                    generator=gen).tolist(),
             "response": torch.randint(1, 97, (int(torch.randint(10, 30, (), generator=gen)),), generator=gen).tolist()}
            for i in range(n)]


def make_trainer(out_dir, steps=4, rank=0, world=1, records=None, **cfg):
    target = tiny_target()
    drafter = tiny_drafter(target, seed=5).train()
    defaults = dict(out_dir=str(out_dir), steps=steps, batch_size=4, blocks_per_sequence=3, warmup_steps=2,
                    checkpoint_every=2, log_every=1, progress=False)
    defaults.update(cfg)
    config = TrainConfig(**defaults)
    sampler = BlockSampler(records or synthetic_records(), drafter.config.block_size, config.batch_size,
                           config.blocks_per_sequence, seed=1)
    return Trainer(target, drafter, sampler, config, rank, world)


def test_lr_schedule():
    cfg = TrainConfig(out_dir="x", steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1) and lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(10, cfg) == pytest.approx(1.0)
    assert lr_at(55, cfg) == pytest.approx(0.55)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 100))


def test_sampler_deterministic_and_split_by_rank():
    sampler = BlockSampler(synthetic_records(), block_size=6, batch_size=4, blocks_per_sequence=3, seed=2)
    full = sampler.batch(5)
    again = sampler.batch(5)
    assert torch.equal(full.anchors, again.anchors) and torch.equal(full.sequences, again.sequences)
    parts = [sampler.batch(5, rank, 2) for rank in range(2)]
    for rank, part in enumerate(parts):
        assert torch.equal(part.anchors, full.anchors[rank::2])
        assert torch.equal(part.lengths, full.lengths[rank::2])
    # anchors: from the last prompt token to the second-to-last token
    for row in range(4):
        assert int(full.anchors[row].max()) <= int(full.lengths[row]) - 2
    with pytest.raises(ValueError, match="divisible"):
        sampler.batch(0, 0, 3)


def test_generate_responses_resumes(tmp_path):
    target = tiny_target()
    prompts = [(f"p{i}", torch.randint(1, 97, (4 + i,)).tolist()) for i in range(3)]
    path = str(tmp_path / "data.jsonl")
    first = generate_responses(target, prompts[:1], path, max_new_tokens=5, progress=False)
    with open(path, "a") as f:
        f.write('{"id": "p1", "prompt": [1, 2')     # a torn write from a killed run
    records = generate_responses(target, prompts, path, max_new_tokens=5, batch_size=2, progress=False)
    assert [r["id"] for r in records] == ["p0", "p1", "p2"]
    assert records[0] == first[0]
    assert all(len(r["response"]) == 5 for r in records)
    assert len(read_records(path)) == 3
    # the cache is the target's greedy continuation
    ids = torch.tensor(prompts[2][1])[None]
    ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False)[0, ids.shape[1]:]
    assert records[2]["response"] == ref.tolist()


def test_training_resumes_exactly(tmp_path):
    whole = make_trainer(tmp_path / "a", steps=4)
    whole.train()
    part = make_trainer(tmp_path / "b", steps=2)
    part.train()
    resumed = make_trainer(tmp_path / "b", steps=4)
    assert resumed.maybe_resume() and resumed.step == 2
    resumed.train()
    for (n, p), (_, q) in zip(whole.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        torch.testing.assert_close(p, q, msg=n)
    log = [json.loads(line) for line in open(tmp_path / "a" / "train_log.jsonl")]
    assert [r["step"] for r in log] == [1, 2, 3, 4]
    assert {"loss", "mean_k_star", "accept_rate"} <= set(log[0])
    assert os.path.exists(tmp_path / "a" / "drafter" / "model.safetensors")


_KILLED_RUN = """
import os, sys, time
sys.path[:0] = [{package!r}, {tests!r}]  # the dartree_ext under test, then the tests' helpers
from dartree_ext.training import Trainer
from test_training import make_trainer
save = Trainer.save_checkpoint
def save_or_hang(self):
    if self.step == 4:  # steps 3 and 4 are done and logged, the last checkpoint is step 2's
        open(os.path.join({out!r}, "at_step_4"), "w").close()
        time.sleep(600)  # killed here
    save(self)
Trainer.save_checkpoint = save_or_hang
make_trainer({out!r}, steps=6).train()
"""


def test_training_killed_mid_run_resumes_to_the_same_result(tmp_path):
    """A real training process killed (SIGKILL) two steps past its last checkpoint resumes from it
    to the weights of an uninterrupted run, and its log holds every step once."""
    import signal
    import subprocess
    import sys
    import time
    whole = make_trainer(tmp_path / "whole", steps=6)
    whole.train()
    out = tmp_path / "killed"
    out.mkdir()
    import dartree_ext
    code = _KILLED_RUN.format(package=os.path.dirname(os.path.dirname(os.path.abspath(dartree_ext.__file__))),
                              tests=os.path.dirname(os.path.abspath(__file__)), out=str(out))
    # outside the source tree, so the child imports the package this process runs
    child = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 240
        while not (out / "at_step_4").exists():
            assert child.poll() is None, f"the run ended before the kill: {child.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "the run never reached step 4"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
    assert [json.loads(line)["step"] for line in open(out / "train_log.jsonl")] == [1, 2, 3, 4]
    resumed = make_trainer(out, steps=6)
    assert resumed.maybe_resume() and resumed.step == 2
    resumed.train()
    for (n, p), (_, q) in zip(whole.drafter.state_dict().items(), resumed.drafter.state_dict().items()):
        torch.testing.assert_close(p, q, msg=n)
    assert [json.loads(line)["step"] for line in open(out / "train_log.jsonl")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("draft_vocab", [0, 24])
def test_training_learns_the_targets_responses(tmp_path, draft_vocab):
    """On the target's own greedy responses (what the drafter is for), training with the fixed
    DFlash weights lowers the loss and raises the simulated acceptance, over the whole vocabulary
    and over a draft vocabulary."""
    target = tiny_target()
    prompts = [(f"p{i}", torch.randint(1, 97, (5,), generator=torch.Generator().manual_seed(i)).tolist())
               for i in range(8)]
    records = generate_responses(target, prompts, str(tmp_path / "data.jsonl"), max_new_tokens=24, progress=False)
    trainer = make_trainer(tmp_path, steps=60, lr=3e-3, warmup_steps=1, checkpoint_every=100, records=records,
                           loss="dflash", draft_vocab=draft_vocab)
    history = trainer.train()
    first, last = history[:4], history[-8:]
    mean = lambda rows, key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    assert mean(last, "loss") < 0.85 * mean(first, "loss")
    assert mean(last, "accept_rate") > mean(first, "accept_rate") + 0.1


def test_training_over_a_draft_vocabulary(tmp_path):
    """draft_vocab = N: the drafter trains over the N most frequent response tokens: its logits are
    the full logits' columns of those ids, the correction head's rows outside them get no gradient,
    the loss is the draft-vocabulary VAT loss, and the vocabulary is saved with the drafter."""
    from dartree_ext.models import frequent_tokens
    trainer = make_trainer(tmp_path, steps=2, draft_vocab=40)
    d = trainer.drafter
    ids = d.draft_vocab
    assert ids.tolist() == frequent_tokens([seq[first + 1:] for seq, first in trainer.sampler.seqs], 40)
    assert d.train_over_draft_vocab and d.training
    out = trainer.compute_loss(0)
    assert out["base"].accept.shape == out["valid"].shape and math.isfinite(float(out["loss"].detach()))
    out["loss"].backward()
    grad = d.correction_head.fc2.weight.grad
    outside = torch.ones(grad.shape[0], dtype=torch.bool)
    outside[ids] = False
    assert float(grad[outside].abs().max()) == 0.0 and float(grad[ids].abs().max()) > 0
    # the training pass's logits are the whole-vocabulary logits' columns of the draft vocabulary
    root, ctx = torch.tensor([5]), torch.randn(1, 6, d.config.hidden_size)
    args = (root, torch.tensor([6]), ctx, torch.arange(6)[None], torch.ones(1, 6, dtype=torch.bool))
    reduced = d(*args)
    d.train_over_draft_vocab = False
    full = d(*args)
    d.train_over_draft_vocab = True
    assert reduced.base_logits.shape[-1] == 40 and full.base_logits.shape[-1] == d.config.vocab_size
    torch.testing.assert_close(reduced.base_logits, full.base_logits[..., ids])
    trainer.train()
    saved = BlockDrafter.from_pretrained(str(tmp_path / "drafter"), trainer.target)
    assert torch.equal(saved.draft_vocab, ids)
    with pytest.raises(ValueError, match="more than the target"):
        make_trainer(tmp_path / "big", draft_vocab=100000)
    from dartree_ext.models import Eagle3Drafter
    from dartree_ext.training.trainer import use_training_draft_vocab
    with pytest.raises(ValueError, match="EAGLE-3"):
        use_training_draft_vocab(Eagle3Drafter.from_target(trainer.target, num_steps=3), trainer.sampler, 8)


def test_all_schedules_train(tmp_path):
    for loss in ("dflash", "prefix_only", "hard_cutoff", "unshifted", "vat_soft"):
        rec = make_trainer(tmp_path / loss, steps=1, loss=loss).train()[-1]
        assert rec["loss"] == rec["loss"] and rec["loss"] > 0


def test_tree_acceptance_labels(tmp_path):
    """--accept-width W: the simulated verification accepts wherever the target's token is among the
    drafter's top W, so on the same batch every chain acceptance stays and some positions are added;
    the CLI refuses W < 1 and W > 1 with the sampling rule."""
    from dartree_ext.training.cli import main
    chain = make_trainer(tmp_path / "w1").compute_loss(0)["base"]
    tree = make_trainer(tmp_path / "w40", accept_width=40).compute_loss(0)["base"]
    assert bool((tree.accept >= chain.accept).all()) and float(tree.accept.sum()) > float(chain.accept.sum())
    assert bool((tree.first_reject >= chain.first_reject).all())
    for bad in (["--accept-width", "0"], ["--accept-width", "2", "--rule", "sample"]):
        with pytest.raises(SystemExit):
            main(["--target", "tiny", "--out", str(tmp_path / "cli")] + bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(trainer) -> dict:
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.compute_loss(0)["loss"].backward()
    return {n: p.grad.detach().clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None}


def _ddp_worker(rank: int, world: int, port: int, out_dir: str, draft_vocab: int = 0) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    got_rank, got_world, _ = setup_distributed()
    assert (got_rank, got_world) == (rank, world)
    grads = _grads(make_trainer(out_dir, rank=rank, world=world, draft_vocab=draft_vocab))
    if rank == 0:
        torch.save(grads, os.path.join(out_dir, "ddp_grads.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    # leave without running static destructors: a worker's exit now and then aborted in a
    # destructor of a still-joinable thread ("terminate called without an active exception"),
    # after its work was done
    os._exit(0)


@pytest.mark.parametrize("draft_vocab", [0, 40])
def test_ddp_gradients_equal_single_process(tmp_path, draft_vocab):
    import torch.multiprocessing as mp
    mp.spawn(_ddp_worker, args=(2, _free_port(), str(tmp_path), draft_vocab), nprocs=2, join=True)
    ddp = torch.load(tmp_path / "ddp_grads.pt")
    single = _grads(make_trainer(tmp_path / "single", draft_vocab=draft_vocab))
    assert set(ddp) == set(single) and len(single) > 10
    for name in single:
        torch.testing.assert_close(ddp[name], single[name], atol=1e-6, rtol=1e-4, msg=name)


def test_cached_features_match_the_target(tmp_path):
    """The feature cache gives the same TargetBatch as running the target (to float16 rounding),
    and a second build reads the shards instead of recomputing."""
    from dartree_ext.training.features import FeatureCache
    from dartree_ext.training.trainer import cached_target_pass, target_pass
    trainer = make_trainer(tmp_path)
    seqs = [s for s, _ in trainer.sampler.seqs]
    cache = FeatureCache.build(trainer.target, trainer.drafter.config.target_layer_ids, seqs, str(tmp_path / "f"),
                               batch_size=3, progress=False)
    assert len(cache) == len(seqs) and len(os.listdir(tmp_path / "f")) == 3
    assert [f.shape[0] for f in cache.features] == [len(s) for s in seqs]   # back in the input order
    shards = [torch.load(tmp_path / "f" / name)["tokens"] for name in sorted(os.listdir(tmp_path / "f"))]
    lengths = [len(s) for chunk in shards for s in chunk]
    assert lengths == sorted(lengths, reverse=True) and len(set(lengths)) > 1   # batched by length
    batch = trainer.sampler.batch(1)
    live = target_pass(trainer.target, trainer.drafter, batch)
    cached = cached_target_pass(trainer.target, trainer.drafter, batch, cache)
    assert torch.equal(live.labels, cached.labels) and torch.equal(live.valid, cached.valid)
    for row, length in enumerate(batch.lengths.tolist()):
        torch.testing.assert_close(cached.features[row, :length], live.features[row, :length], atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(cached.logits[live.valid], live.logits[live.valid], atol=2e-2, rtol=1e-2)
    again = FeatureCache.build(trainer.target, trainer.drafter.config.target_layer_ids, seqs, str(tmp_path / "f"),
                               batch_size=3, progress=False)
    assert all(torch.equal(a, b) for a, b in zip(again.final, cache.final))


def test_feature_cache_keeps_shards_when_data_is_appended(tmp_path, monkeypatch):
    """Windows of 2 batches of 2 sequences: a cache of 8 sequences, then of 11 (3 appended),
    recomputes only the shards of the window the new sequences fall in."""
    from dartree_ext.training import features as F
    trainer = make_trainer(tmp_path)
    seqs = [s for s, _ in trainer.sampler.seqs]
    more = seqs + [s[:-1] for s in seqs[:3]]
    monkeypatch.setattr(F, "WINDOW", 2)
    computed = []
    real = F._shard
    monkeypatch.setattr(F, "_shard", lambda base, ids, chunk, device: computed.append(len(chunk)) or
                        real(base, ids, chunk, device))
    layers = trainer.drafter.config.target_layer_ids
    first = F.FeatureCache.build(trainer.target, layers, seqs, str(tmp_path / "f"), batch_size=2, progress=False)
    assert computed == [2, 2, 2, 2]
    computed.clear()
    grown = F.FeatureCache.build(trainer.target, layers, more, str(tmp_path / "f"), batch_size=2, progress=False)
    assert computed == [2, 1]                                          # the new window only
    assert all(torch.equal(a, b) for a, b in zip(first.features, grown.features[:len(seqs)]))
    assert [f.shape[0] for f in grown.features] == [len(s) for s in more]


def test_bf16_autocast_with_cached_features(tmp_path):
    """``--bf16 --cache-features`` on the CPU: the float16 cache feeds a bf16-autocast step (a
    float16 stack under CPU autocast used to raise)."""
    from dartree_ext.training.features import FeatureCache
    trainer = make_trainer(tmp_path, bf16=True)
    seqs = [s for s, _ in trainer.sampler.seqs]
    trainer.features = FeatureCache.build(trainer.target, trainer.drafter.config.target_layer_ids, seqs,
                                          str(tmp_path / "f"), batch_size=4, progress=False)
    rec = trainer.train_step()
    assert math.isfinite(rec["loss"])


def test_train_cli_runs_and_resumes(tmp_path, capsys):
    """``dartree-train`` end to end on the built-in tiny target: data, a drafter started from
    the target's last layer, checkpoints, and a second call that continues the same run."""
    from dartree_ext.models import BlockDrafter
    from dartree_ext.loading import load_target
    from dartree_ext.training.cli import main
    out = tmp_path / "run"
    args = ["--target", "tiny", "--out", str(out), "--num-prompts", "3", "--max-new-tokens", "12",
            "--batch-size", "2", "--blocks-per-sequence", "2", "--block-size", "4", "--warmup-steps", "1",
            "--checkpoint-every", "1", "--log-every", "1", "--init-from-target", "--root-in-masks"]
    assert main(args + ["--steps", "2"]) == 0
    assert len(read_records(str(out / "data.jsonl"))) == 3
    assert main(args + ["--steps", "3"]) == 0
    log = [json.loads(line) for line in open(out / "train_log.jsonl")]
    assert [r["step"] for r in log] == [1, 2, 3]      # resumed at step 2, not restarted
    target = load_target("tiny").target
    drafter = BlockDrafter.from_pretrained(str(out / "drafter"), target)
    assert drafter.config.intermediate_size == target.config.intermediate_size
    assert drafter.config.block_size == 4 and drafter.config.root_in_masks


@pytest.mark.parametrize("damage", ["truncated", "garbage", "other drafter"])
def test_a_checkpoint_that_cannot_be_resumed_names_the_file(tmp_path, damage):
    """A truncated or corrupt checkpoint, or one of another drafter, is an error naming the file
    (not a traceback from inside torch.load), and dartree-train says it in one line."""
    from dartree_ext.training.trainer import CheckpointError
    make_trainer(tmp_path, steps=2).train()
    path = tmp_path / "checkpoint.pt"
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint" * 10)
    else:
        state = torch.load(path)
        state["drafter"] = {k + ".x": v for k, v in state["drafter"].items()}
        torch.save(state, path)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(path))}: cannot resume from it .*move it away"):
        make_trainer(tmp_path, steps=4).maybe_resume()
