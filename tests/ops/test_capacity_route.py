"""capacity_route on CUDA vs the torch reference: exact assignment, including pairs that fit nowhere."""
import itertools

import pytest
import torch

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

pytestmark = pytest.mark.gpu


def _case(E, R, P, replicas, cap_scale, grouped, gen):
    """Each expert has a home instance on rank e % R, plus `replicas` random extra instances; some
    experts (the last) have none. Pairs: random expert and rank."""
    ig, ir = [], []
    for e in range(E - 1 if E > 1 else E):
        ig.append(e)
        ir.append(e % R)
        for _ in range(replicas):
            ig.append(e)
            ir.append(int(torch.randint(0, R, (1,), generator=gen)))
    perm = torch.randperm(len(ig), generator=gen)  # instances in no particular order
    ig, ir = torch.tensor(ig)[perm], torch.tensor(ir)[perm]
    mean = max(1, P // max(1, len(ig)))
    cap = (torch.rand(len(ig), generator=gen) * cap_scale * mean).long()
    cap[::4] = 0
    pg = torch.randint(0, E, (P,), generator=gen)
    pr = torch.randint(0, R, (P,), generator=gen)
    if grouped:
        o = torch.argsort(pg, stable=True)
        pg, pr = pg[o], pr[o]
    return pg, pr, ig, ir, cap


@pytest.mark.parametrize("E,R,P,replicas,cap_scale,grouped", list(itertools.product(
    [1, 4, 16], [1, 2, 4], [0, 1, 700], [0, 1, 3], [0.5, 1.0, 3.0], [True, False])))
def test_matches_reference(ext, E, R, P, replicas, cap_scale, grouped):
    gen = torch.Generator().manual_seed(E * 1000 + R * 100 + P + replicas)
    pg, pr, ig, ir, cap = _case(E, R, P, replicas, cap_scale, grouped, gen)
    args = [t.cuda() for t in (pg, pr, ig, ir, cap)]
    out = torch.full((P,), 12345, dtype=torch.long, device="cuda")
    ext.capacity_route(*args, out)
    ref = reference.capacity_route(pg, pr, ig, ir, cap)
    assert torch.equal(out.cpu(), ref)
    api = ops.capacity_route(*args, backend="cuda")
    assert torch.equal(api.cpu(), ref)


def test_one_hot_expert_water_fill(ext):
    """All pairs to one expert with four instances of unequal spare capacity: exercises the water-fill."""
    gen = torch.Generator().manual_seed(0)
    P = 3000
    pg = torch.zeros(P, dtype=torch.long)
    pr = torch.randint(0, 4, (P,), generator=gen)
    ig = torch.zeros(4, dtype=torch.long)
    ir = torch.tensor([0, 1, 2, 3])
    for cap in ([100, 400, 900, 1300], [10, 10, 10, 10], [0, 0, 0, 0], [5000, 0, 7, 7]):
        cap = torch.tensor(cap)
        ref = reference.capacity_route(pg, pr, ig, ir, cap)
        got = ops.capacity_route(pg.cuda(), pr.cuda(), ig.cuda(), ir.cuda(), cap.cuda(), backend="cuda")
        assert torch.equal(got.cpu(), ref)


def test_bad_input(ext):
    t = torch.zeros(3, dtype=torch.long, device="cuda")
    with pytest.raises(RuntimeError, match="same length"):
        ops.capacity_route(t, t, t, t[:2], t, backend="cuda")
    with pytest.raises(RuntimeError, match="pair ranks"):
        ops.capacity_route(t, t[:1], t, t, t, backend="cuda")
