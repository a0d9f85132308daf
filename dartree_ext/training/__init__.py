"""Drafter training: data (target responses, anchors) and a VAT training loop (DDP-ready)."""
from .data import BlockBatch, BlockSampler, generate_responses, read_records
from .trainer import DrafterObjective, TrainConfig, Trainer, lr_at, setup_distributed, target_pass

__all__ = ["BlockBatch", "BlockSampler", "DrafterObjective", "TrainConfig", "Trainer", "generate_responses", "lr_at",
           "read_records", "setup_distributed", "target_pass"]
