"""Evaluation / training prompts and the SmolLM2-135M-Instruct target, from installed packages.

Submodules (import them directly; neither needs the compiled extension):

* :mod:`dartree_ext.data.prompts` -- ``gsm8k()``, ``humaneval()``, ``mtbench()``,
  ``training_prompts(n)``.
* :mod:`dartree_ext.data.smollm2` -- ``smollm2_path()``, ``load_smollm2(dtype, device)``.
"""
