"""Build of dartree_ext: the `dartree_ext._C` extension (C++ CPU kernels, CUDA kernels when
available) and the Python package.

Environment:
  DARTREE_FORCE_CUDA=1   build the CUDA kernels even where torch sees no GPU (needs nvcc)
  DARTREE_FORCE_CPU=1    skip the CUDA kernels
  TORCH_CUDA_ARCH_LIST   CUDA archs (default "8.0;8.9;9.0")
  DARTREE_PTXAS_VERBOSE=1  pass -v to ptxas (register and spill report; .ci/run reads it)
"""
import glob
import os

from setuptools import find_packages, setup

# torch guesses CUDA_HOME from the nvcc on PATH; a wrapper in /usr/local/bin would make it
# /usr/local, which has no lib64/libcudart. Prefer the conventional toolkit location.
if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
    os.environ["CUDA_HOME"] = "/usr/local/cuda"

import torch  # noqa: E402
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension  # noqa: E402

DEFAULT_ARCHS = "8.0;8.9;9.0"


def _flag(name: str) -> bool:
    return os.environ.get(name, "0").lower() in ("1", "true", "yes", "on")


def _with_cuda() -> bool:
    if _flag("DARTREE_FORCE_CPU"):
        return False
    if _flag("DARTREE_FORCE_CUDA"):
        if CUDA_HOME is None:
            raise RuntimeError("DARTREE_FORCE_CUDA=1 but no CUDA toolkit (nvcc) was found; set CUDA_HOME")
        if torch.version.cuda is None:
            raise RuntimeError("DARTREE_FORCE_CUDA=1 but torch is a CPU-only build; install a CUDA build of torch")
        return True
    return CUDA_HOME is not None and torch.version.cuda is not None


def _cuda_library_includes() -> list[str]:
    """Headers of the CUDA libraries torch's CUDA headers include (cuBLAS, cuSPARSE, cuSOLVER).
    A bare toolkit (nvcc + cudart) lacks them; the CUDA build of torch ships them in its
    nvidia-* wheels, so use those when the toolkit has none."""
    if os.path.exists(os.path.join(CUDA_HOME, "include", "cusparse.h")):
        return []
    try:
        import nvidia
    except ImportError:
        return []
    found = []
    for root in nvidia.__path__:
        found += sorted(os.path.dirname(h) for h in glob.glob(os.path.join(root, "*", "include", "cusparse.h")))
    return found[:1]


def _compile_flags() -> dict[str, list[str]]:
    """csrc/compile_flags.txt: the flags CMakeLists.txt uses too."""
    flags = {}
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "compile_flags.txt")) as f:
        for line in f:
            if line.strip() and not line.startswith("#"):
                compiler, _, values = line.partition(":")
                flags[compiler.strip()] = values.split()
    return flags


def _extension():
    with_cuda = _with_cuda()
    sources = ["csrc/dartree_ext.cpp"] + sorted(glob.glob("csrc/cpu/*.cpp"))
    define_macros = [
        ("DARTREE_PYTHON_MODULE", None),
        ("DARTREE_TORCH_VERSION", f'"{torch.__version__}"'),
    ]
    flags = _compile_flags()
    cxx_flags = ["-std=c++20"] + flags["cxx"]
    if not with_cuda:
        return CppExtension("dartree_ext._C", sources, define_macros=define_macros,
                            extra_compile_args={"cxx": cxx_flags})
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or DEFAULT_ARCHS
    os.environ["TORCH_CUDA_ARCH_LIST"] = archs
    define_macros += [
        ("DARTREE_WITH_CUDA", None),
        ("DARTREE_CUDA_ARCHS", f'"{archs}"'),
        ("DARTREE_CUDA_VERSION", f'"{torch.version.cuda}"'),
    ]
    nvcc_flags = ["-std=c++20"] + flags["nvcc"]
    if _flag("DARTREE_PTXAS_VERBOSE"):
        nvcc_flags += ["-Xptxas", "-v"]
    # csrc/cuda/*.cu hold device code only (nvcc, once per arch); csrc/cuda/*_ops.cpp the torch glue
    sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
    return CUDAExtension("dartree_ext._C", sources, define_macros=define_macros,
                         include_dirs=_cuda_library_includes(),
                         extra_compile_args={"cxx": cxx_flags, "nvcc": nvcc_flags})


setup(
    name="dartree_ext",
    version="0.1.0",
    description="Fast, lossless speculative decoding with draft trees: C++/CUDA ops for PyTorch",
    packages=find_packages(include=["dartree_ext", "dartree_ext.*"]),
    ext_modules=[_extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    python_requires=">=3.10",
    install_requires=["torch>=2.6", "numpy", "transformers>=5,<6", "safetensors", "tqdm"],
    # the llama.cpp baseline (dartree-generate --compare-llama-cpp, bench/e2e/e2e.py --llama-cpp); it
    # compiles llama.cpp from source (several minutes on 2 cores)
    extras_require={"llama": ["llama-cpp-python", "diskcache"], "gguf": ["gguf"]},
    entry_points={"console_scripts": ["dartree-demo=dartree_ext.cli:demo_main",
                                      "dartree-generate=dartree_ext.cli:generate_main",
                                      "dartree-profile=dartree_ext.cli:profile_main",
                                      "dartree-train=dartree_ext.training.cli:main"]},
    package_data={"dartree_ext": ["drafters/*/*.json", "drafters/*/*.safetensors", "drafters/*/*.npz", "data/*.jsonl"]},
    zip_safe=False,
)
