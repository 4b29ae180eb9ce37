"""Exact (dropless) LRMoE against the fp64 loop reference: output, aux loss and every gradient."""
import itertools

import pytest
import torch

import lrmoe_ds
from lrmoe_ds import dispatcher as dispatcher_module
from moe_reference import reference_moe

H, F, E, T = 8, 6, 6, 13
CASES = list(itertools.product(["softmax", "sigmoid"], [1, 2, 4], ["swiglu", "gelu"]))


def rel(a, b):
    return float((a - b).detach().norm() / b.detach().norm().clamp_min(1e-300))


def expert_weights(layer):
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    return [e.projections()[0] for e in experts], [e.projections()[1] for e in experts]


def make_case(score_func, k, activation, seed, skewed=True, **kw):
    g = torch.Generator().manual_seed(seed)
    layer = lrmoe_ds.LRMoE(H, num_experts=E, k=k, ffn_hidden_size=F, activation=activation,
                           score_func=score_func, **kw).double()
    x = torch.randn(T, H, generator=g, dtype=torch.float64)
    wg = torch.randn(E, H, generator=g, dtype=torch.float64)
    if skewed:
        # feature 0 is constant: expert 0 wins every token, expert E-1 never gets one
        x[:, 0] = 1.0
        wg[0, 0], wg[E - 1, 0] = 30.0, -30.0
    with torch.no_grad():
        layer.deepspeed_moe.gate.wg.weight.copy_(wg)
    return layer, x


@pytest.mark.parametrize("score_func,k,activation", CASES)
@pytest.mark.parametrize("skewed", [True, False])
def test_exact_matches_fp64_reference(score_func, k, activation, skewed):
    layer, x = make_case(score_func, k, activation, seed=k + 10 * skewed, skewed=skewed)
    x_ref = x.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    out, aux, counts = layer(x)
    w1s, w2s = expert_weights(layer)
    ref_params = [layer.deepspeed_moe.gate.wg.weight.detach().clone().requires_grad_(True)]
    ref_w1 = [w.detach().clone().requires_grad_(True) for w in w1s]
    ref_w2 = [w.detach().clone().requires_grad_(True) for w in w2s]
    ref_out, ref_aux, _, ref_counts = reference_moe(x_ref, ref_params[0], ref_w1, ref_w2, k, activation, score_func)

    if skewed:
        assert counts[0] == T and counts[E - 1] == 0, counts
    assert torch.equal(counts, ref_counts)
    assert rel(out, ref_out) < 1e-10
    assert abs(float(aux - ref_aux)) <= 1e-10 * abs(float(ref_aux))

    proj = torch.randn(T, H, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    ((out * proj).sum() + 0.3 * aux).backward()
    ((ref_out * proj).sum() + 0.3 * ref_aux).backward()
    assert rel(x.grad, x_ref.grad) < 1e-10
    assert rel(layer.deepspeed_moe.gate.wg.weight.grad, ref_params[0].grad) < 1e-10
    for w, r in zip(w1s + w2s, ref_w1 + ref_w2):
        if r.grad is None:  # an expert with no token: no gradient at all, or an exact zero
            assert w.grad is None or not w.grad.any()
        else:
            assert rel(w.grad, r.grad) < 1e-10


def test_z_loss_and_selection_bias():
    layer, x = make_case("sigmoid", 2, "swiglu", seed=3, skewed=False, expert_bias=True, z_loss_coef=0.01)
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0, 0.0, 5.0], dtype=torch.float32)
    layer.deepspeed_moe.gate.score_bias.copy_(bias)
    x_ref = x.clone().requires_grad_(True)
    x = x.clone().requires_grad_(True)
    out, aux, counts = layer(x)
    assert counts[1] == T and counts[5] == T  # the bias decides the selection...
    w1s, w2s = expert_weights(layer)
    wg = layer.deepspeed_moe.gate.wg.weight.detach().clone().requires_grad_(True)
    ref_out, ref_aux, ref_z, _ = reference_moe(x_ref, wg, [w.detach() for w in w1s], [w.detach() for w in w2s],
                                               2, "swiglu", "sigmoid", score_bias=bias.double())
    assert rel(out, ref_out) < 1e-10  # ...but not the weights
    out.sum().backward()
    (ref_out.sum() + 0.01 * ref_z).backward()  # the z-loss reaches the router in the backward only
    assert rel(layer.deepspeed_moe.gate.wg.weight.grad, wg.grad) < 1e-10
    assert rel(x.grad, x_ref.grad) < 1e-10


def test_one_expert_equals_dense_mlp():
    layer = lrmoe_ds.LRMoE(H, num_experts=1, k=1, ffn_hidden_size=F).double()
    x = torch.randn(3, 4, H, dtype=torch.float64)
    out, _, counts = layer(x)
    dense = layer.deepspeed_moe.experts.deepspeed_experts[0]
    assert torch.allclose(out, dense(x), rtol=1e-12, atol=1e-12) and counts.tolist() == [12]


def test_custom_expert_module_runs_in_a_loop():
    mlp = torch.nn.Sequential(torch.nn.Linear(H, F), torch.nn.ReLU(), torch.nn.Linear(F, H)).double()
    layer = lrmoe_ds.LRMoE(H, expert=mlp, num_experts=3, k=2).double()
    x = torch.randn(T, H, dtype=torch.float64, requires_grad=True)
    out, _, _ = layer(x)
    out.sum().backward()
    assert not layer.deepspeed_moe.experts.grouped and x.grad is not None
    with pytest.raises(ValueError, match="needs grouped experts"):
        layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.5))


