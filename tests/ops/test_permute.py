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


def test_unaligned_rows(ext):
    """A view starting at an odd element: the kernel must fall back from 16-byte vectors."""
    base = torch.randn(64 * 16 + 1, dtype=torch.bfloat16, device="cuda")
    x = base[1:].view(64, 16)
    idx = torch.randperm(64, device="cuda")
    assert torch.equal(ops.permute(x, idx, backend="cuda"), x[idx])


def test_bad_input(ext):
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ops.permute(x, torch.zeros(3, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="CUDA tensor"):
        ext.permute(x, torch.zeros(3, dtype=torch.long), torch.empty(3, 8, device="cuda"))
