"""routing_plan on CUDA vs the torch reference: exact counts, stable order and offsets."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu

CASES = list(itertools.product(
    [0, 1, 37, 4096, 131072],              # pairs
    [1, 8, 128, 9000],                     # groups (9000: past the shared-memory counters)
    ["uniform", "one_hot", "skewed"],      # how pairs are spread (most groups empty in one_hot)
    [torch.int64, torch.int32]))


def _groups(P, G, how, dtype, gen):
    if how == "uniform":
        g = torch.randint(0, G, (P,), generator=gen)
    elif how == "one_hot":
        g = torch.full((P,), int(torch.randint(0, G, (1,), generator=gen)))
    else:  # Zipf-like: group i drawn with probability ~ 1/(i+1)
        w = 1.0 / torch.arange(1, G + 1, dtype=torch.float64)
        g = torch.multinomial(w, P, replacement=True, generator=gen) if P else torch.zeros(0, dtype=torch.long)
    return g.to(dtype).cuda()


@pytest.mark.parametrize("P,G,how,dtype", CASES)
def test_matches_reference(ext, P, G, how, dtype):
    gen = torch.Generator().manual_seed(P * 31 + G)
    g = _groups(P, G, how, dtype, gen)
    # poisoned outputs, written by the kernel directly
    counts = torch.full((G,), -7, dtype=torch.long, device="cuda")
    order = torch.full((P,), -7, dtype=torch.long, device="cuda")
    offsets = torch.full((G + 1,), -7, dtype=torch.long, device="cuda")
    ext.routing_plan(g, G, counts, order, offsets)
    ref = reference.routing_plan(g.cpu(), G)
    assert torch.equal(counts.cpu(), ref[0])
    assert torch.equal(order.cpu(), ref[1])
    assert torch.equal(offsets.cpu(), ref[2])
    api = ops.routing_plan(g, G, backend="cuda")
    for a, r in zip(api, ref):
        assert a.is_cuda and torch.equal(a.cpu(), r)


def test_bad_input(ext):
    g = torch.zeros(4, dtype=torch.float32, device="cuda")
    with pytest.raises(RuntimeError, match="int32 or int64"):
        ops.routing_plan(g, 4, backend="cuda")
    with pytest.raises(RuntimeError, match="num_groups"):
        ops.routing_plan(g.long(), 0, backend="cuda")
