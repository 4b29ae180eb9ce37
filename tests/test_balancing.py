"""Aux-loss-free load balancing: ExpertBiasBalancer counts the pairs of every training forward and moves
each selection bias by rate * sign(mean - count) once per optimizer step."""
from types import SimpleNamespace

import pytest
import torch

import lrmoe_ds
from lrmoe_ds import ExpertBiasBalancer, LRMoEConfig

H, E, K, F = 16, 8, 2, 12


def layer(expert_bias=True):
    torch.manual_seed(0)
    moe = lrmoe_ds.LRMoE(H, num_experts=E, k=K, ffn_hidden_size=F, score_func="sigmoid", expert_bias=expert_bias)
    with torch.no_grad():
        moe.deepspeed_moe.gate.wg.weight[0] += 1.0  # expert 0 is hot: every token leans towards it
    return moe


def tokens(seed, n=32):
    return torch.randn(n, H, generator=torch.Generator().manual_seed(seed)) + 0.5


def test_update_is_rate_times_sign_of_mean_minus_count_over_the_step():
    moe = layer()
    balancer = ExpertBiasBalancer([moe], rate=0.01)
    counts = sum(moe(tokens(s))[2] for s in (1, 2))  # two micro-batches of one step
    moe.eval()
    moe(tokens(3))  # evaluation: not counted
    moe.train()
    balancer.update()
    expected = 0.01 * torch.sign(counts.float().mean() - counts.float())
    assert torch.equal(moe.deepspeed_moe.gate.score_bias, expected)
    assert expected[0] < 0 and (expected != 0).sum() >= 2  # the hot expert loses, someone gains

    second = moe(tokens(4))[2]  # counting starts afresh after an update
    balancer.update()
    assert torch.equal(moe.deepspeed_moe.gate.score_bias,
                       expected + 0.01 * torch.sign(second.float().mean() - second.float()))
    before = moe.deepspeed_moe.gate.score_bias.clone()
    balancer.update()  # no forward since: nothing moves
    assert torch.equal(moe.deepspeed_moe.gate.score_bias, before)


def test_repeated_updates_balance_a_skewed_router():
    moe = layer()
    balancer = ExpertBiasBalancer([moe], rate=0.02)
    x = tokens(5, n=256)

    def max_over_mean():
        with torch.no_grad():
            counts = moe(x)[2].float()
        return float(counts.max() / counts.mean())

    start = max_over_mean()
    balancer.update()
    for _ in range(60):
        max_over_mean()
        balancer.update()
    assert start > 2.0 and max_over_mean() < 0.6 * start, (start, max_over_mean())


def test_the_bias_only_selects_and_is_saved():
    """The gate weights are the unbiased scores of the chosen experts; the bias is part of the state dict."""
    moe = layer()
    with torch.no_grad():
        moe.deepspeed_moe.gate.score_bias[3] = 10.0  # expert 3 chosen by every token
    x = tokens(6)
    gate = moe.deepspeed_moe.gate
    routed = gate(x)
    assert int(routed.counts[3]) == x.shape[0]
    scores = torch.sigmoid(x @ gate.wg.weight.t()).gather(1, routed.topk_index)
    assert torch.allclose(routed.topk_weight, scores / scores.sum(1, keepdim=True), rtol=1e-5, atol=1e-6)
    state = moe.state_dict()
    assert torch.equal(state["deepspeed_moe.gate.score_bias"], moe.deepspeed_moe.gate.score_bias)


def test_refuses_a_model_without_a_bias_to_update():
    with pytest.raises(ValueError, match="expert_bias=True"):
        ExpertBiasBalancer([layer(expert_bias=False)], rate=0.01)
    with pytest.raises(ValueError, match="must be > 0"):
        ExpertBiasBalancer([layer()], rate=0.0)
    with pytest.raises(ValueError, match="expert_bias_update_rate"):
        LRMoEConfig(expert_bias_update_rate=-1.0)


class FakeEngine:
    """DeepSpeed's engine as the balancer sees it: step() advances global_steps at each accumulation boundary."""

    def __init__(self, module, accumulation=2):
        self.module, self.global_steps, self.micro, self.accumulation = module, 0, 0, accumulation

    def step(self):
        self.micro += 1
        if self.micro % self.accumulation == 0:
            self.global_steps += 1


def train(moe, engine, steps, start=0):
    for step in range(start, start + steps):
        for micro in range(engine.accumulation):
            moe(tokens(10 * step + micro))
            engine.step()


def test_attach_updates_once_per_optimizer_step_right_after_it():
    moe = layer()
    balancer = ExpertBiasBalancer([moe], rate=0.01)
    engine = FakeEngine(moe)
    balancer.attach(engine)
    updates = []
    balancer.update = lambda: updates.append(engine.global_steps)
    train(moe, engine, 3)
    assert updates == [1, 2, 3]  # after the boundary step() of each optimizer step, none pending
    balancer.remove()
    assert not moe._forward_hooks and "step" not in vars(engine)


def test_a_resumed_run_moves_the_bias_as_an_uninterrupted_one():
    """A checkpoint taken after step 2 holds the bias with step 2's update: resumed from it, steps 3-4 end where
    an uninterrupted run of 4 steps does (an update pending at the next forward would be lost with the process)."""
    moe = layer()
    ExpertBiasBalancer([moe], rate=0.01).attach(engine := FakeEngine(moe))
    train(moe, engine, 4)
    first = layer()
    ExpertBiasBalancer([first], rate=0.01).attach(engine := FakeEngine(first))
    train(first, engine, 2)
    saved = {k: v.clone() for k, v in first.state_dict().items()}  # the checkpoint after step 2
    resumed = layer()
    resumed.load_state_dict(saved)
    ExpertBiasBalancer([resumed], rate=0.01).attach(engine := FakeEngine(resumed))
    engine.global_steps = 2  # as DeepSpeed restores it
    train(resumed, engine, 2, start=2)
    bias = moe.deepspeed_moe.gate.score_bias
    assert bias.abs().max() > 0 and torch.equal(resumed.deepspeed_moe.gate.score_bias, bias)
