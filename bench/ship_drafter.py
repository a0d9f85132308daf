"""Copy a trained drafter into the package (bfloat16 weights, so it stays well under 25 MB).

    python bench/ship_drafter.py runs/smollm2_vat/drafter dartree_ext/drafters/smollm2-135m-vat
"""
from __future__ import annotations

import json
import os
import sys

from safetensors.torch import load_file, save_file


def main(src: str, dst: str) -> int:
    import torch
    os.makedirs(dst, exist_ok=True)
    state = load_file(os.path.join(src, "model.safetensors"))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "dartree_drafter.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "dartree_drafter.json"), "w") as f:
        json.dump(config, f, indent=2)
    size = os.path.getsize(os.path.join(dst, "model.safetensors")) / 2 ** 20
    print(f"{dst}: {sum(v.numel() for v in state.values()) / 1e6:.2f}M parameters, {size:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(*sys.argv[1:3]))
