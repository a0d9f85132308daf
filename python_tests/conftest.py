"""Backends every op test runs on: the CPU kernels, the CUDA kernels under CPU emulation, and the
real CUDA kernels where a GPU is present. Later areas reuse the ``backend`` fixture."""
from __future__ import annotations

import dataclasses
import functools
import os
import zlib
from typing import Any

import pytest
import torch

import dartree_ext
from dartree_ext import ops

from emulated import SHUFFLED, EmulatedOps


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


# The emulator's shuffled schedule (thread order between barriers, block order) is seeded per test
# from this run's seed and the test's id: a different schedule every run, and a failing one
# reproduced by DARTREE_EMU_SEED=<the seed in the header> pytest <the test>.
EMU_SEED = int(os.environ.get("DARTREE_EMU_SEED") or int.from_bytes(os.urandom(4), "little"))


def pytest_report_header(config):
    build = ("instrumented: global-memory bounds checked (DARTREE_EMU_INSTRUMENT=1)"
             if os.environ.get("DARTREE_EMU_INSTRUMENT") == "1" else "plain")
    return [f"CUDA emulator schedule seed: {EMU_SEED} (DARTREE_EMU_SEED={EMU_SEED} reproduces it)",
            f"CUDA emulator build: {build}"]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if exitstatus not in (0, 5):  # failures: say which emulator schedule this run used
        terminalreporter.write_line(f"CUDA emulator schedule seed: {EMU_SEED} (DARTREE_EMU_SEED={EMU_SEED} "
                                    "reproduces it)")


@pytest.fixture(params=BACKENDS)
def backend(request) -> Backend:
    chosen = make_backend(request.param)
    if request.param == "emu":
        test_seed = zlib.crc32(f"{EMU_SEED}:{request.node.nodeid}".encode())
        chosen.ops.set_schedule(SHUFFLED, test_seed)
    return chosen
