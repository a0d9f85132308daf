"""Lossless speculative decoding with draft trees for HuggingFace causal LMs."""
from .cache import compact_cache_, select_requests_
from .config import PRESETS, DecodingConfig, DecodingConfigWarning, preset, resolve
from .decoder import METHODS, DecodingStats, GenerationOutput, RequestStats, SpeculativeDecoder, left_pad
from .methods import REGISTRY
from .state import HOOK_PHASES, PhaseHook
from .static_round import StaticRound

__all__ = ["HOOK_PHASES", "METHODS", "PRESETS", "PhaseHook", "REGISTRY", "DecodingConfig", "DecodingConfigWarning", "DecodingStats",
           "GenerationOutput", "RequestStats", "SpeculativeDecoder", "StaticRound", "compact_cache_", "left_pad",
           "preset", "resolve", "select_requests_"]
