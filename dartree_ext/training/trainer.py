"""A minimal drafter training loop with the VAT objective (single process or ``torchrun`` DDP).

Per step: the frozen target runs once over each (right-padded) sequence and gives the context
features and its logits; the drafter drafts a block at every anchor (context = the sequence
before the anchor); the loss is VAT on the drafter's base logits (with the verification head)
plus VAT on the correction head's teacher-forced corrected logits (``head_weight``). ``--loss``
picks the schedule (``vat`` or a baseline: ``dflash``, ``prefix_only``, ``hard_cutoff``,
``unshifted``, ``vat_soft``). An EAGLE-3 drafter trains by the training-time test instead
(:mod:`dartree_ext.training.eagle`, ``--loss eagle3`` or a VAT schedule). AdamW, linear
warm-up + cosine decay, gradient clipping, bf16 autocast (optional on CPU), checkpoints with
resume, tqdm progress and a JSON-lines log (loss, mean k*, estimated acceptance).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn

from ..models import BlockDrafter
from .data import BlockBatch, BlockSampler
from .scales import global_scales

log = logging.getLogger(__name__)



class CheckpointError(ValueError):
    """A checkpoint a run cannot resume from (the message names the file and why)."""

@dataclasses.dataclass
class TrainConfig:
    out_dir: str
    steps: int = 200
    batch_size: int = 8                 # sequences per global step
    blocks_per_sequence: int = 16
    max_length: int = 512
    lr: float = 3e-4
    weight_decay: float = 0.01
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    loss: str = "vat"                   # vat | dflash | prefix_only | hard_cutoff | unshifted | vat_soft | eagle3 (EAGLE-3 drafters)
    rule: str = "greedy"
    decay_gamma: float = 7.0
    vh_weight: float = 1.0
    accept_width: int = 1               # simulated verification of a tree of this many children a node (1: a chain)
    head_weight: float = 1.0
    draft_vocab: int = 0                # > 0: train over the N most frequent response tokens (saved with the drafter)
    bf16: bool = False
    checkpoint_every: int = 50
    log_every: int = 10
    seed: int = 0
    progress: bool = True


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warm-up to ``lr``, then cosine decay to ``min_lr_ratio * lr`` at ``steps``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    span = max(1, cfg.steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclasses.dataclass
class TargetBatch:
    """What the frozen target gives a batch: context features ``[S, T, F]`` and its logits at
    the positions predicting each block's labels ``[M, D - 1, V]``."""

    features: torch.Tensor
    logits: torch.Tensor
    labels: torch.Tensor      # int64[M, D - 1]
    valid: torch.Tensor       # bool[M, D - 1]


def _base_model(target: nn.Module) -> nn.Module:
    return getattr(target, target.base_model_prefix)


@torch.no_grad()
def target_pass(target: nn.Module, drafter: BlockDrafter, batch: BlockBatch) -> TargetBatch:
    seqs, lengths, anchors = batch.sequences, batch.lengths, batch.anchors
    device = next(target.parameters()).device
    seqs, lengths, anchors = seqs.to(device), lengths.to(device), anchors.to(device)
    width = seqs.shape[1]
    mask = (torch.arange(width, device=device)[None] < lengths[:, None]).long()
    out = _base_model(target)(input_ids=seqs, attention_mask=mask, output_hidden_states=True)
    features = drafter.target_features(out.hidden_states)
    steps = drafter.config.block_size - 1
    k = torch.arange(1, steps + 1, device=device)
    label_pos = anchors[..., None] + k                       # [S, n, D-1]
    valid = label_pos < lengths[:, None, None]
    label_pos = label_pos.clamp(max=width - 1)
    rows = torch.arange(seqs.shape[0], device=device)[:, None, None].expand_as(label_pos)
    labels = seqs[rows, label_pos]
    final = out.last_hidden_state[rows, (label_pos - 1).clamp(min=0)]   # predicts label_pos
    logits = target.get_output_embeddings()(final)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    return TargetBatch(features=features, logits=flat(logits), labels=flat(labels), valid=flat(valid))


