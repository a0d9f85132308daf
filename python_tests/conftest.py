"""Backends every op test runs on: the CPU kernels, the CUDA kernels under CPU emulation, and the
real CUDA kernels where a GPU is present. Later areas reuse the ``backend`` fixture."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest
import torch

import dartree_ext
from dartree_ext import ops

from emulated import EmulatedOps


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    device: torch.device  # where inputs must live
    ops: Any  # an object with the signatures of dartree_ext.ops

    def put(self, *tensors: torch.Tensor):
        moved = tuple(t.to(self.device) for t in tensors)
        return moved if len(moved) > 1 else moved[0]


def cuda_available() -> bool:
    return torch.cuda.is_available() and dartree_ext.build_info()["cuda"]


@functools.cache
def emulated_ops() -> EmulatedOps:
    return EmulatedOps()


BACKENDS = ["cpu", "emu", "cuda"]


def make_backend(name: str) -> Backend:
    if name == "cpu":
        return Backend("cpu", torch.device("cpu"), ops)
    if name == "emu":
        return Backend("emu", torch.device("cpu"), emulated_ops())
    if not cuda_available():
        pytest.skip("no CUDA device, or the extension was built without CUDA kernels")
    return Backend("cuda", torch.device("cuda"), ops)


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    return make_backend(request.param)
