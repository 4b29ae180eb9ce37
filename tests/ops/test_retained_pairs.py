"""retained_pairs on CUDA vs the torch reference, bit for bit, with poisoned outputs: every map of the kept pairs,
with and without the rescale, for each gate dtype, none kept and all kept."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T,K,kept_fraction,dtype,rescale", list(itertools.product(
    [1, 4099], [1, 8], [0.0, 0.5, 1.0], [torch.float32, torch.float16, torch.bfloat16], [True, False])))
def test_matches_reference(ext, T, K, kept_fraction, dtype, rescale):
    gen = torch.Generator().manual_seed(T + K + int(10 * kept_fraction))
    P = T * K
    order = torch.randperm(P, generator=gen)
    weight_of_row = torch.rand(P, generator=gen).to(dtype)
    kept = torch.randperm(P, generator=gen)[: int(kept_fraction * P)].sort().values
    scale = 1.0 + 3.0 * torch.rand(kept.numel(), generator=gen)
    ref = reference.retained_pairs(kept, scale, order, weight_of_row, K, rescale)
    cuda_in = [t.cuda() for t in (kept, scale, order, weight_of_row)]
    outs = [torch.full_like(r, -7, device="cuda") for r in ref]  # poisoned: each entry must be written
    ext.retained_pairs(*cuda_in, K, rescale, *outs)
    for o, r in zip(outs, ref):
        assert o.dtype == r.dtype and o.shape == r.shape and torch.equal(o.cpu(), r)
    api = ops.retained_pairs(*cuda_in, K, rescale, backend="cuda")
    for a, r in zip(api, ref):
        assert a.is_cuda and torch.equal(a.cpu(), r)


def test_bad_input(ext):
    kept, scale = torch.tensor([0, 2], device="cuda"), torch.ones(2, device="cuda")
    order, w = torch.arange(6, device="cuda"), torch.rand(6, device="cuda")
    with pytest.raises(ValueError, match="not a multiple of k = 4"):
        ops.retained_pairs(kept, scale, order, w, 4, backend="cuda")
    with pytest.raises(RuntimeError, match="one entry per kept row"):
        ops.retained_pairs(kept, scale[:1], order, w, 2, backend="cuda")
    with pytest.raises(RuntimeError, match="5 row weights for 6 send rows"):
        ops.retained_pairs(kept, scale, order, w[:5], 2, backend="cuda")
    with pytest.raises(RuntimeError, match="kept and order must be int64"):
        ops.retained_pairs(kept.int(), scale, order, w, 2, backend="cuda")
