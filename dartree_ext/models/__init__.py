"""Drafter models: :class:`BlockDrafter` (block-parallel drafter), :class:`CorrectionHead`
(GRU causal correction) and :class:`VerificationHead` (VAT)."""
from .drafter import (BlockDrafter, BlockDrafterConfig, CorrectionHead, DraftOutput, VerificationHead,
                      default_target_layers, frequent_tokens)
from .oracle import LookupDrafter

__all__ = ["BlockDrafter", "LookupDrafter", "BlockDrafterConfig", "CorrectionHead", "DraftOutput", "VerificationHead",
           "default_target_layers", "frequent_tokens"]
