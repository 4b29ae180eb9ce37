"""Install lrmoe_ds; the op API in ./ops installs as ``lrmoe_ds.ops`` so it cannot collide with
any other top-level ``ops`` package.

Set ``LRMOE_BUILD_OPS=1`` to build the CUDA ops ahead of time instead of JIT on first use.
"""
import os

from setuptools import setup

ext_modules, cmdclass = [], {}
if os.environ.get("LRMOE_BUILD_OPS", "0") == "1":
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "ops"))
    from builder import LRMoEOpBuilder  # noqa: E402  (ops/builder.py, importable without the package)
    from torch.utils.cpp_extension import BuildExtension  # noqa: E402
    ext_modules = [LRMoEOpBuilder().builder()]
    cmdclass = {"build_ext": BuildExtension}

setup(
    name="lrmoe_ds",
    version="0.1.0",
    description="LRMoE for DeepSpeed: dropless MoE layers with quota-aware retention in the backward",
    packages=["lrmoe_ds", "lrmoe_ds.ops"],
    package_dir={"lrmoe_ds": "lrmoe_ds", "lrmoe_ds.ops": "ops"},
    package_data={"lrmoe_ds.ops": ["csrc/*", "csrc/**/*"]},
    python_requires=">=3.10",
    # torch is not listed on purpose: a bare requirement can pull a multi-GB CUDA build; install the
    # torch you want first (README).
    install_requires=["deepspeed==0.19.8", "numpy", "pydantic>=2", "tqdm", "ninja"],
    extras_require={"test": ["pytest>=8", "transformers>=5"], "bench": ["matplotlib"], "hf": ["transformers>=5"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
