"""permute (row gather) on CUDA vs the torch reference: exact, every dtype, aligned or not."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("T,H,P,dtype,itype", list(itertools.product(
    [1, 300], [1, 3, 8, 2048, 1027], [0, 1, 1000], DTYPES, [torch.int64, torch.int32])))
def test_matches_reference(ext, T, H, P, dtype, itype):
    gen = torch.Generator().manual_seed(T + 7 * H + 13 * P)
    x = torch.randn(T, H, generator=gen).to(dtype).cuda()
    idx = torch.randint(0, T, (P,), generator=gen).to(itype).cuda()  # repeats included
    out = torch.full((P, H), float("nan"), dtype=dtype, device="cuda")
    ext.permute(x, idx, out)
    ref = reference.permute(x.cpu(), idx.cpu())
    assert torch.equal(out.cpu(), ref)
    assert torch.equal(ops.permute(x, idx, backend="cuda").cpu(), ref)


@pytest.mark.parametrize("H,dtype,stype", list(itertools.product(
    [8, 5, 2048], DTYPES, [torch.float32, torch.bfloat16])))
def test_scaled_matches_reference(ext, H, dtype, stype):
    """out[i] = x[idx[i]] * scale[i]: bit-equal to the reference (scale rounded to x's dtype, one rounding)."""
    gen = torch.Generator().manual_seed(H)
    T, P = 300, 1000
    x = torch.randn(T, H, generator=gen).to(dtype)
    idx = torch.randint(0, T, (P,), generator=gen)
    scale = (3 * torch.rand(P, generator=gen)).to(stype)
    scale[:7] = 0                                               # a dropped weight: exact zeros
    ref = reference.permute(x, idx, scale)
    got = ops.permute(x.cuda(), idx.cuda(), scale.cuda(), backend="cuda")
    assert torch.equal(got.cpu(), ref) and not got[:7].any()
    assert torch.equal(got, x.cuda()[idx.cuda()] * scale.cuda().to(dtype).unsqueeze(1))  # torch's own CUDA result
    if dtype == torch.bfloat16:  # unaligned rows take the scalar path
        base = torch.randn(T * H + 1, device="cuda").to(dtype)
        xu = base[1:].view(T, H)
        assert torch.equal(ops.permute(xu, idx.cuda(), scale.cuda(), backend="cuda").cpu(),
                           reference.permute(xu.cpu(), idx, scale))
    assert ops.permute(x.cuda(), idx[:0].cuda(), scale[:0].cuda(), backend="cuda").shape == (0, H)


def test_unaligned_rows(ext):
    """A view starting at an odd element: the kernel must fall back from 16-byte vectors."""
    base = torch.randn(64 * 16 + 1, dtype=torch.bfloat16, device="cuda")
    x = base[1:].view(64, 16)
    idx = torch.randperm(64, device="cuda")
    assert torch.equal(ops.permute(x, idx, backend="cuda"), x[idx])


def test_bad_input(ext):
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match=r"row_scale must be \[P\]"):
        ops.permute(x, torch.zeros(3, dtype=torch.long, device="cuda"), torch.ones(2, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ops.permute(x, torch.zeros(3, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.permute(x, torch.zeros(3, dtype=torch.long), torch.empty(3, 8, device="cuda"))
