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
    """Each expert's two weights, as views of the layer's stacked parameters."""
    experts = layer.deepspeed_moe.experts
    return list(experts.weight1.detach().unbind(0)), list(experts.weight2.detach().unbind(0))


def expert_grads(layer):
    """Each expert's two weight gradients (None where the stacked parameter got none)."""
    experts = layer.deepspeed_moe.experts
    return [[None] * W.shape[0] if W.grad is None else list(W.grad.unbind(0)) for W in (experts.weight1, experts.weight2)]


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
    g1, g2 = expert_grads(layer)
    for g, r in zip(g1 + g2, ref_w1 + ref_w2):
        if r.grad is None:  # an expert with no token: no gradient at all, or an exact zero
            assert g is None or not g.any()
        else:
            assert rel(g, r.grad) < 1e-10


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
    dense = lrmoe_ds.SwiGLUExpert(H, F).double()
    with torch.no_grad():
        dense.gate_up_proj.weight.copy_(layer.deepspeed_moe.experts.weight1[0])
        dense.down_proj.weight.copy_(layer.deepspeed_moe.experts.weight2[0])
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
    w = whole.deepspeed_moe.experts.weight1
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[0], w[2])
    mine, theirs = half.deepspeed_moe.experts, whole.deepspeed_moe.experts
    assert torch.equal(mine.weight1, theirs.weight1[:2]) and torch.equal(mine.weight2, theirs.weight2[:2])
    # each expert initialised as its own nn.Linear pair would be, from init_seed + its global index
    # (the values the per-expert modules of earlier versions had)
    torch.manual_seed(5)
    lrmoe_ds.SwiGLUExpert(H, F)  # the layer builds its template expert first (nn.Linear's init draws)
    seed = int(torch.randint(0, 2 ** 62, ()))
    for e in range(4):
        gen = torch.Generator().manual_seed(seed + e)
        up = torch.empty(2 * F, H).uniform_(-H ** -0.5, H ** -0.5, generator=gen)
        down = torch.empty(H, F).uniform_(-F ** -0.5, F ** -0.5, generator=gen)
        assert torch.equal(theirs.weight1[e], up) and torch.equal(theirs.weight2[e], down)
    assert torch.equal(half.deepspeed_moe.gate.wg.weight, whole.deepspeed_moe.gate.wg.weight)


def test_no_tokens():
    # a rank can receive no token (and, with ep_size > 1, its experts no rows)
    layer = lrmoe_ds.LRMoE(H, num_experts=4, k=2, ffn_hidden_size=F).double()
    x = torch.zeros(0, H, dtype=torch.float64, requires_grad=True)
    out, aux, counts = layer(x)
    out.sum().backward()
    assert out.shape == (0, H) and float(aux) == 0.0 and counts.sum() == 0 and x.grad.shape == (0, H)


def test_replaced_expert_weight_is_used():
    # the grouped GEMMs read the stacked weights the layer holds now: a weight replaced by assignment, its
    # storage re-pointed (as DeepSpeed's optimizers do with param.data) or converted must be seen
    layer, x = make_case("softmax", 2, "swiglu", seed=3, skewed=False)
    experts = layer.deepspeed_moe.experts
    before = layer(x)[0]
    experts.weight2 = torch.nn.Parameter(torch.zeros_like(experts.weight2))
    zero_down = layer(x)[0]
    assert not torch.equal(before, zero_down) and not zero_down.any()
    W = torch.randn_like(experts.weight1)
    experts.weight1.data = W
    w1, w2, _ = experts.projections()
    assert w1.data_ptr() == W.data_ptr() and not w1.requires_grad
    # a conversion that replaces the Parameter objects themselves (torch.__future__'s overwrite mode)
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        layer.float()
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(False)
    w1, w2, _ = experts.projections()
    assert w1.dtype == torch.float32 and w1.data_ptr() == experts.weight1.data_ptr()
    assert torch.equal(w1, experts.weight1) and torch.equal(w2, experts.weight2)


