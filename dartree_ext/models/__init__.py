"""Drafter models: :class:`BlockDrafter` (block-parallel drafter), :class:`CorrectionHead`
(GRU causal correction), :class:`VerificationHead` (VAT) and :class:`Eagle3Drafter`
(autoregressive, EAGLE-3 style)."""
from .drafter import (BlockDrafter, BlockDrafterConfig, CorrectionHead, DraftOutput, VerificationHead,
                      default_target_layers, frequent_tokens)
from .eagle3 import Eagle3Drafter, Eagle3DrafterConfig
from .oracle import LookupDrafter, oracle_stop_rule

__all__ = ["BlockDrafter", "Eagle3Drafter", "Eagle3DrafterConfig", "LookupDrafter", "BlockDrafterConfig",
           "CorrectionHead", "DraftOutput", "VerificationHead", "default_target_layers", "frequent_tokens",
           "oracle_stop_rule"]