@torch.no_grad()
def cached_target_pass(target: nn.Module, drafter: BlockDrafter, batch: BlockBatch, cache) -> TargetBatch:
    """:func:`target_pass` from a :class:`~dartree_ext.training.features.FeatureCache`: only the
    LM head runs (at the label positions)."""
    device = next(target.parameters()).device
    seqs, lengths, anchors = batch.sequences.to(device), batch.lengths.to(device), batch.anchors.to(device)
    width = seqs.shape[1]
    feats = [cache.features[i] for i in batch.indices]
    features = torch.zeros(len(feats), width, feats[0].shape[1], device=device)
    for row, f in enumerate(feats):
        features[row, :f.shape[0]] = f.to(device=device, dtype=torch.float32)
    steps = drafter.config.block_size - 1
    label_pos = anchors[..., None] + torch.arange(1, steps + 1, device=device)
    valid = label_pos < lengths[:, None, None]
    label_pos = label_pos.clamp(max=width - 1)
    rows = torch.arange(seqs.shape[0], device=device)[:, None, None].expand_as(label_pos)
    labels = seqs[rows, label_pos]
    head = target.get_output_embeddings()
    # float16 rows, widened before stacking: CPU bf16 autocast rejects a float16 stack
    finals = torch.stack([cache.final[i][(label_pos[r] - 1).clamp(min=0, max=cache.final[i].shape[0] - 1).cpu()]
                          .float() for r, i in enumerate(batch.indices)]).to(device=device, dtype=head.weight.dtype)
    logits = head(finals)
    flat = lambda t: t.reshape(-1, *t.shape[2:])  # noqa: E731
    return TargetBatch(features=features, logits=flat(logits), labels=flat(labels), valid=flat(valid))


class DrafterObjective(nn.Module):
    """The trainable part as one module (so DDP sees one forward): drafter + heads -> loss."""

    def __init__(self, drafter: BlockDrafter, cfg: TrainConfig) -> None:
        super().__init__()
        self.drafter, self.cfg = drafter, cfg

    def forward(self, batch: BlockBatch, tb: TargetBatch, generator: torch.Generator | None = None) -> dict:
        from ..vat import vat_loss
        d, cfg = self.drafter, self.cfg
        ids = d.draft_vocab if d.train_over_draft_vocab else None
        device = tb.features.device
        context = d.project_context(tb.features)                    # [S, T, H]
        block_seq = batch.block_seq.to(device)
        anchors = batch.anchors.to(device).reshape(-1)
        width = context.shape[1]
        slots = torch.arange(width, device=device)
        ctx_mask = slots[None] < anchors[:, None]
        roots = batch.sequences.to(device)[block_seq, anchors]
        draft = d(roots, anchors, context.index_select(0, block_seq), slots[None].expand(len(anchors), -1), ctx_mask)
        vh = d.verification_head(draft.hidden)
        labels = torch.where(tb.valid, tb.labels, 0)
        target_logits = tb.logits.to(draft.base_logits.dtype)
        opts = dict(rule=cfg.rule, schedule=cfg.loss, decay_gamma=cfg.decay_gamma, generator=generator,
                    accept_width=cfg.accept_width, draft_vocab=None if ids is None else ids.to(device))
        base = vat_loss(draft.base_logits, target_logits, labels, vh, tb.valid, vh_weight=cfg.vh_weight, **opts)
        block_scale, position_scale = global_scales(tb.valid)
        loss = base.ce_loss * block_scale + cfg.vh_weight * base.vh_loss * position_scale
        out = {"base": base, "valid": tb.valid}
        if cfg.head_weight > 0:
            corrected = d.correction_head(draft.hidden, draft.base_logits, labels, d.embedding, vocab=ids)
            head = vat_loss(corrected, target_logits, labels, None, tb.valid, vh_weight=0.0, **opts)
            loss = loss + cfg.head_weight * head.ce_loss * block_scale
            out["head"] = head
        out["loss"] = loss
        return out