def test_state_dict_names_each_expert_as_deepspeed_does():
    """DeepSpeed's MoE checkpoint splits a layer's state by ``deepspeed_experts.<i>.`` into one file per
    expert: the stacked weights are saved and loaded under those names."""
    layer, _ = make_case("softmax", 2, "swiglu", seed=6, skewed=False)
    state = layer.state_dict()
    keys = [k for k in state if "experts" in k]
    assert sorted(keys) == sorted(f"deepspeed_moe.experts.deepspeed_experts.{i}.{n}.weight"
                                  for i in range(E) for n in ("gate_up_proj", "down_proj"))
    assert torch.equal(state["deepspeed_moe.experts.deepspeed_experts.3.down_proj.weight"],
                       layer.deepspeed_moe.experts.weight2[3])
    torch.manual_seed(1)
    other = lrmoe_ds.LRMoE(H, num_experts=E, k=2, ffn_hidden_size=F).double()
    assert not torch.equal(other.deepspeed_moe.experts.weight1, layer.deepspeed_moe.experts.weight1)
    other.load_state_dict({k: v.clone() for k, v in state.items()})
    assert torch.equal(other.deepspeed_moe.experts.weight1, layer.deepspeed_moe.experts.weight1)
    assert torch.equal(other.deepspeed_moe.experts.weight2, layer.deepspeed_moe.experts.weight2)
    gelu = lrmoe_ds.LRMoE(H, num_experts=2, k=1, ffn_hidden_size=F, activation="gelu")
    assert "deepspeed_moe.experts.deepspeed_experts.1.fc2.weight" in gelu.state_dict()
    del state["deepspeed_moe.experts.deepspeed_experts.2.gate_up_proj.weight"]  # one expert's entry missing
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*experts.weight1(.|\n)*Unexpected key\(s\).*"
                                           r"deepspeed_experts.0.gate_up_proj.weight"):
        other.load_state_dict(state)


def test_expert_weight_changed_before_backward_is_an_error():
    layer, x = make_case("softmax", 2, "swiglu", seed=4, skewed=False)
    out = layer(x.requires_grad_(True))[0]
    with torch.no_grad():
        layer.deepspeed_moe.experts.weight1.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("ratio", [None, 1.0])
def test_a_retained_graph_gives_the_same_gradients_again(ratio):
    """A second backward through a retained graph reads the saved tensors as the first did (a guard for any
    backward that reuses a saved buffer in place, as ops.swiglu_backward(inplace=True) allows)."""
    layer, x = make_case("softmax", 2, "swiglu", seed=5, skewed=False)
    if ratio is not None:
        layer.configure(lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=ratio, policy="stash"))
    xi = x.clone().requires_grad_(True)
    loss = (layer(xi)[0] * torch.linspace(-1, 1, x.numel(), dtype=x.dtype).view_as(x)).sum()
    loss.backward(retain_graph=True)
    first = [t.grad.clone() for t in (xi, *layer.parameters())]
    loss.backward()
    assert all(torch.equal(t.grad, 2 * g) for t, g in zip((xi, *layer.parameters()), first))


def test_expert_weight_gradients_reach_autograd_after_the_router_backward():
    """The stacked expert weights enter the graph through one node made before the router: their gradients
    are accumulated (each through its own AccumulateGrad, so hooks such as DeepSpeed's fire once per weight
    and step) after the router's. Frozen experts get none and cost no node."""
    layer, x = make_case("softmax", 2, "swiglu", seed=3, skewed=False)
    w1, w2 = [layer.deepspeed_moe.experts.weight1], [layer.deepspeed_moe.experts.weight2]
    order = []
    layer.deepspeed_moe.gate.wg.weight.register_post_accumulate_grad_hook(lambda p: order.append("router"))
    for i, w in enumerate(w1 + w2):
        w.register_post_accumulate_grad_hook(lambda p, i=i: order.append(i))
    for step in range(2):
        layer.zero_grad(set_to_none=True)
        order.clear()
        layer(x.requires_grad_(True))[0].sum().backward()
        assert order[0] == "router" and sorted(order[1:]) == [0, 1], order
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
