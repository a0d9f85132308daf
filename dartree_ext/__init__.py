"""dartree_ext: fast, lossless speculative decoding with draft trees.

Importing the package loads the native library, which registers the ops under
``torch.ops.dartree_ext``; ``dartree_ext.ops`` holds documented wrappers for them and
``dartree_ext.reference`` a plain-PyTorch reference of each.
"""
import torch  # noqa: F401  (the native library links against torch's)

from . import _C  # noqa: F401  (registers torch.ops.dartree_ext.*)
from ._C import build_info
from .ops import tree_ancestor_bits, tree_attention_mask, tree_links, verify_tree
from .sampling import target_tokens_from_logits

__all__ = [
    "build_info",
    "target_tokens_from_logits",
    "tree_ancestor_bits",
    "tree_attention_mask",
    "tree_links",
    "verify_tree",
]
__version__ = "0.1.0"