def use_training_draft_vocab(drafter: nn.Module, sampler: BlockSampler, size: int) -> None:
    """``size > 0``: the drafter drafts over (and trains over) the ``size`` most frequent tokens of
    the training responses (FR-Spec / EAGLE-3's d2t), unless it already has a draft vocabulary of
    that size (a continued run keeps its own). It is saved with the drafter (``draft_vocab.json``)."""
    from ..models import frequent_tokens
    from ..models.eagle3 import Eagle3Drafter
    if size <= 0:
        return
    if isinstance(drafter, Eagle3Drafter):
        raise ValueError("draft_vocab > 0 trains a block drafter over a draft vocabulary; EAGLE-3 drafters train "
                         "over the whole vocabulary")
    if size > drafter.config.vocab_size:
        raise ValueError(f"draft_vocab is {size}, more than the target's {drafter.config.vocab_size} tokens")
    if drafter.draft_vocab is None or drafter.draft_vocab.numel() != size:
        drafter.set_draft_vocab(frequent_tokens([seq[first + 1:] for seq, first in sampler.seqs], size))
        log.info("draft vocabulary: the %d most frequent response tokens", drafter.draft_vocab.numel())
    drafter.train_over_draft_vocab = True


def make_objective(drafter: nn.Module, cfg: TrainConfig) -> nn.Module:
    """:class:`DrafterObjective` for a block drafter, the training-time test
    (:class:`~dartree_ext.training.eagle.Eagle3Objective`) for an EAGLE-3 drafter."""
    from ..models.eagle3 import Eagle3Drafter
    if isinstance(drafter, Eagle3Drafter):
        from .eagle import Eagle3Objective
        return Eagle3Objective(drafter, cfg)
    if cfg.loss == "eagle3":
        raise ValueError("loss 'eagle3' trains an EAGLE-3 drafter (dartree-train --drafter eagle3)")
    return DrafterObjective(drafter, cfg)


