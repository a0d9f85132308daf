"""Reduced draft vocabulary (FR-Spec / EAGLE-3's d2t): choosing it, checking it, saving and
loading it with the drafter, the logits it gives (the full head's rows), and decoding with it
staying lossless (tokens outside it are never drafted, verification is unchanged)."""
from __future__ import annotations

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from dartree_ext.decoding import METHODS, SpeculativeDecoder  # noqa: E402
from dartree_ext.models import BlockDrafter, frequent_tokens  # noqa: E402
from dartree_ext.models.drafter import check_draft_vocab  # noqa: E402
from models import greedy_reference, tiny_drafter, tiny_target  # noqa: E402
from test_decoding import check_greedy  # noqa: E402


def test_frequent_tokens_order_ties_and_always():
    seqs = [[5, 5, 3, 9, 9, 9], [3, 7]]
    assert frequent_tokens(seqs, 3) == [9, 3, 5]               # 3 and 5 tie at 2: the lower id first
    assert frequent_tokens(seqs, 3, always=[7, 9]) == [7, 9, 3]
    assert frequent_tokens(seqs, 10) == [9, 3, 5, 7]           # fewer distinct tokens than asked
    with pytest.raises(ValueError, match="size"):
        frequent_tokens(seqs, 0)


@pytest.mark.parametrize("ids,match", [([0, 97], r"in \[0, 97\)"), ([-1, 2], r"in \[0, 97\)"), ([3, 3], "distinct"),
                                       ([], "non-empty"), ([[1, 2]], "1-D"), ([0.5, 1.0], "integer")])
def test_bad_draft_vocab(ids, match):
    with pytest.raises(ValueError, match=match):
        check_draft_vocab(ids, 97)


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama")


def test_logits_are_the_full_heads_rows(target):
    drafter = tiny_drafter(target).eval()
    root, pos = torch.tensor([3, 8]), torch.tensor([4, 4])
    ctx = torch.randn(2, 4, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    cpos, cmask = torch.arange(4).expand(2, -1), torch.ones(2, 4, dtype=torch.bool)
    with torch.no_grad():
        full = drafter(root, pos, ctx, cpos, cmask)
        vocab = [90, 1, 45, 7, 60]
        drafter.set_draft_vocab(vocab)
        sub = drafter(root, pos, ctx, cpos, cmask)
    assert full.vocab is None and sub.vocab.tolist() == vocab
    torch.testing.assert_close(sub.base_logits, full.base_logits[..., vocab])
    assert sub.target_ids(torch.tensor([0, 4])).tolist() == [90, 60]
    drafter.train()       # training always uses the full vocabulary
    assert drafter(root, pos, ctx, cpos, cmask).vocab is None
    drafter.set_draft_vocab(None).eval()
    assert drafter(root, pos, ctx, cpos, cmask).vocab is None


def test_save_and_load_round_trip(target, tmp_path):
    drafter = tiny_drafter(target)
    drafter.set_draft_vocab([4, 2, 96])
    drafter.save_pretrained(tmp_path / "d")
    assert json.load(open(tmp_path / "d" / "draft_vocab.json")) == [4, 2, 96]
    loaded = BlockDrafter.from_pretrained(tmp_path / "d", target)
    assert loaded.draft_vocab.tolist() == [4, 2, 96]
    assert BlockDrafter.from_pretrained(tmp_path / "d", target, use_draft_vocab=False).draft_vocab is None
    with open(tmp_path / "d" / "draft_vocab.json", "w") as f:
        json.dump([4, 400], f)
    with pytest.raises(ValueError, match="draft_vocab.json"):
        BlockDrafter.from_pretrained(tmp_path / "d", target)
    os.remove(tmp_path / "d" / "draft_vocab.json")
    assert BlockDrafter.from_pretrained(tmp_path / "d", target).draft_vocab is None


@pytest.mark.parametrize("method", [m for m in METHODS if m not in ("ar", "lookup")])
def test_decoding_with_a_draft_vocab_is_lossless(target, method):
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (6, 11, 1)]
    refs = [greedy_reference(target, p, 16) for p in prompts]
    drafter = tiny_drafter(target)
    # half the vocabulary, including tokens the greedy answers use and tokens they do not
    drafter.set_draft_vocab(list(range(0, 97, 2)))
    dec = SpeculativeDecoder(target, drafter, method, budget=12, width=3, K=6)
    drafted = []
    build = dec.build_tree

    def recording(*args, **kw):
        tree = build(*args, **kw)
        valid = torch.arange(tree.tokens.shape[1])[None] < tree.num_nodes[:, None]
        drafted.append(tree.tokens[:, 1:][valid[:, 1:]])
        return tree

    dec.build_tree = recording
    check_greedy(dec, prompts, refs, 16)
    drafted = torch.cat(drafted)
    assert drafted.numel() > 0 and bool((drafted % 2 == 0).all()), "a token outside the draft vocabulary was drafted"
