"""Grow a trained block drafter by more layers without changing what it computes: each new layer
is a copy of the last one with its output projections (attention ``o_proj``, MLP ``down_proj``)
set to zero, so it adds nothing to the residual stream until training moves them. Training then
continues from the grown drafter (``dartree-train --init DST``).

    python bench/build/grow_drafter.py dartree_ext/drafters/smollm2-135m-vat runs/g11/init --layers 2
"""
from __future__ import annotations

import argparse
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from dartree_ext.models.drafter import CONFIG_NAME, WEIGHTS_NAME


def grow(state: dict[str, torch.Tensor], old_layers: int, new_layers: int) -> dict[str, torch.Tensor]:
    """The state dict of a drafter with ``new_layers`` layers whose layers past ``old_layers``
    are copies of the last one with zero output projections."""
    if new_layers < old_layers:
        raise ValueError(f"cannot shrink a drafter from {old_layers} to {new_layers} layers")
    last = f"layers.{old_layers - 1}."
    out = dict(state)
    for i in range(old_layers, new_layers):
        for key, value in state.items():
            if key.startswith(last):
                name = key[len(last):]
                copy = value.clone()
                if name in ("o_proj.weight", "down_proj.weight"):
                    copy.zero_()
                out[f"layers.{i}.{name}"] = copy
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a drafter directory (save_pretrained)")
    p.add_argument("dst")
    p.add_argument("--layers", type=int, required=True, help="layers of the grown drafter")
    args = p.parse_args(argv)
    with open(os.path.join(args.src, CONFIG_NAME)) as f:
        config = json.load(f)
    state = {k: v.float() for k, v in load_file(os.path.join(args.src, WEIGHTS_NAME)).items()}
    old = config["num_layers"]
    grown = grow(state, old, args.layers)
    os.makedirs(args.dst, exist_ok=True)
    save_file({k: v.contiguous() for k, v in grown.items()}, os.path.join(args.dst, WEIGHTS_NAME))
    config["num_layers"] = args.layers
    with open(os.path.join(args.dst, CONFIG_NAME), "w") as f:
        json.dump(config, f, indent=2)
    for name in os.listdir(args.src):  # draft vocabulary, calibration
        if name.endswith(".json") and name != CONFIG_NAME:
            shutil.copy(os.path.join(args.src, name), os.path.join(args.dst, name))
    print(f"{args.dst}: {args.layers} layers (from {old}), {sum(v.numel() for v in grown.values()) / 1e6:.2f}M parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
