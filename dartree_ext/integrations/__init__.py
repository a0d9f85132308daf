"""Adapters from this library's tree layout to other inference engines' layouts.

* :mod:`.sglang`: SGLang's EAGLE verify inputs (``draft_token``, ``positions``, ``retrive_*``
  links, the three tree-mask modes) and its accept outputs back to ours.
* :mod:`.flashinfer`: FlashInfer's bit-packed custom mask (``packed_custom_mask`` +
  ``mask_indptr``) for its batch prefill wrappers.

Everything is built from this library's ops on the inputs' device, without host
synchronisation (where an output's size depends on the sequence lengths, the caller passes
their sum, as engines keep it on the host anyway).
"""
from . import flashinfer, sglang

__all__ = ["flashinfer", "sglang"]
