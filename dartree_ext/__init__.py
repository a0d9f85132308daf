"""dartree_ext: fast, lossless speculative decoding with draft trees.

Importing the package loads the native library, which registers the ops under
``torch.ops.dartree_ext``; ``dartree_ext.ops`` holds documented wrappers for them and
``dartree_ext.reference`` a plain-PyTorch reference of each.
"""
import torch  # noqa: F401  (the native library links against torch's)

try:
    from . import _C  # noqa: F401  (registers torch.ops.dartree_ext.*)
except ImportError as e:  # pragma: no cover - depends on how the package was installed
    raise ImportError(
        "dartree_ext's native library is missing. Importing from a source checkout needs an in-place build "
        "(`python setup.py build_ext --inplace` or `pip install --no-build-isolation -e .`); after "
        "`pip install .`, run Python from outside the source tree.") from e
from ._C import build_info
from .ops import (build_supertree, compact_kv_, ddtree_heap, expand_depth, select_top_b, select_top_w,
                  tree_ancestor_bits, tree_attention_mask, tree_links, verify_tree)
from .sampling import target_tokens_from_logits
from .vat import VATLossOutput, vat_loss, vat_loss_linear

__all__ = [
    "build_info",
    "build_supertree",
    "compact_kv_",
    "ddtree_heap",
    "expand_depth",
    "select_top_b",
    "select_top_w",
    "target_tokens_from_logits",
    "tree_ancestor_bits",
    "tree_attention_mask",
    "tree_links",
    "verify_tree",
    "VATLossOutput",
    "vat_loss",
    "vat_loss_linear",
]
__version__ = "0.1.0"
