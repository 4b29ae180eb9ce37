"""Segmented GEMM wgrad (dW_g = dy_g^T x_g, variable reduction size) on CUDA vs the fp64 reference:
overwrite and accumulate, empty groups, fp32 gradients of 16-bit inputs."""
import pytest
import torch

from _gemm_cases import GRID, expected_path, group_sizes, use_kernels
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
    for allow_cutlass, config in ((True, "coop"), (True, "pingpong"), (True, "auto+rows"), (False, "auto")):
        # both CUTLASS kernels, the default ones with the problems listed by rows, the CUDA-core one; then the API
        use_kernels(monkeypatch, config)
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


def test_new_gradients_are_separate_tensors_usable_as_grad(ext):
    """Without ``out`` the gradients are split from one buffer in C++ (plain tensors, not autograd views):
    each is its own [N, K] tensor on its region, an in-place change to one leaves the others alone, and
    autograd takes one as a parameter's .grad without copying it."""
    gen = torch.Generator().manual_seed(2)
    sizes = torch.tensor([3, 0, 9])
    dy = torch.randn(12, 8, generator=gen).bfloat16().cuda()
    x = torch.randn(12, 4, generator=gen).bfloat16().cuda()
    grads = ops.grouped_linear_wgrad(dy, x, sizes.cuda(), backend="cuda")
    ref = reference.grouped_linear_wgrad(dy.cpu().double(), x.cpu().double(), sizes)
    assert len(grads) == 3 and all(g.shape == (8, 4) and g.is_contiguous() and not g._is_view() for g in grads)
    assert [g.data_ptr() - grads[0].data_ptr() for g in grads] == [0, 64, 128]  # bytes: 32 bf16 per group
    for g, r in zip(grads, ref):
        assert torch.allclose(g.double().cpu(), r, rtol=2e-2, atol=2e-2)
    before = [g.clone() for g in grads]
    grads[1].add_(1.0)
    assert torch.equal(grads[0], before[0]) and torch.equal(grads[2], before[2])
    assert torch.equal(grads[1], before[1] + 1.0)
    assert grads[1]._version == 1 and grads[0]._version == 0

    params = [torch.nn.Parameter(torch.zeros(8, 4, dtype=torch.bfloat16, device="cuda")) for _ in range(3)]

    class HandOver(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *ps):
            return ps[0].sum()

        @staticmethod
        def backward(ctx, _):
            return tuple(ops.grouped_linear_wgrad(dy, x, sizes.cuda(), backend="cuda"))

    HandOver.apply(*params).backward()
    for p, r in zip(params, ref):
        assert p.grad.shape == (8, 4) and torch.allclose(p.grad.double().cpu(), r, rtol=2e-2, atol=2e-2)
    assert params[1].grad.data_ptr() - params[0].grad.data_ptr() == 64  # stolen, not copied


def test_split_groups(ext):
    buf = torch.arange(24.0, device="cuda").view(2, 3, 4)[:, :, :]
    parts = ext.split_groups(buf)
    assert [torch.equal(p, buf[g]) for g, p in enumerate(parts)] == [True, True]
    assert ext.split_groups(buf[1:])[0].data_ptr() == buf[1].data_ptr()  # storage offsets kept
    assert ext.split_groups(torch.empty(0, 3, device="cuda")) == []
    with pytest.raises(RuntimeError, match="split_groups: buffer must be contiguous"):
        ext.split_groups(buf.transpose(1, 2))


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("shape,dtype,G", [((64, 128), torch.bfloat16, 8), ((13, 7), torch.float32, 8),
                                           ((64, 128), torch.bfloat16, 300)])
def test_stacked_gradients_are_the_per_group_tensors(ext, shape, dtype, G, accumulate):
    """Gradients written into one stacked [G, N, K] buffer (how a layer's backward holds them; here strided along
    G) are the per-group tensors' bit for bit, overwritten or accumulated; the buffer itself is returned, and one
    whose groups are not contiguous is refused."""
    N, K = shape
    gen = torch.Generator().manual_seed(G + N + accumulate)
    sizes = group_sizes(G, "with_empty", gen)
    M = int(sizes.sum())
    dy = torch.randn(M, N, generator=gen).to(dtype).cuda()
    x = torch.randn(M, K, generator=gen).to(dtype).cuda()
    init = torch.randn(G, N + 2, K, generator=gen).to(dtype).cuda()
    sc = sizes.cuda()
    per_group = [t.clone() for t in init[:, :N].unbind(0)]
    ops.grouped_linear_wgrad(dy, x, sc, out=per_group, accumulate=accumulate, backend="cuda")
    stacked = init.clone()[:, :N]
    if not accumulate:
        stacked.fill_(float("nan"))
    assert ops.grouped_linear_wgrad(dy, x, sc, out=stacked, accumulate=accumulate, backend="cuda") is stacked
    assert torch.equal(stacked, torch.stack(per_group))
    with pytest.raises(RuntimeError, match="each group of the stacked gradients must be contiguous"):
        ops.grouped_linear_wgrad(dy, x, sc, out=stacked.transpose(1, 2).contiguous().transpose(1, 2), backend="cuda")