def test_no_collectives_on_one_rank():
    dispatcher_module.COLLECTIVE_CALLS.clear()
    layer, x = make_case("softmax", 2, "swiglu", seed=0)
    layer(x.requires_grad_(True))[0].sum().backward()
    assert sum(dispatcher_module.COLLECTIVE_CALLS.values()) == 0


def test_bad_input_is_named():
    layer = lrmoe_ds.LRMoE(H, num_experts=4, k=2, ffn_hidden_size=F)
    with pytest.raises(ValueError, match="hidden size 8"):
        layer(torch.randn(3, H + 1))
    with pytest.raises(ValueError, match="divisible"):
        lrmoe_ds.LRMoE(H, num_experts=5, ep_size=2, ffn_hidden_size=F)
    with pytest.raises(ValueError, match="drop_tokens"):
        lrmoe_ds.LRMoE(H, num_experts=4, ffn_hidden_size=F, drop_tokens=True)
    with pytest.raises(ValueError, match="k must be"):
        lrmoe_ds.LRMoE(H, num_experts=4, k=5, ffn_hidden_size=F)


def test_built_in_experts_are_distinct_and_independent_of_ep_size():
    torch.manual_seed(5)
    whole = lrmoe_ds.LRMoE(H, num_experts=4, k=2, ffn_hidden_size=F)
    torch.manual_seed(5)
    half = lrmoe_ds.LRMoE(H, num_experts=4, ep_size=2, k=2, ffn_hidden_size=F)  # EP rank 0: experts 0, 1
    w = [e.gate_up_proj.weight for e in whole.deepspeed_moe.experts.deepspeed_experts]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    for mine, theirs in zip(half.deepspeed_moe.experts.deepspeed_experts, whole.deepspeed_moe.experts.deepspeed_experts):
        assert torch.equal(mine.gate_up_proj.weight, theirs.gate_up_proj.weight)
        assert torch.equal(mine.down_proj.weight, theirs.down_proj.weight)
    assert torch.equal(half.deepspeed_moe.gate.wg.weight, whole.deepspeed_moe.gate.wg.weight)


def test_no_tokens():
    # a rank can receive no token (and, with ep_size > 1, its experts no rows)
    layer = lrmoe_ds.LRMoE(H, num_experts=4, k=2, ffn_hidden_size=F).double()
    x = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    out, aux, counts = layer(x)
    out.sum().backward()
    assert out.shape == (0, H) and float(aux) == 0.0 and counts.sum() == 0 and x.grad.shape == (0, H)


def test_replaced_expert_weight_is_used():
    # the layer caches its experts' weight lists: a weight or an expert replaced by assignment must be seen
    layer, x = make_case("softmax", 2, "swiglu", seed=3, skewed=False)
    before = layer(x)[0]
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    experts[1].down_proj.weight = torch.nn.Parameter(torch.zeros_like(experts[1].down_proj.weight))
    experts[2] = lrmoe_ds.SwiGLUExpert(H, F).double()
    torch.nn.init.zeros_(experts[2].down_proj.weight)
    after = layer(x)[0]
    w1, w2 = expert_weights(layer)
    assert w2[1] is experts[1].down_proj.weight and w2[2] is experts[2].down_proj.weight
    cached_w1, cached_w2, _ = layer.deepspeed_moe.experts.projections()
    assert all(a is b for a, b in zip(cached_w1 + cached_w2, w1 + w2))
    assert not torch.equal(before, after)
    # a conversion that replaces the Parameter objects themselves (torch.__future__'s overwrite mode)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        layer.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    w1, w2 = expert_weights(layer)
    cached_w1, cached_w2, _ = layer.deepspeed_moe.experts.projections()
    assert w1[0].dtype == torch.float32 and all(a is b for a, b in zip(cached_w1 + cached_w2, w1 + w2))


def test_expert_weight_changed_before_backward_is_an_error():
    layer, x = make_case("softmax", 2, "swiglu", seed=4, skewed=False)
    out = layer(x.requires_grad_(True))[0]
    with torch.no_grad():
        layer.deepspeed_moe.experts.deepspeed_experts[0].gate_up_proj.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_expert_weight_gradients_reach_autograd_after_the_router_backward():
    """The expert weights enter the graph through one node made before the router: their gradients are
    accumulated (each through its own AccumulateGrad, so hooks such as DeepSpeed's fire once per weight
    and step) after the router's, where autograd used to run all 2 E of them first. Frozen experts
    get none and cost no node."""
    layer, x = make_case("softmax", 2, "swiglu", seed=3, skewed=False)
    w1, w2 = expert_weights(layer)
    order = []
    layer.deepspeed_moe.gate.wg.weight.register_post_accumulate_grad_hook(lambda p: order.append("router"))
    for i, w in enumerate(w1 + w2):
        w.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    for step in range(2):
        layer.zero_grad(set_to_none=True)
        order.clear()
        layer(x.requires_grad_(True))[0].sum().backward()
        assert order[0] == "router" and sorted(order[1:]) == list(range(2 * E)), order
    expected = [w.grad.clone() for w in w1 + w2]
    with torch.no_grad():
        out_no_grad = layer(x)[0]
    assert torch.equal(out_no_grad, layer(x)[0])
    for w in w1 + w2:
        w.requires_grad_(False)
        w.grad = None
    layer(x)[0].sum().backward()
    assert all(w.grad is None for w in w1 + w2) and x.grad is not None
    for w in w1 + w2:
        w.requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    (dx,) = torch.autograd.grad(layer(x)[0].sum(), x)   # the input's gradient alone: no weight node runs
    assert all(w.grad is None for w in w1 + w2)
    x.grad = None
    layer(x)[0].sum().backward()
    assert all(torch.equal(w.grad, e) for w, e in zip(w1 + w2, expected)) and torch.equal(dx, x.grad)
