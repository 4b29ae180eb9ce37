"""Experts: per-expert modules (each its own parameters, named as DeepSpeed's checkpoints expect), and
the grouped MLP's forward and backward over variable-size groups of rows (the backward over the
retained rows alone).
"""
import copy
from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from lrmoe_ds import ops
from lrmoe_ds.ops import reference

# Parameters or submodules registered anywhere in the process so far. GroupedExperts caches its
# projection lists (collecting 2 x 128 weights through nn.Module attribute lookups costs about a
# millisecond of host time per forward) and rebuilds them when this count has moved: a weight or an
# expert replaced by assignment always passes through these registration hooks.
_registrations = 0


def _count_registration(*args):
    global _registrations
    _registrations += 1


register_module_parameter_registration_hook(_count_registration)
register_module_module_registration_hook(_count_registration)


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
        """The grouped path's activation (a fused kernel on CUDA; not differentiable)."""
        return ops.swiglu(h)

    @staticmethod
    def act_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
        return ops.swiglu_backward(h, da)

    def projections(self):
        return self.gate_up_proj.weight, self.down_proj.weight

    def forward(self, x):
        return self.down_proj(reference.swiglu(self.gate_up_proj(x)))  # differentiable torch


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

    @staticmethod
    def act_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.gelu_backward(da, h)

    def projections(self):
        return self.fc1.weight, self.fc2.weight

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


EXPERT_TYPES = {"swiglu": SwiGLUExpert, "gelu": GELUExpert}


def mlp_forward(x: torch.Tensor, w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], expert_type,
                group_sizes: torch.Tensor):
    """y_g = W2_g act(W1_g x_g) over groups of rows, ``expert_type.act`` the activation. Returns (h, y):
    pre-activations and outputs."""
    h = ops.grouped_linear(x, w1, group_sizes)
    return h, ops.grouped_linear(expert_type.act(h), w2, group_sizes)


@dataclass
class BackwardRows:
    """The row buffers one expert backward reads, handed over to :func:`mlp_backward`, which drops
    each as soon as it has used it (so the caller must keep no reference of its own).

    dy [M, H]: output gradients.  x [M, H]: inputs.  h [M, F1] or None: pre-activations (None: recompute from x).
    """
    dy: Optional[torch.Tensor]
    x: Optional[torch.Tensor]
    h: Optional[torch.Tensor] = None


def mlp_backward(rows: BackwardRows, w1: Sequence[torch.Tensor], w2: Sequence[torch.Tensor], expert_type,
                 group_sizes: torch.Tensor, want_output_dot: bool = False):
    """The backward of :func:`mlp_forward` over the rows given (the retained ones).

    Returns (dx, dw1, dw2, y_dot_dy): y_dot_dy [M] = <y_m, dy_m> of the recomputed outputs y if
    ``want_output_dot`` (the retained-pairs router gradient), else None. The order of the steps and
    the freeing of ``rows`` keep at most about three [M, *] buffers alive at once.
    """
    x, h, dy = rows.x, rows.h, rows.dy
    rows.x = rows.h = rows.dy = None
    if h is None:
        h = ops.grouped_linear(x, w1, group_sizes)
    a = expert_type.act(h)
    da = ops.grouped_linear_dgrad(dy, w2, group_sizes)
    dw2 = ops.grouped_linear_wgrad(dy, a, group_sizes)
    y_dot_dy = None
    if want_output_dot:
        y = ops.grouped_linear(a, w2, group_sizes)
        y_dot_dy = ops.unpermute_weight_grad(y, torch.arange(y.shape[0], device=y.device).view(-1, 1), dy).view(-1)
        del y
    del a, dy
    dh = expert_type.act_backward(h, da)
    del h, da
    dw1 = ops.grouped_linear_wgrad(dh, x, group_sizes)
    del x
    dx = ops.grouped_linear_dgrad(dh, w1, group_sizes)
    return dx, dw1, dw2, y_dot_dy


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
        self.num_local_experts, self.first_global_expert = num_local_experts, first_global_expert
        self.grouped = type(expert) in EXPERT_TYPES.values()
        self._projections = None
        for i, e in enumerate(self.deepspeed_experts):
            if init_seed is not None:
                _init_linears(e, torch.Generator().manual_seed(init_seed + first_global_expert + i))
            for p in e.parameters():
                # DeepSpeed's marks: excluded from the data-parallel all-reduce, reduced over the
                # expert-data-parallel group of this name instead
                p.allreduce = False
                p.group_name = expert_group_name

    def _apply(self, fn, recurse=True):
        # a dtype or device conversion may put new Parameter objects straight into _parameters (torch.__future__'s
        # overwrite mode), past the registration hooks
        self._projections = None
        return super()._apply(fn, recurse)

    def projections(self):
        """(w1 tuple, w2 tuple, expert type: its ``act`` and ``act_backward``) of the built-in experts, for
        the grouped path; cached until a parameter or module is registered anywhere, or the module converted."""
        if self._projections is None or self._projections[0] != _registrations:
            experts = self.deepspeed_experts
            pairs = [e.projections() for e in experts]
            self._projections = (_registrations, tuple(p[0] for p in pairs), tuple(p[1] for p in pairs),
                                 type(experts[0]))
        return self._projections[1:]

    def forward(self, x: torch.Tensor, group_sizes_host: Sequence[int]) -> torch.Tensor:
        """Any expert module, in a per-expert loop: x [M, H] rows grouped by local expert (exact)."""
        outs: List[torch.Tensor] = []
        for expert, chunk in zip(self.deepspeed_experts, x.split(list(group_sizes_host))):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs) if outs else x.new_zeros(0, x.shape[1])
