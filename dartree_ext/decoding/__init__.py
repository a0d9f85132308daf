"""Lossless speculative decoding with draft trees for HuggingFace causal LMs."""
from .cache import compact_cache_, select_requests_
from .decoder import METHODS, DecodingStats, GenerationOutput, RequestStats, SpeculativeDecoder

__all__ = ["METHODS", "DecodingStats", "GenerationOutput", "RequestStats", "SpeculativeDecoder", "compact_cache_",
           "select_requests_"]
