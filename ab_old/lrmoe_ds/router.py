"""Router: token scores, top-k selection, gate weights and the router's auxiliary losses.

Two autograd nodes: the logits GEMM (:mod:`lrmoe_ds.router_gemm`) and the top-k math
(:class:`RouterTopK`, the fused op ``ops.router_topk``); the aux loss is two torch ops on the op's counts
and probability sums, and the z-loss a logsumexp of the logits."""
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn

from lrmoe_ds import ops
from lrmoe_ds.ops import reference
from lrmoe_ds.autograd import apply_fast
from lrmoe_ds.router_gemm import router_logits


@dataclass
class RoutingResult:
    """What the router hands the dispatcher. T tokens, K top-k, E experts.

    topk_index [T, K] int64: the experts of each token, in descending order of selection score.
    topk_weight [T, K] float: gate weights (fp32 or wider), differentiable.
    counts [E] int64: pairs routed to each expert from this rank's tokens.
    aux_loss: scalar load-balancing loss (unscaled; the caller multiplies by its coefficient).
    """
    topk_index: torch.Tensor
    topk_weight: torch.Tensor
    counts: torch.Tensor
    aux_loss: torch.Tensor


class _AddLossGradient(torch.autograd.Function):
    """Identity on ``x``; in the backward, adds d(coef * loss) to ``loss``'s inputs.

    Lets the z-loss reach the router with its own coefficient without changing the returned l_aux.
    """

    @staticmethod
    def forward(ctx, x, loss, coef):
        ctx.coef = coef
        ctx.loss_shape = loss.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.loss_shape, ctx.coef, dtype=grad.dtype, device=grad.device), None


class RouterTopK(torch.autograd.Function):
    """:func:`lrmoe_ds.ops.router_topk` as one autograd node, with :func:`lrmoe_ds.ops.router_topk_backward`
    as its backward: logits [T, E] -> (topk_index [T, K], topk_weight [T, K], counts [E], prob_sum [E]);
    topk_weight and prob_sum are differentiable."""

    @staticmethod
    def forward(ctx, logits, k, score_func, norm_topk_prob, score_bias, groups=(1, None)):
        topk_index, topk_weight, counts, prob_sum = ops.router_topk(logits, k, score_func, norm_topk_prob, score_bias,
                                                                    num_groups=groups[0], topk_groups=groups[1])
        ctx.mark_non_differentiable(topk_index, counts)
        ctx.set_materialize_grads(False)  # an unused output (prob_sum without the aux loss) costs nothing
        ctx.save_for_backward(logits, topk_index)
        ctx.score_func, ctx.norm_topk_prob = score_func, norm_topk_prob
        return topk_index, topk_weight, counts, prob_sum

    @staticmethod
    def backward(ctx, d_topk_index, d_topk_weight, d_counts, d_prob_sum):
        logits, topk_index = ctx.saved_tensors
        if d_topk_weight is None and d_prob_sum is None:
            return None, None, None, None, None, None
        if d_topk_weight is None:
            d_topk_weight = logits.new_zeros(topk_index.shape)
        d_logits = ops.router_topk_backward(logits, topk_index, d_topk_weight, d_prob_sum, ctx.score_func,
                                            ctx.norm_topk_prob)
        return d_logits, None, None, None, None, None  # given the chosen experts: grouping changes nothing here


class Router(nn.Module):
    """Top-k router. Logits in fp32, or in the input's dtype where that is wider (from bf16/fp16
    operands with fp32 accumulation on CUDA: see :mod:`lrmoe_ds.router_gemm`).

    Args:
        hidden_size: H.  num_experts: E.  k: experts per token.
        score_func: "softmax" (over all experts) or "sigmoid" (per expert).
        norm_topk_prob: renormalise the k selected weights to sum to 1 (Qwen3's norm_topk_prob).
        expert_bias: add a selection-only bias buffer ``score_bias`` [E] (aux-loss-free balancing):
            it changes which experts are chosen, never the gate weights.
        z_loss_coef: coefficient of the router z-loss mean(logsumexp(logits)^2), applied in the
            backward (the returned aux loss is the load-balancing loss alone).
        num_groups, topk_groups: group-limited selection (DeepSeek-V3's n_group, topk_group): each token
            chooses among the experts of its topk_groups best groups of E / num_groups consecutive experts
            (a group's score: the sum of its two best selection scores). Runs in torch ops (no fused kernel).
    The weight is named ``wg`` as in DeepSpeed's TopKGate, so DeepSpeed's checkpointing treats it as
    a shared (non-expert) parameter.
    """

    def __init__(self, hidden_size: int, num_experts: int, k: int,
                 score_func: Literal["softmax", "sigmoid"] = "softmax", norm_topk_prob: bool = True,
                 expert_bias: bool = False, z_loss_coef: float = 0.0, num_groups: int = 1,
                 topk_groups: Optional[int] = None):
        super().__init__()
        if not 1 <= k <= num_experts:
            raise ValueError(f"k must be in [1, num_experts={num_experts}], got {k}")
        if score_func not in ("softmax", "sigmoid"):
            raise ValueError(f"score_func must be 'softmax' or 'sigmoid', got {score_func!r}")
        reference.check_groups(num_experts, k, num_groups, topk_groups)
        self.num_experts, self.k = num_experts, k
        self.num_groups, self.topk_groups = num_groups, num_groups if topk_groups is None else topk_groups
        self.score_func, self.norm_topk_prob, self.z_loss_coef = score_func, norm_topk_prob, z_loss_coef
        self.wg = nn.Linear(hidden_size, num_experts, bias=False)
        if expert_bias:
            self.register_buffer("score_bias", torch.zeros(num_experts, dtype=torch.float32))
        else:
            self.score_bias = None

    def forward(self, x: torch.Tensor) -> RoutingResult:
        """x [T, H] -> RoutingResult."""
        logits = router_logits(x, self.wg.weight)
        topk_index, topk_weight, counts, prob_sum = apply_fast(
            RouterTopK, logits, self.k, self.score_func, self.norm_topk_prob, self.score_bias,
            (self.num_groups, self.topk_groups))
        # Switch/GShard balance loss over all k choices: E * sum_e mean_prob_e * pair_fraction_e
        pair_fraction = counts.to(logits.dtype) / max(topk_index.numel(), 1)
        mean_prob = prob_sum / max(x.shape[0], 1)  # a rank may hold no token: loss 0, not NaN
        aux_loss = self.num_experts * torch.sum(mean_prob * pair_fraction)
        if self.z_loss_coef > 0 and self.training:
            z_loss = torch.logsumexp(logits, dim=-1).square().mean()
            topk_weight = _AddLossGradient.apply(topk_weight, z_loss, self.z_loss_coef)
        return RoutingResult(topk_index, topk_weight, counts, aux_loss)
