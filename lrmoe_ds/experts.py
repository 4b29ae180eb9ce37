"""Experts: per-expert modules (each its own parameters, named as DeepSpeed's checkpoints expect) run
as grouped work over variable-size groups of rows, with the backward restricted to retained rows.
"""
import copy
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe_ds import ops
from lrmoe_ds.retention import RetentionSpec, select_retained


class SwiGLUExpert(nn.Module):
    """Qwen3/GLM/Mixtral expert: down(silu(gate(x)) * up(x)); gate and up fused as ``gate_up_proj``
    ([2F, H], gate rows first), ``down_proj`` [H, F]. No biases."""
    activation = "swiglu"

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    @staticmethod
    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up

    def projections(self):
        return self.gate_up_proj.weight, self.down_proj.weight

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GELUExpert(nn.Module):
    """Plain MLP expert: fc2(gelu(fc1(x))), fc1 [F, H], fc2 [H, F]. No biases."""
    activation = "gelu"

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    @staticmethod
    def act(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h)

    def projections(self):
        return self.fc1.weight, self.fc2.weight

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


EXPERT_TYPES = {"swiglu": SwiGLUExpert, "gelu": GELUExpert}


class _GroupedMLP(torch.autograd.Function):
    """y = W2_g act(W1_g x) over groups of rows; the backward runs on the retained rows alone.

    Saved for backward ("stash" policy): the inputs x and pre-activations h of every row.
    """

    @staticmethod
    def forward(ctx, x, group_sizes, act, retention: Optional[RetentionSpec], n_w1: int, *weights):
        w1, w2 = weights[:n_w1], weights[n_w1:]
        h = ops.grouped_linear(x, w1, group_sizes)
        y = ops.grouped_linear(act(h), w2, group_sizes)
        ctx.save_for_backward(x, h, group_sizes, *weights)
        ctx.act, ctx.retention, ctx.n_w1 = act, retention, n_w1
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, group_sizes, *weights = ctx.saved_tensors
        w1, w2 = weights[:ctx.n_w1], weights[ctx.n_w1:]
        dy = dy.contiguous()
        num_rows, kept = x.shape[0], None
        if ctx.retention is not None:
            kept, scale, group_sizes = select_retained(dy, x, group_sizes, ctx.retention)
            dy = ops.permute(dy, kept) * scale.to(dy.dtype).unsqueeze(1)
            x, h = ops.permute(x, kept), ops.permute(h, kept)
        with torch.enable_grad():
            h_ = h.detach().requires_grad_(True)
            a_ = ctx.act(h_)
        a = a_.detach()
        da = ops.grouped_linear_dgrad(dy, w2, group_sizes)
        dw2 = ops.grouped_linear_wgrad(dy, a, group_sizes)
        (dh,) = torch.autograd.grad(a_, h_, da)
        dw1 = ops.grouped_linear_wgrad(dh, x, group_sizes)
        dx = ops.grouped_linear_dgrad(dh, w1, group_sizes)
        if kept is not None:
            # dropped rows get no gradient through the expert
            dx = dx.new_zeros(num_rows, dx.shape[1]).index_copy_(0, kept, dx)
        return (dx, None, None, None, None, *dw1, *dw2)


@torch.no_grad()
def _init_linears(module: nn.Module, generator: torch.Generator) -> None:
    """nn.Linear's default initialisation (uniform in +-1/sqrt(fan_in)), drawn from ``generator``."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            bound = m.in_features ** -0.5
            m.weight.uniform_(-bound, bound, generator=generator)
            if m.bias is not None:
                m.bias.uniform_(-bound, bound, generator=generator)


class GroupedExperts(nn.Module):
    """The local experts of one layer, as ``deepspeed_experts`` (DeepSpeed's checkpoint naming).

    Args:
        expert: the expert to replicate. A :class:`SwiGLUExpert` or :class:`GELUExpert` runs as
            grouped GEMMs (and supports retention); any other module runs in a per-expert loop
            (exact and dropless, without retention).
        num_local_experts: experts held by this rank.  expert_group_name: DeepSpeed's EP group name.
        init_seed: None keeps identical copies of ``expert`` (DeepSpeed's behaviour); an int
            initialises each expert's linear layers apart, from a generator seeded by
            ``init_seed + its global index``, so a model is the same whatever its ep_size.
        first_global_expert: global index of local expert 0.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int, expert_group_name: str,
                 init_seed: Optional[int] = None, first_global_expert: int = 0):
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        self.grouped = type(expert) in EXPERT_TYPES.values()
        for i, e in enumerate(self.deepspeed_experts):
            if init_seed is not None:
                _init_linears(e, torch.Generator().manual_seed(init_seed + first_global_expert + i))
            for p in e.parameters():
                # DeepSpeed's marks: excluded from the data-parallel all-reduce, reduced over the
                # expert-data-parallel group of this name instead
                p.allreduce = False
                p.group_name = expert_group_name

    def forward(self, x: torch.Tensor, group_sizes: torch.Tensor, group_sizes_host: Sequence[int],
                retention: Optional[RetentionSpec] = None) -> torch.Tensor:
        """x [M, H] rows grouped by local expert; group_sizes [G] on x's device and as host ints."""
        if self.grouped:
            w1 = [e.projections()[0] for e in self.deepspeed_experts]
            w2 = [e.projections()[1] for e in self.deepspeed_experts]
            act = self.deepspeed_experts[0].act
            return _GroupedMLP.apply(x, group_sizes, act, retention, len(w1), *w1, *w2)
        if retention is not None:
            raise NotImplementedError(
                "retention needs grouped experts (SwiGLUExpert or GELUExpert); this layer's expert is "
                f"{type(self.deepspeed_experts[0]).__name__}. Set \"lrmoe\": {{\"enabled\": false}} or "
                "use a built-in expert.")
        outs: List[torch.Tensor] = []
        for expert, chunk in zip(self.deepspeed_experts, x.split(list(group_sizes_host))):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
