"""Segmented GEMM wgrad (dW_g = dy_g^T x_g, variable reduction size) on CUDA vs the fp64 reference:
overwrite and accumulate, empty groups, fp32 gradients of 16-bit inputs."""
import pytest
import torch

from _gemm_cases import GRID, expected_path, group_sizes
from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape,spread,dtype,G", GRID)
def test_matches_fp64_reference(ext, rel_fro, tol, monkeypatch, shape, spread, dtype, G, accumulate):
    N, K = shape
    gen = torch.Generator().manual_seed(N * 3 + K + G + accumulate)
    sizes = group_sizes(G, spread, gen)
    M = int(sizes.sum())
    dy = torch.randn(M, N, generator=gen).to(dtype)
    x = torch.randn(M, K, generator=gen).to(dtype)
    init = [torch.randn(N, K, generator=gen).to(dtype) for _ in range(G)]
    ref = reference.grouped_linear_wgrad(dy.double(), x.double(), sizes,
                                         out=[t.double() for t in init] if accumulate else None, accumulate=accumulate)
    dyc, xc, sc = dy.cuda(), x.cuda(), sizes.cuda()
    for allow_cutlass, config in ((True, "coop"), (True, "pingpong"), (False, "auto")):
        monkeypatch.setenv("LRMOE_GEMM_CONFIG", config)  # both CUTLASS wgrad kernels, the CUDA-core one; then the API by default
        outs = [t.cuda() if accumulate else torch.full((N, K), float("nan"), dtype=dtype, device="cuda") for t in init]
        used = ext.grouped_gemm(2, dyc, xc, outs, sc, None, accumulate, allow_cutlass)
        assert used == (allow_cutlass and expected_path(dtype, N, K))
        for g in range(G):
            if sizes[g] == 0:  # exactly zero (overwrite) or untouched (accumulate)
                assert torch.equal(outs[g].cpu(), init[g] if accumulate else torch.zeros(N, K, dtype=dtype))
        assert rel_fro(torch.stack(outs), torch.stack(ref)) < tol[dtype], f"cutlass={used} {config}"
    api = ops.grouped_linear_wgrad(dyc, xc, sc, backend="cuda")
    ref0 = reference.grouped_linear_wgrad(dy.double(), x.double(), sizes)
    assert rel_fro(torch.stack(api), torch.stack(ref0)) < tol[dtype]


def test_fp32_gradients_of_bf16_inputs(ext, rel_fro):
    gen = torch.Generator().manual_seed(1)
    sizes = torch.tensor([5, 0, 40, 3])
    dy = torch.randn(48, 32, generator=gen).bfloat16()
    x = torch.randn(48, 16, generator=gen).bfloat16()
    outs = [torch.full((32, 16), float("nan"), device="cuda") for _ in range(4)]
    ops.grouped_linear_wgrad(dy.cuda(), x.cuda(), sizes.cuda(), out=outs, backend="cuda")
    ref = reference.grouped_linear_wgrad(dy.double(), x.double(), sizes)
    assert rel_fro(torch.stack(outs), torch.stack(ref)) < 1e-5  # bf16 products are exact in fp32


def test_bad_input(ext):
    dy = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(7, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="8 rows but x has 7"):
        ops.grouped_linear_wgrad(dy, x, torch.tensor([4, 4], device="cuda"), backend="cuda")
    with pytest.raises(ValueError, match="1 output tensors for 2 groups"):
        ops.grouped_linear_wgrad(dy, dy, torch.tensor([4, 4], device="cuda"), out=[dy], backend="cuda")
