"""Fixtures of the op tests: the built CUDA extension (tests skip without a CUDA device, and fail
if the device is there but the ops do not build), and the error measure used against fp64."""
import pytest
import torch


@pytest.fixture(scope="session")
def ext():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lrmoe_ds.ops import cuda as cuda_ops
    return cuda_ops.load()  # a build failure is a test failure, with its reason


@pytest.fixture(scope="session")
def rel_fro():
    def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
        """||out - ref||_F / ||ref||_F in float64; inf when out has a NaN."""
        out, ref = out.double().cpu(), ref.double().cpu()
        if not torch.isfinite(out).all():
            return float("inf")
        return float((out - ref).norm() / ref.norm().clamp_min(1e-300))
    return rel


@pytest.fixture(scope="session")
def tol():
    """Relative Frobenius error bound against fp64, per dtype."""
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
