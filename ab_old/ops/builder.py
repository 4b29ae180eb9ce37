"""DeepSpeed op builder for the lrmoe_ds CUDA ops (``ops/csrc``).

Importable on its own (setup.py puts ``ops/`` on ``sys.path`` for an ahead-of-time build with
``LRMOE_BUILD_OPS=1``); inside the package, ``ops/cuda.py`` JIT-builds through :meth:`load`,
which DeepSpeed caches (torch's extension cache, ``TORCH_EXTENSIONS_DIR``; ninja rebuilds only what
changed). CUTLASS headers come from ``CUTLASS_PATH`` (a CUTLASS checkout) or the installed
``nvidia-cutlass`` package (``pip install nvidia-cutlass==4.2.0.0 --no-deps``).
"""
import glob
import os
import re

from deepspeed.ops.op_builder.builder import CUDAOpBuilder

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
ARCH_FLAG = "-gencode=arch=compute_90a,code=sm_90a"
TUNED_CUTLASS = "4.2.0"  # the release the kernel choices in csrc/gemm.cu were measured with (ops/cuda.py warns)


def cutlass_include_dirs():
    """The two CUTLASS include roots, or raise with the places looked at."""
    looked = []
    roots = []
    if os.environ.get("CUTLASS_PATH"):
        roots.append(os.environ["CUTLASS_PATH"])
    try:
        import cutlass_library  # the nvidia-cutlass wheel ships the C++ headers under source/
        roots.append(os.path.join(os.path.dirname(os.path.abspath(cutlass_library.__file__)), "source"))
    except ImportError:
        looked.append(f"python package cutlass_library (pip install nvidia-cutlass=={TUNED_CUTLASS}.0 --no-deps)")
    for root in roots:
        inc = [os.path.join(root, "include"), os.path.join(root, "tools", "util", "include")]
        if os.path.isfile(os.path.join(inc[0], "cutlass", "cutlass.h")):
            return [os.path.abspath(p) for p in inc]
        looked.append(os.path.join(root, "include"))
    raise RuntimeError("CUTLASS headers not found; looked in: " + "; ".join(looked) +
                       ". Set CUTLASS_PATH to a CUTLASS checkout or install nvidia-cutlass.")


def cutlass_version(include_dirs=None):
    """The CUTLASS release ("4.2.0") of the headers the build uses, from cutlass/version.h."""
    include = (include_dirs or cutlass_include_dirs())[0]
    with open(os.path.join(include, "cutlass", "version.h")) as f:
        fields = dict(re.findall(r"#define CUTLASS_(MAJOR|MINOR|PATCH) (\d+)", f.read()))
    return f"{fields['MAJOR']}.{fields['MINOR']}.{fields['PATCH']}"


def cxx_std():
    """The C++ standard torch's headers need: C++20 from torch 2.12 on (as DeepSpeed decides), else C++17."""
    import torch
    major, minor = (int(v) for v in torch.__version__.split(".")[:2])
    return "-std=c++20" if (major, minor) >= (2, 12) else "-std=c++17"


class LRMoEOpBuilder(CUDAOpBuilder):
    """Builds ``lrmoe_ds.ops._C``: routing plan, permutation, retention, capacity routing, grouped GEMM."""
    BUILD_VAR = "LRMOE_BUILD_OPS"
    NAME = "lrmoe_ops"

    def __init__(self):
        super().__init__(name=self.NAME)

    def absolute_name(self):
        return "lrmoe_ds.ops._C"

    def sources(self):
        return sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "*.cu")))

    def include_paths(self):
        return [CSRC] + cutlass_include_dirs()

    def is_compatible(self, verbose=False):
        try:
            cutlass_include_dirs()
        except RuntimeError as exc:
            self.error_log = str(exc)
            return False
        import torch
        if torch.cuda.is_available() and torch.cuda.get_device_capability(0) != (9, 0):
            major, minor = torch.cuda.get_device_capability(0)
            self.error_log = (f"the kernels are built for Hopper (sm_90a); device 0 has compute "
                              f"capability {major}.{minor}")
            return False
        return super().is_compatible(verbose)

    def compute_capability_args(self, cross_compile_archs=None):
        # The CUTLASS grouped GEMM uses wgmma and TMA: sm_90a machine code only (no PTX, no other arch).
        os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
        return [ARCH_FLAG]

    def nvcc_args(self):
        # Not DeepSpeed's defaults: no --use_fast_math (the retention kernels compare floats exactly),
        # and only the Hopper target.
        return ["-O3", cxx_std(), "--expt-relaxed-constexpr", "-U__CUDA_NO_HALF_OPERATORS__",
                "-U__CUDA_NO_HALF_CONVERSIONS__", "-U__CUDA_NO_HALF2_OPERATORS__",
                "-U__CUDA_NO_BFLOAT16_OPERATORS__", "-U__CUDA_NO_BFLOAT16_CONVERSIONS__",
                "-U__CUDA_NO_BFLOAT162_OPERATORS__", "-DCUTLASS_ENABLE_TENSOR_CORE_MMA=1", "-DNDEBUG", "-lineinfo",
                f"--threads={min(os.cpu_count() or 1, 4)}"] + self.compute_capability_args()

    def cxx_args(self):
        return ["-O3", cxx_std(), "-Wno-reorder"]
