"""Segmented GEMM dgrad (dx_g = dy_g W_g) on CUDA (CUTLASS and CUDA-core paths) vs the fp64 reference."""
import pytest
import torch

from _gemm_cases import GRID, expected_path, group_sizes, use_kernels
from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("shape,spread,dtype,G", GRID)
def test_matches_fp64_reference(ext, rel_fro, tol, monkeypatch, shape, spread, dtype, G):
    N, K = shape
    gen = torch.Generator().manual_seed(N * 5 + K + G)
    sizes = group_sizes(G, spread, gen)
    M = int(sizes.sum())
    dy = torch.randn(M, N, generator=gen).to(dtype)
    ws = [torch.randn(N, K, generator=gen).to(dtype) / N ** 0.5 for _ in range(G)]
    ref = reference.grouped_linear_dgrad(dy.double(), [w.double() for w in ws], sizes)
    dyc, wc, sc = dy.cuda(), [w.cuda() for w in ws], sizes.cuda()
    for allow_cutlass, config in ((True, "coop"), (True, "m64"), (True, "auto+rows"), (False, "auto")):
        # both CUTLASS kernels, the default ones with the problems listed by rows, the CUDA-core one; then the API
        use_kernels(monkeypatch, config)
        out = torch.full((M, K), float("nan"), dtype=dtype, device="cuda")
        used = ext.grouped_gemm(1, dyc, None, wc, sc, out, False, allow_cutlass)
        assert used == (allow_cutlass and expected_path(dtype, N, K))
        assert rel_fro(out, ref) < tol[dtype], f"cutlass={used} {config}"
    api = ops.grouped_linear_dgrad(dyc, wc, sc, backend="cuda")
    assert rel_fro(api, ref) < tol[dtype]
    assert torch.equal(api, ops.grouped_linear_dgrad(dyc, wc, sc, backend="cuda"))


def test_bad_input(ext):
    dy = torch.randn(8, 32, device="cuda", dtype=torch.bfloat16)
    ws = [torch.randn(32, 16, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    with pytest.raises(ValueError, match="does not match"):
        ops.grouped_linear_dgrad(dy[:, :16].contiguous(), ws, torch.tensor([4, 4], device="cuda"), backend="cuda")


@pytest.mark.parametrize("shape,dtype,G", [((64, 128), torch.bfloat16, 8), ((13, 7), torch.float32, 8),
                                           ((64, 128), torch.bfloat16, 300)])
def test_stacked_weights_are_the_per_group_tensors(ext, shape, dtype, G):
    """Weights as one stacked [G, N, K] tensor (strided along G; transposed slices are copied first) give the
    per-group tensors' dgrad bit for bit."""
    N, K = shape
    gen = torch.Generator().manual_seed(G + K)
    sizes = group_sizes(G, "ragged", gen)
    dy = torch.randn(int(sizes.sum()), N, generator=gen).to(dtype).cuda()
    stacked = torch.randn(G, N + 5, K, generator=gen).to(dtype).cuda()[:, 5:]
    sc = sizes.cuda()
    expected = ops.grouped_linear_dgrad(dy, list(stacked.unbind(0)), sc, backend="cuda")
    assert torch.equal(ops.grouped_linear_dgrad(dy, stacked, sc, backend="cuda"), expected)
    transposed_slices = stacked.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(ops.grouped_linear_dgrad(dy, transposed_slices, sc, backend="cuda"), expected)