def setup_distributed() -> tuple[int, int, torch.device]:
    """``(rank, world, device)``; under ``torchrun`` (``WORLD_SIZE > 1``) this initialises the
    process group: nccl with one GPU per local rank, else gloo on the CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend)
    rank = dist.get_rank()
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        return rank, world, torch.device("cuda", local)
    return rank, world, torch.device("cpu")


class Trainer:
    def __init__(self, target: nn.Module, drafter: BlockDrafter, sampler: BlockSampler, cfg: TrainConfig,
                 rank: int = 0, world: int = 1, features=None) -> None:
        for p in target.parameters():
            p.requires_grad_(False)
        self.target, self.drafter, self.sampler, self.cfg = target.eval(), drafter, sampler, cfg
        self.rank, self.world = rank, world
        self.features = features  # a FeatureCache aligned with sampler.seqs, or None (target runs each step)
        use_training_draft_vocab(drafter, sampler, cfg.draft_vocab)
        self.objective = make_objective(drafter, cfg)
        self.module: nn.Module = self.objective
        if world > 1:
            from torch.nn.parallel import DistributedDataParallel
            device = next(drafter.parameters()).device
            self.module = DistributedDataParallel(self.objective, device_ids=[device.index] if device.type == "cuda"
                                                  else None, find_unused_parameters=cfg.head_weight == 0)
        decay = [p for n, p in drafter.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in drafter.named_parameters() if p.dim() < 2]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr)
        self.step = 0

    # one step -------------------------------------------------------------------------------
    def _autocast(self):
        device = next(self.drafter.parameters()).device
        enabled = self.cfg.bf16 or device.type == "cuda"
        return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)

    def compute_loss(self, step: int) -> dict:
        batch = self.sampler.batch(step, self.rank, self.world)
        with self._autocast():
            if self.features is not None:
                tb = cached_target_pass(self.target, self.drafter, batch, self.features)
            else:
                tb = target_pass(self.target, self.drafter, batch)
            gen = None
            if self.cfg.rule == "sample":
                gen = torch.Generator(device=tb.features.device).manual_seed(self.cfg.seed * 1000003 + step)
            return self.module(batch, tb, gen)

    def train_step(self) -> dict:
        cfg = self.cfg
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(self.step, cfg)
        self.optimizer.zero_grad(set_to_none=True)
        out = self.compute_loss(self.step)
        out["loss"].backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), cfg.grad_clip)
        self.optimizer.step()
        self.step += 1
        base = out["base"]
        accepted = base.first_reject.float() - 1
        return {"step": self.step, "loss": float(out["loss"].detach()), "ce": float(base.ce_loss.detach()),
                "vh": float(base.vh_loss.detach()),
                "head": float(out["head"].loss.detach()) if "head" in out else 0.0,
                "mean_k_star": float(base.first_reject.float().mean()),
                "accept_rate": float(base.accept.sum() / out["valid"].sum().clamp(min=1)),
                "mean_accepted": float(accepted.mean()), "grad_norm": float(grad_norm), "lr": lr_at(self.step - 1, cfg)}

    # checkpoints ------------------------------------------------------------------------------
    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.cfg.out_dir, "checkpoint.pt")

    def save_checkpoint(self) -> None:
        if self.rank != 0:
            return
        os.makedirs(self.cfg.out_dir, exist_ok=True)
        state = {"step": self.step, "drafter": self.drafter.state_dict(), "optimizer": self.optimizer.state_dict(),
                 "config": dataclasses.asdict(self.cfg), "drafter_config": self.drafter.config.to_dict()}
        tmp = self.checkpoint_path + ".tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint_path)  # atomic: a kill never leaves half a checkpoint
        self.drafter.save_pretrained(os.path.join(self.cfg.out_dir, "drafter"))

    def maybe_resume(self) -> bool:
        if not os.path.exists(self.checkpoint_path):
            return False
        try:
            state = torch.load(self.checkpoint_path, map_location=next(self.drafter.parameters()).device)
            self.drafter.load_state_dict(state["drafter"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.step = int(state["step"])
        except Exception as e:  # truncated, corrupt, or another run's (a different drafter)
            raise CheckpointError(f"{self.checkpoint_path}: cannot resume from it ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0] if str(e) else e!r}); move it away to start over") from None
        if self.rank == 0:
            self._trim_log()
        log.info("resumed from %s at step %d", self.checkpoint_path, self.step)
        return True

    def _trim_log(self) -> None:
        """Drop the log's records past the checkpoint (steps a killed run made after it, which the
        resumed run makes again) and a torn last line, so every step is logged once."""
        path = os.path.join(self.cfg.out_dir, "train_log.jsonl")
        if not os.path.exists(path):
            return
        kept = []
        with open(path) as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if isinstance(record, dict) and int(record.get("step", 0)) <= self.step:
                    kept.append(json.dumps(record) + "\n")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)

    # loop ---------------------------------------------------------------------------------------
    def train(self) -> list[dict]:
        cfg = self.cfg
        self.maybe_resume()
        history = []
        bar = None
        if cfg.progress and self.rank == 0:
            from tqdm.auto import tqdm
            bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train ({cfg.loss})", unit="step")
        log_path = os.path.join(cfg.out_dir, "train_log.jsonl")
        os.makedirs(cfg.out_dir, exist_ok=True)
        start = time.perf_counter()
        while self.step < cfg.steps:
            rec = self.train_step()
            rec["elapsed_s"] = round(time.perf_counter() - start, 2)
            history.append(rec)
            if not math.isfinite(rec["loss"]):
                raise FloatingPointError(f"non-finite loss at step {self.step}: {rec}")
            if self.rank == 0:
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    with open(log_path, "a") as f:
                        f.write(json.dumps(rec) + "\n")
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{rec['loss']:.3f}", k_star=f"{rec['mean_k_star']:.2f}")
            if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                self.save_checkpoint()
        if bar is not None:
            bar.close()
        return history
