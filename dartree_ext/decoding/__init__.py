"""Lossless speculative decoding with draft trees for HuggingFace causal LMs."""
from .cache import compact_cache_, select_requests_
from .decoder import METHODS, DecodingStats, GenerationOutput, RequestStats, SpeculativeDecoder, left_pad
from .static_round import StaticRound

__all__ = ["METHODS", "DecodingStats", "GenerationOutput", "RequestStats", "SpeculativeDecoder", "StaticRound",
           "compact_cache_",
           "left_pad", "select_requests_"]
