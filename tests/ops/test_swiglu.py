"""swiglu / swiglu_backward on CUDA vs an fp64 reference (the torch reference ops in float64)."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("M,F,dtype", list(itertools.product([1, 37, 4096], [8, 5, 768, 1408], DTYPES)))
def test_matches_fp64_reference(ext, rel_fro, tol, M, F, dtype):
    gen = torch.Generator().manual_seed(M + 7 * F)
    h64 = 4 * torch.randn(M, 2 * F, generator=gen, dtype=torch.float64)
    da64 = torch.randn(M, F, generator=gen, dtype=torch.float64)
    h, da = h64.to(dtype).cuda(), da64.to(dtype).cuda()
    a_ref = reference.swiglu(h.cpu().double())          # the rounded inputs, in fp64
    dh_ref = reference.swiglu_backward(h.cpu().double(), da.cpu().double())
    a = torch.full((M, F), float("nan"), dtype=dtype, device="cuda")
    ext.swiglu(h, a)
    dh = torch.full((M, 2 * F), float("nan"), dtype=dtype, device="cuda")
    ext.swiglu_backward(h, da, dh)
    assert rel_fro(a, a_ref) < tol[dtype] and rel_fro(dh, dh_ref) < tol[dtype]
    assert torch.equal(ops.swiglu(h, backend="cuda"), a)
    assert torch.equal(ops.swiglu_backward(h, da, backend="cuda"), dh)


@pytest.mark.parametrize("M,F,dtype", list(itertools.product([1, 37, 4096], [5, 1408], DTYPES)))
def test_fused_backward_in_place_is_the_two_kernels(ext, M, F, dtype):
    """dh written over h, with the activation recomputed from the same read: the very bits of swiglu and
    swiglu_backward run apart, on fresh inputs (both pack widths: F = 5 takes the scalar path)."""
    gen = torch.Generator().manual_seed(M + 13 * F)
    h = (4 * torch.randn(M, 2 * F, generator=gen)).to(dtype).cuda()
    da = torch.randn(M, F, generator=gen).to(dtype).cuda()
    a_ref, dh_ref = ops.swiglu(h, backend="cuda"), ops.swiglu_backward(h, da, backend="cuda")
    buffer = h.clone()
    dh, a = ops.swiglu_backward(buffer, da, inplace=True, with_activation=True, backend="cuda")
    assert dh.data_ptr() == buffer.data_ptr()
    assert torch.equal(dh, dh_ref) and torch.equal(a, a_ref)
    dh2, a2 = ops.swiglu_backward(h, da, with_activation=True, backend="cuda")
    assert dh2.data_ptr() != h.data_ptr() and torch.equal(dh2, dh_ref) and torch.equal(a2, a_ref)
    assert torch.equal(ops.swiglu_backward(h.clone(), da, inplace=True, backend="cuda"), dh_ref)


@pytest.mark.parametrize("M,F,dtype", list(itertools.product([0, 1, 37, 4096], [5, 1408], DTYPES)))
def test_indexed_backward_is_a_gather_then_the_kernel(ext, M, F, dtype):
    """index: dh and a from h's rows index[m] (a random subset with repeats, in any order), the very bits of
    permute then swiglu_backward; h is left as it is (both pack widths)."""
    gen = torch.Generator().manual_seed(M + 17 * F)
    h = (4 * torch.randn(M + 3, 2 * F, generator=gen)).to(dtype).cuda()
    index = torch.randint(0, M + 3, (M,), generator=gen).cuda()
    da = torch.randn(M, F, generator=gen).to(dtype).cuda()
    gathered = ops.permute(h, index, backend="cuda")
    dh_ref, a_ref = ops.swiglu_backward(gathered, da, with_activation=True, backend="cuda")
    before = h.clone()
    dh, a = ops.swiglu_backward(h, da, with_activation=True, index=index, backend="cuda")
    assert dh.shape == (M, 2 * F) and torch.equal(dh, dh_ref) and torch.equal(a, a_ref)
    assert torch.equal(ops.swiglu_backward(h, da, index=index, backend="cuda"), dh_ref)
    assert torch.equal(h, before)


@pytest.mark.parametrize("M,F,dtype,indexed", list(itertools.product([0, 1, 37, 4096], [5, 768, 1408], DTYPES,
                                                                      [False, True])))
def test_backward_dot_is_the_rows_dot(ext, M, F, dtype, indexed):
    """dot[m] = <a_m, da_m> (fp32) from the same pass: dh and a the very bits of the kernel without it, the dot
    that of the written a and da (fp64 sums over the rounded values) to fp32 accuracy; in place or from indexed
    rows; every entry written (NaN-poisoned first); both pack widths (F = 5 takes the scalar path)."""
    gen = torch.Generator().manual_seed(M + 19 * F)
    h = (4 * torch.randn(M + 3, 2 * F, generator=gen)).to(dtype).cuda()
    index = torch.randint(0, M + 3, (M,), generator=gen).cuda() if indexed else None
    h = h if indexed else h[:M].contiguous()
    da = torch.randn(M, F, generator=gen).to(dtype).cuda()
    dh_ref, a_ref = ops.swiglu_backward(h, da, with_activation=True, index=index, backend="cuda")
    src = h if indexed else h.clone()
    dh, a = torch.empty_like(dh_ref), torch.empty_like(a_ref)
    dot = torch.full((M,), float("nan"), device="cuda")
    ext.swiglu_backward(src, da, src if not indexed else dh, a, index, dot)
    dh = dh if indexed else src
    assert torch.equal(dh, dh_ref) and torch.equal(a, a_ref)
    expected = (a_ref.double() * da.double()).sum(1)
    scale = (a_ref.double().abs() * da.double().abs()).sum(1)  # the sum's condition: fp32 rounding is relative to it
    assert torch.isfinite(dot).all()
    assert ((dot.double() - expected).abs() <= 5e-6 * scale + 1e-30).all()  # above fp32's bound for 50 terms a lane
    assert torch.equal(ops.swiglu_backward(h, da, with_activation=True, index=index, with_dot=True, backend="cuda")[2], dot)


@pytest.mark.parametrize("M,F,dtype,indexed", list(itertools.product([0, 1, 37, 4096], [5, 768, 1408], DTYPES,
                                                                      [False, True])))
def test_dot_alone_is_the_backward_dot(ext, M, F, dtype, indexed):
    """swiglu_dot: the very bits of swiglu_backward's dot (the same kernel without its writes), every entry written
    (NaN-poisoned first), h left as it is; and that dot is to fp32 accuracy the fp64 reference's over the rounded a
    (the router's dot of a dropped pair, dz = dout W2)."""
    gen = torch.Generator().manual_seed(M + 23 * F)
    h = (4 * torch.randn(M + 3, 2 * F, generator=gen)).to(dtype).cuda()
    index = torch.randint(0, M + 3, (M,), generator=gen).cuda() if indexed else None
    h = h if indexed else h[:M].contiguous()
    dz = torch.randn(M, F, generator=gen).to(dtype).cuda()
    before = h.clone()
    dot = torch.full((M,), float("nan"), device="cuda")
    ext.swiglu_dot(h, dz, index, dot)
    assert torch.equal(h, before)
    assert torch.equal(dot, ops.swiglu_backward(h, dz, with_activation=True, index=index, with_dot=True,
                                                backend="cuda")[2])
    assert torch.equal(ops.swiglu_dot(h, dz, index, backend="cuda"), dot)
    a = ops.swiglu_backward(h, dz, with_activation=True, index=index, backend="cuda")[1].double()  # as rounded
    expected = (a * dz.double()).sum(1)
    scale = (a.abs() * dz.double().abs()).sum(1)
    assert ((dot.double() - expected).abs() <= 5e-6 * scale + 1e-30).all()


def test_dot_alone_rejects_bad_input(ext):
    h, dz = torch.randn(6, 16, device="cuda"), torch.randn(4, 8, device="cuda")
    index = torch.tensor([5, 0, 2, 2], device="cuda")
    with pytest.raises(RuntimeError, match="swiglu_dot: dz must be"):
        ext.swiglu_dot(h, dz, None, torch.empty(6, device="cuda"))
    with pytest.raises(RuntimeError, match="swiglu_dot: index must be int64"):
        ext.swiglu_dot(h, dz, index.int(), torch.empty(4, device="cuda"))
    with pytest.raises(RuntimeError, match="swiglu_dot: dot must be"):
        ext.swiglu_dot(h, dz, index, torch.empty(4, device="cuda", dtype=torch.float64))
    with pytest.raises(RuntimeError, match="swiglu_dot: h must be"):
        ext.swiglu_dot(h[:, :15].contiguous(), dz, index, torch.empty(4, device="cuda"))


def test_backward_dot_rejects_bad_input(ext):
    h, da = torch.randn(4, 16, device="cuda"), torch.randn(4, 8, device="cuda")
    dh = torch.empty_like(h)
    with pytest.raises(RuntimeError, match="dot needs a"):
        ext.swiglu_backward(h, da, dh, None, None, torch.empty(4, device="cuda"))
    with pytest.raises(RuntimeError, match="dot must be"):
        ext.swiglu_backward(h, da, dh, torch.empty(4, 8, device="cuda"), None, torch.empty(4, device="cuda").double())
    with pytest.raises(ValueError, match="with_activation"):
        ops.swiglu_backward(h, da, with_dot=True, backend="cuda")


def test_indexed_backward_rejects_bad_input(ext):
    h, da = torch.randn(6, 16, device="cuda"), torch.randn(4, 8, device="cuda")
    index = torch.tensor([5, 0, 2, 2], device="cuda")
    with pytest.raises(ValueError, match="inplace"):
        ops.swiglu_backward(h, da, inplace=True, index=index, backend="cuda")
    with pytest.raises(RuntimeError, match="int64"):
        ext.swiglu_backward(h, da, torch.empty(4, 16, device="cuda"), None, index.int())
    with pytest.raises(RuntimeError, match="da must be"):
        ext.swiglu_backward(h, da, torch.empty(4, 16, device="cuda"), None, index[:3])
    with pytest.raises(RuntimeError, match="memory location"):  # dh over h: with an index, never in place
        ext.swiglu_backward(h, da, h[:4], None, index)


def test_fused_backward_rejects_overlaps(ext):
    """dh is h itself or apart from it; a shares memory with nothing: else torch's overlap error, not a race."""
    buffer = torch.randn(4 * 16 + 8, device="cuda")
    h, da = buffer[:64].view(4, 16), torch.randn(4, 8, device="cuda")
    with pytest.raises(RuntimeError, match="memory location"):     # dh half a row past h
        ext.swiglu_backward(h, da, buffer[8:72].view(4, 16), None)
    with pytest.raises(RuntimeError, match="memory location"):     # a over da
        ext.swiglu_backward(h, da, torch.empty_like(h), da)
    with pytest.raises(RuntimeError, match="memory location"):     # a over h's gate columns
        ext.swiglu_backward(h, da, torch.empty_like(h), buffer[:32].view(4, 8))


def test_extremes_and_empty(ext):
    h = torch.tensor([[-1e4, 0.0, 1e4, -30.0, 3.0, 2.0, 5.0, 7.0]], device="cuda")
    a = ops.swiglu(h, backend="cuda")
    torch.testing.assert_close(a, reference.swiglu(h.double()).float())
    dh = ops.swiglu_backward(h, torch.ones(1, 4, device="cuda"), backend="cuda")
    assert torch.isfinite(a).all() and torch.isfinite(dh).all()
    torch.testing.assert_close(dh, reference.swiglu_backward(h.double(), torch.ones(1, 4).cuda().double()).float())
    empty = torch.zeros(0, 16, device="cuda", dtype=torch.bfloat16)
    assert ops.swiglu(empty, backend="cuda").shape == (0, 8)
    assert ops.swiglu_backward(empty, empty[:, :8], backend="cuda").shape == (0, 16)


def test_unaligned_view_input(ext, rel_fro, tol):
    """A row offset that breaks 16-byte alignment takes the scalar path and stays right."""
    base = torch.randn(65, 2 * 768, device="cuda", dtype=torch.bfloat16)
    h = base.view(-1)[2:2 + 64 * 1536].view(64, 1536)
    assert rel_fro(ops.swiglu(h, backend="cuda"), reference.swiglu(h.double())) < tol[torch.bfloat16]


def test_bad_input(ext):
    with pytest.raises(ValueError, match=r"\[M, 2F\]"):
        ops.swiglu(torch.zeros(3, 5, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="da must be"):
        ops.swiglu_backward(torch.zeros(3, 8, device="cuda"), torch.zeros(3, 3, device="cuda"), backend="cuda")
    with pytest.raises(RuntimeError, match="float32, float16 or bfloat16"):
        ops.swiglu(torch.zeros(3, 8, device="cuda", dtype=torch.float64), backend="cuda")
