"""Experts: the local experts of a layer (the built-in ones as one stacked parameter per projection,
saved and loaded under DeepSpeed's per-expert checkpoint names), and the grouped MLP's forward and
backward over variable-size groups of rows (the backward over the retained rows alone).
"""
import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from lrmoe_ds import ops
from lrmoe_ds.ops import reference


class SwiGLUExpert(nn.Module):
    """Qwen3/GLM/Mixtral expert: down(silu(gate(x)) * up(x)); gate and up fused as ``gate_up_proj``
    ([2F, H], gate rows first), ``down_proj`` [H, F]. No biases."""
    activation = "swiglu"
    projection_names = ("gate_up_proj", "down_proj")

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    @staticmethod
    def act(h: torch.Tensor) -> torch.Tensor:
        """The grouped path's activation (a fused kernel on CUDA; not differentiable)."""
        return ops.swiglu(h)

    @staticmethod
    def act_backward(h: torch.Tensor, da: torch.Tensor, index: Optional[torch.Tensor] = None, with_dot: bool = False):
        """(dh, a, dot): the activation's input gradient and its output recomputed, from one read of h (one
        fused kernel on CUDA); dot [M] = <a_m, da_m> from the same pass if ``with_dot``, else None. Without
        ``index`` dh is written over h, which must not be read again; with it, the rows ``h[index]`` are read
        (a stash's retained rows, gathered in the same pass) and h is left as it is."""
        out = ops.swiglu_backward(h, da, inplace=index is None, with_activation=True, index=index, with_dot=with_dot)
        return out if with_dot else (*out, None)

    @staticmethod
    def act_dot(h: torch.Tensor, dz: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """[M] <act(h[index[m]]), dz_m>: act_backward's dot alone (one fused kernel on CUDA, writing nothing else)."""
        return ops.swiglu_dot(h, dz, index)

    def projections(self):
        return self.gate_up_proj.weight, self.down_proj.weight

    def forward(self, x):
        return self.down_proj(reference.swiglu(self.gate_up_proj(x)))  # differentiable torch


class GELUExpert(nn.Module):
    """Plain MLP expert: fc2(gelu(fc1(x))), fc1 [F, H], fc2 [H, F]. No biases."""
    activation = "gelu"
    projection_names = ("fc1", "fc2")

    def __init__(self, hidden_size: int, ffn_hidden_size: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, ffn_hidden_size, bias=False)
        self.fc2 = nn.Linear(ffn_hidden_size, hidden_size, bias=False)

    @staticmethod
    def act(h: torch.Tensor) -> torch.Tensor:
        return F.gelu(h)

    @staticmethod
    def act_backward(h: torch.Tensor, da: torch.Tensor, index: Optional[torch.Tensor] = None, with_dot: bool = False):
        """(dh, a, dot), as :meth:`SwiGLUExpert.act_backward` (here torch ops, h left as it is)."""
        if index is not None:
            h = h.index_select(0, index)
        a = F.gelu(h)
        dot = reference.row_dots(a, da) if with_dot else None
        return torch.ops.aten.gelu_backward(da, h), a, dot

    @staticmethod
    def act_dot(h: torch.Tensor, dz: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return reference.row_dots(F.gelu(h.index_select(0, index)), dz)

    def projections(self):
        return self.fc1.weight, self.fc2.weight

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


EXPERT_TYPES = {"swiglu": SwiGLUExpert, "gelu": GELUExpert}


def mlp_forward(x: torch.Tensor, w1, w2, expert_type, group_sizes: torch.Tensor):
    """y_g = W2_g act(W1_g x_g) over groups of rows, ``expert_type.act`` the activation; w1, w2 each projection's
    weights, stacked [G, N, K] or G tensors [N, K]. Returns (h, y): pre-activations and outputs."""
    h = ops.grouped_linear(x, w1, group_sizes)
    return h, ops.grouped_linear(expert_type.act(h), w2, group_sizes)


@dataclass
class BackwardRows:
    """The row buffers one expert backward reads, handed over to :func:`mlp_backward`, which drops
    each as soon as it has used it (so the caller must keep no reference of its own) and may write
    over h.

    dy [M, H]: output gradients.  x [M, H]: inputs.  h [M, F1] or None: pre-activations (None: recompute from x).
    h_index [M] int64 or None: with it, h holds more rows [Mh, F1] and row m's pre-activation is h[h_index[m]]
    (the retained rows of a stash, read where they are instead of copied first).
    """
    dy: Optional[torch.Tensor]
    x: Optional[torch.Tensor]
    h: Optional[torch.Tensor] = None
    h_index: Optional[torch.Tensor] = None


def mlp_backward(rows: BackwardRows, w1, w2, expert_type,
                 group_sizes: torch.Tensor, want_output_dot: bool = False):
    """The backward of :func:`mlp_forward` over the rows given (the retained ones).

    Returns (dx, dw1, dw2, y_dot_dy): dw1, dw2 the weight gradients stacked [G, N, K] (what the stacked
    parameters of :class:`GroupedExperts` take); y_dot_dy [M] float32 = <y_m, dy_m> of the rows' outputs y if
    ``want_output_dot`` (the retained-pairs router gradient), else None. The order of the steps and
    the freeing of ``rows`` keep at most about three [M, *] buffers alive at once.
    """
    x, h, dy, h_index = rows.x, rows.h, rows.dy, rows.h_index
    rows.x = rows.h = rows.dy = rows.h_index = None
    if h is None:
        h = ops.grouped_linear(x, w1, group_sizes)
    da = ops.grouped_linear_dgrad(dy, w2, group_sizes)
    # <y_m, dy_m> = <a_m W2^T, dy_m> = <a_m, dy_m W2> = <a_m, da_m>: no GEMM to remake y, and no pass of its own
    dh, a, y_dot_dy = expert_type.act_backward(h, da, h_index, want_output_dot)  # without h_index, h may now hold dh
    del h, da
    dw2 = _stacked_wgrad(dy, a, group_sizes)
    del a, dy
    dw1 = _stacked_wgrad(dh, x, group_sizes)
    del x
    dx = ops.grouped_linear_dgrad(dh, w1, group_sizes)
    return dx, dw1, dw2, y_dot_dy


def _stacked_wgrad(dy: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """dW [G, N, K] with dW_g = dy_g^T x_g, written by the grouped GEMM into one buffer (empty groups: zeros)."""
    grad = dy.new_empty(group_sizes.numel(), dy.shape[1], x.shape[1])
    ops.grouped_linear_wgrad(dy, x, group_sizes, out=grad)
    return grad


class GroupedExperts(nn.Module):
    """The local experts of one layer.

    Built-in experts (:class:`SwiGLUExpert`, :class:`GELUExpert`) run as grouped GEMMs and are held as
    one parameter per projection, ``weight1`` [G, N1, H] and ``weight2`` [G, H, F] (G local experts, each
    slice in nn.Linear's [out, in] layout), as Megatron-Core's GroupedMLP does: autograd and DeepSpeed's
    optimizers then handle two parameters per layer instead of 2 G (each costs about 10 us of host time
    per backward in autograd alone, benchmarks/results/host_time_h200.md). ``state_dict`` still names each
    expert's weights as DeepSpeed's MoE does (``deepspeed_experts.<i>.<projection>.weight``), so
    DeepSpeed writes one checkpoint file per expert and loads them back; ``load_state_dict`` stacks them.
    Any other expert module stays a ``deepspeed_experts`` ModuleList and runs in a per-expert loop
    (exact and dropless, without retention).

    Args:
        expert: the expert to replicate.  num_local_experts: G, experts held by this rank.
        expert_group_name: DeepSpeed's EP group name.
        init_seed: None keeps identical copies of ``expert`` (DeepSpeed's behaviour); an int
            initialises each expert apart (nn.Linear's default, per projection in order), from a
            generator seeded by ``init_seed + its global index``, so a model is the same whatever its ep_size.
        first_global_expert: global index of local expert 0.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int, expert_group_name: str,
                 init_seed: Optional[int] = None, first_global_expert: int = 0):
        super().__init__()
        self.num_local_experts, self.first_global_expert = num_local_experts, first_global_expert
        self.grouped = type(expert) in EXPERT_TYPES.values()
        if self.grouped:
            self.expert_type = type(expert)
            ws = [w.detach() for w in expert.projections()]
            stacked = [w.unsqueeze(0).repeat(num_local_experts, 1, 1) for w in ws]  # DeepSpeed's copies
            if init_seed is not None:
                for i in range(num_local_experts):
                    gen = torch.Generator().manual_seed(init_seed + first_global_expert + i)
                    for W, w in zip(stacked, ws):  # nn.Linear's default, projection by projection
                        bound = w.shape[1] ** -0.5
                        W[i].copy_(torch.empty(w.shape).uniform_(-bound, bound, generator=gen))
            self.weight1, self.weight2 = nn.Parameter(stacked[0]), nn.Parameter(stacked[1])
            params = (self.weight1, self.weight2)
            self.register_state_dict_post_hook(_per_expert_state_dict)
            self.register_load_state_dict_pre_hook(_stack_per_expert_state_dict)
        else:
            self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
            params = [p for e in self.deepspeed_experts for p in e.parameters()]
        for p in params:
            # DeepSpeed's marks: excluded from the data-parallel all-reduce, reduced over the
            # expert-data-parallel group of this name instead
            p.allreduce = False
            p.group_name = expert_group_name

    def checkpoint_names(self):
        """(weight1's, weight2's) per-expert name under ``deepspeed_experts.<i>.``, e.g. gate_up_proj.weight."""
        return tuple(f"{name}.weight" for name in self.expert_type.projection_names)

    def per_expert(self, stacked1: torch.Tensor, stacked2: torch.Tensor, prefix: str = ""):
        """{DeepSpeed's per-expert name: slice} of two tensors laid out as weight1 and weight2 (the weights
        themselves, or their gradients): ``{prefix}deepspeed_experts.<i>.<projection>.weight``."""
        return {f"{prefix}deepspeed_experts.{i}.{name}": W[i]
                for W, name in zip((stacked1, stacked2), self.checkpoint_names()) for i in range(W.shape[0])}

    def projections(self):
        """(w1, w2, expert type) of the built-in experts, for the grouped GEMMs: w1 [G, N1, H] and w2 [G, H, F],
        the stacked parameters detached (no autograd; taken fresh each call, so DeepSpeed's optimizers may
        re-point ``param.data`` into their flat buffers). The grouped GEMMs step through a stacked tensor
        themselves: no tensor per expert is made."""
        return self.weight1.detach(), self.weight2.detach(), self.expert_type

    def forward(self, x: torch.Tensor, group_sizes_host: Sequence[int]) -> torch.Tensor:
        """Any expert module, in a per-expert loop: x [M, H] rows grouped by local expert (exact)."""
        outs: List[torch.Tensor] = []
        for expert, chunk in zip(self.deepspeed_experts, x.split(list(group_sizes_host))):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])


def _per_expert_state_dict(module: GroupedExperts, state_dict, prefix, local_metadata):
    """state_dict post-hook: each stacked weight as one entry per expert, under DeepSpeed's MoE names."""
    state_dict.update(module.per_expert(state_dict.pop(prefix + "weight1"), state_dict.pop(prefix + "weight2"), prefix))


def _stack_per_expert_state_dict(module: GroupedExperts, state_dict, prefix, local_metadata, strict, missing_keys,
                                 unexpected_keys, error_msgs):
    """load_state_dict pre-hook: the per-expert entries of :func:`_per_expert_state_dict` stacked back. Where
    some expert's entry is missing, none is stacked, and the load reports the keys as usual."""
    for attr, name in zip(("weight1", "weight2"), module.checkpoint_names()):
        keys = [f"{prefix}deepspeed_experts.{i}.{name}" for i in range(module.num_local_experts)]
        if prefix + attr not in state_dict and all(k in state_dict for k in keys):
            state_dict[prefix + attr] = torch.stack([state_dict.pop(k) for k in keys])
