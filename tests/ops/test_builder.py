"""The op builder, without a GPU: sources, include paths, flags."""
import os
import sys

import pytest

OPS_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "ops")


@pytest.fixture(scope="module")
def builder_module():
    pytest.importorskip("deepspeed")
    sys.path.insert(0, os.path.abspath(OPS_DIR))  # the way setup.py imports it: without the package
    try:
        import builder
    finally:
        sys.path.pop(0)
    return builder


def test_sources_exist_and_are_absolute(builder_module):
    b = builder_module.LRMoEOpBuilder()
    srcs = b.sources()
    names = {os.path.basename(s) for s in srcs}
    assert {"binding.cpp", "ops.cpp", "routing.cu", "retention.cu"} <= names
    for s in srcs:
        assert os.path.isabs(s) and os.path.isfile(s), s
    assert b.absolute_name() == "lrmoe_ds.ops._C"


def test_include_paths_and_flags(builder_module):
    try:
        roots = builder_module.cutlass_include_dirs()
    except RuntimeError as exc:
        pytest.skip(f"CUTLASS headers not installed: {exc}")
    assert os.path.isfile(os.path.join(roots[0], "cutlass", "gemm", "group_array_problem_shape.hpp"))
    assert os.path.isdir(os.path.join(roots[1], "cutlass", "util"))
    major, minor, patch = builder_module.cutlass_version(roots).split(".")
    assert int(major) >= 3 and minor.isdigit() and patch.isdigit()
    b = builder_module.LRMoEOpBuilder()
    paths = b.include_paths()
    assert all(os.path.isabs(p) and os.path.isdir(p) for p in paths)
    assert set(roots) <= set(paths)
    flags = b.nvcc_args()
    assert "-gencode=arch=compute_90a,code=sm_90a" in flags
    assert "--use_fast_math" not in flags  # retention compares floats exactly
    assert not any(f.startswith("-gencode") and "sm_90a" not in f for f in flags)


def test_missing_cutlass_is_a_clear_error(builder_module, monkeypatch, tmp_path):
    monkeypatch.setenv("CUTLASS_PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "cutlass_library", None)  # as if not installed
    with pytest.raises(RuntimeError, match="CUTLASS headers not found.*CUTLASS_PATH"):
        builder_module.cutlass_include_dirs()
    b = builder_module.LRMoEOpBuilder()
    assert not b.is_compatible()
    assert "CUTLASS" in b.error_log


def test_other_cutlass_release_warns_once_built(builder_module):
    """The kernel choices were measured with one CUTLASS release; a build with another says so."""
    import warnings
    from lrmoe_ds.ops import builder, cuda
    assert builder.TUNED_CUTLASS == builder_module.TUNED_CUTLASS == "4.2.0"
    with pytest.warns(UserWarning, match=r"built with CUTLASS 4\.5\.0.*measured with 4\.2\.0"):
        cuda._warn_if_untuned_cutlass("4.5.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cuda._warn_if_untuned_cutlass("4.2.0")
