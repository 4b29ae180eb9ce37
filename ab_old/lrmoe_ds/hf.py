"""Hugging Face MoE blocks to LRMoE layers.

``convert_hf_moe(model)`` replaces every sparse MoE block of a Hugging Face model whose router LRMoE
computes and whose experts are SwiGLU (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, DeepSeek-V3) with
an :class:`HFMoEBlock`: an :class:`~lrmoe_ds.LRMoE` layer holding the same weights, called like the
block it replaces. The model then computes what it computed before (up to the
router's fp32 logits), and ``lrmoe_ds.initialize`` or ``configure_model`` find its layers as for any
LRMoE model.

A block is found by its structure (``block.gate`` with a ``weight`` [E, H] and ``top_k``, and
``block.experts``), and converted only if its class is one whose forward was read and found to be
LRMoE's routing (``BLOCKS``), with experts holding stacked ``gate_up_proj`` [E, 2F, H] (gate rows
first) and ``down_proj`` [E, H, F] and a SiLU activation, as transformers >= 5 lays them out. Shared
experts (and Qwen2-MoE's sigmoid gate on its one) are kept beside the layer. Anything else (another
router, router jitter, biases, another activation, transformers 4's list of expert modules) is refused
with the reason, not converted approximately.

``hf_state_dict(model)`` goes back: the converted model's state under the replaced blocks' own names and
layout, which ``save_pretrained(path, state_dict=...)`` writes for transformers to load unconverted.
"""
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn

from lrmoe_ds.experts import SwiGLUExpert
from lrmoe_ds.layer import LRMoE
from lrmoe_ds.ops.reference import check_groups


# Sparse MoE block classes of transformers (>= 5) whose forward was read and found to be LRMoE's routing and
# SwiGLU experts: (router, shared expert).
#   "softmax": softmax over the logits, top-k, renormalised where norm_topk_prob (Mixtral: always).
#   "sigmoid": DeepSeek-V3's and GLM-4.5's: sigmoid scores; top-k of scores + e_score_correction_bias (the bias
#       only selects) within the topk_group best of n_group groups (a group's score: its two best); renormalised
#       where norm_topk_prob; times routed_scaling_factor.
#   shared: None; "gated", Qwen2-MoE's out + sigmoid(shared_expert_gate(x)) * shared_expert(x); or "plain",
#       out + shared_experts(x).
BLOCKS = {"Qwen3MoeSparseMoeBlock": ("softmax", None), "MixtralSparseMoeBlock": ("softmax", None),
          "OlmoeSparseMoeBlock": ("softmax", None), "FlexOlmoSparseMoeBlock": ("softmax", None),
          "Qwen2MoeSparseMoeBlock": ("softmax", "gated"),
          "Glm4MoeMoE": ("sigmoid", "plain"), "DeepseekV3MoE": ("sigmoid", "plain")}


class HFMoEBlock(nn.Module):
    """An LRMoE layer called like a Hugging Face sparse MoE block: hidden_states [B, S, H] -> [B, S, H],
    its output times ``routed_scaling_factor`` (the same as scaling every gate weight), plus the block's own
    shared experts where it has them, under their names there: ``shared_expert`` behind its sigmoid
    ``shared_expert_gate`` (Qwen2-MoE), or ``shared_experts`` (DeepSeek-V3, GLM-4.5).

    The layer's load-balancing loss and pairs per expert of the last forward are kept as ``l_aux`` and
    ``exp_counts`` (Hugging Face's own router-logit auxiliary loss does not see the converted blocks:
    add ``coef * l_aux`` of each block to the loss, see :func:`aux_loss`)."""

    def __init__(self, moe: LRMoE, shared_expert: Optional[nn.Module] = None,
                 shared_expert_gate: Optional[nn.Module] = None, shared_experts: Optional[nn.Module] = None,
                 routed_scaling_factor: float = 1.0, experts_transposed: bool = False):
        super().__init__()
        if (shared_expert is None) != (shared_expert_gate is None):
            raise ValueError("shared_expert and shared_expert_gate come together")
        self.moe = moe
        self.experts_transposed = experts_transposed  # the replaced block's experts were [E, H, 2F], [E, F, H]
        self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate
        self.shared_experts = shared_experts
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.l_aux: Optional[torch.Tensor] = None
        self.exp_counts: Optional[torch.Tensor] = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out, self.l_aux, self.exp_counts = self.moe(hidden_states)
        if self.routed_scaling_factor != 1.0:
            out = out * self.routed_scaling_factor
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


def _refuse(name: str, block: nn.Module, why: str) -> ValueError:
    return ValueError(f"cannot convert {name} ({type(block).__name__}) to LRMoE: {why}")


def _is_silu(act) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ in ("SiLUActivation", "SiLU")


def _expert_weights(name: str, block: nn.Module) -> Tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [E, 2F, H] with the gate rows first, down [E, H, F]) of a block's experts."""
    experts = block.experts
    if isinstance(getattr(experts, "gate_up_proj", None), torch.Tensor):
        if getattr(experts, "has_bias", False) or getattr(experts, "gate_up_proj_bias", None) is not None:
            raise _refuse(name, block, "its experts have biases")
        if not getattr(experts, "is_concatenated", True):
            raise _refuse(name, block, "its gate and up rows are interleaved")
        if getattr(experts, "has_post_expert_norm", False):
            raise _refuse(name, block, "its experts normalise their outputs")
        gate_up, down = experts.gate_up_proj, experts.down_proj
        if _is_transposed(block):
            gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
        if not _is_silu(getattr(experts, "act_fn", None)):
            raise _refuse(name, block, f"its expert activation is {type(getattr(experts, 'act_fn', None)).__name__}, "
                                       "not SiLU (LRMoE's grouped experts are SwiGLU)")
        return gate_up.detach(), down.detach()
    if isinstance(experts, nn.ModuleList):
        raise _refuse(name, block, "its experts are a list of modules (transformers 4's layout, whose blocks also "
                                   "return router logits); transformers >= 5 stacks them, which is what converts")
    raise _refuse(name, block, "its experts have no stacked gate_up_proj/down_proj")


def _is_transposed(block: nn.Module) -> bool:
    return bool(getattr(block.experts, "is_transposed", False))


def _is_moe_block(block: nn.Module) -> bool:
    gate = getattr(block, "gate", None)
    return (gate is not None and hasattr(block, "experts") and isinstance(getattr(gate, "weight", None), torch.Tensor)
            and getattr(gate, "weight").dim() == 2 and (hasattr(gate, "top_k") or hasattr(block, "top_k")))


def _block_spec(name: str, block: nn.Module) -> dict:
    """What an LRMoE layer needs from a block (views of its weights, no copies); raises if it cannot convert."""
    kind = type(block).__name__
    if kind not in BLOCKS:
        raise _refuse(name, block, f"its routing is not one read and found to be LRMoE's; "
                                   f"converted block classes: {', '.join(BLOCKS)}")
    router, shared = BLOCKS[kind]
    shared_names = {None: (), "gated": ("shared_expert", "shared_expert_gate"), "plain": ("shared_experts",)}[shared]
    if not all(isinstance(getattr(block, n, None), nn.Module) for n in shared_names):
        raise _refuse(name, block, f"it has no {' and '.join(shared_names)}")
    if getattr(block, "jitter_noise", 0) or getattr(block.gate, "jitter_noise", 0):
        raise _refuse(name, block, "its router adds jitter noise in training (set router_jitter_noise=0)")
    if getattr(block.gate, "bias", None) is not None:
        raise _refuse(name, block, "its router has a bias")
    wg = block.gate.weight.detach()
    num_experts, hidden = wg.shape
    gate_up, down = _expert_weights(name, block)
    if gate_up.shape[0] != num_experts or gate_up.shape[2] != hidden or down.shape[:2] != (num_experts, hidden):
        raise _refuse(name, block, f"router weight {tuple(wg.shape)}, expert weights {tuple(gate_up.shape)} and "
                                   f"{tuple(down.shape)} do not agree")
    if gate_up.shape[1] != 2 * down.shape[2]:
        raise _refuse(name, block, f"gate_up rows {gate_up.shape[1]} != 2 x expert hidden {down.shape[2]}")
    top_k = getattr(block.gate, "top_k", None) or block.top_k
    norm = bool(getattr(block.gate, "norm_topk_prob", getattr(block, "norm_topk_prob", True)))
    if norm and top_k == 1:
        raise _refuse(name, block, "it renormalises a single choice (every gate weight is 1, and the router gets no "
                                   "gradient through it); LRMoE, like DeepSpeed's top-1 gate, keeps the score")
    bias, scale, groups = None, 1.0, (1, 1)
    if router == "sigmoid":
        groups = int(block.gate.num_group), int(block.gate.topk_group)
        try:
            check_groups(num_experts, top_k, *groups)
        except ValueError as exc:
            raise _refuse(name, block, f"its expert groups (n_group, topk_group) {groups}: {exc}") from None
        bias = block.gate.e_score_correction_bias.detach()
        scale = float(block.gate.routed_scaling_factor)
    return {"wg": wg, "gate_up": gate_up, "down": down, "top_k": top_k, "norm_topk_prob": norm,
            "score_func": router, "score_bias": bias, "routed_scaling_factor": scale, "groups": groups,
            "training": block.training, "shared": {n: getattr(block, n) for n in shared_names},
            "transposed": _is_transposed(block)}


def _build(spec: dict, ep_size: int) -> HFMoEBlock:
    wg, gate_up, down, bias = spec["wg"], spec["gate_up"], spec["down"], spec["score_bias"]
    (num_experts, hidden), ffn = wg.shape, down.shape[2]
    # one expert, copied (DeepSpeed's way), instead of E initialised apart: the weights are overwritten below
    moe = LRMoE(hidden, SwiGLUExpert(hidden, ffn), num_experts=num_experts, ep_size=ep_size, k=spec["top_k"],
                score_func=spec["score_func"], norm_topk_prob=spec["norm_topk_prob"], expert_bias=bias is not None,
                num_groups=spec["groups"][0], topk_groups=spec["groups"][1])
    moe.to(device=gate_up.device, dtype=gate_up.dtype)
    gate = moe.deepspeed_moe.gate.to(wg.dtype)  # a router kept in fp32 (DeepSeek-V3, GLM-4.5) stays fp32
    experts = moe.deepspeed_moe.experts  # local expert i is global expert first_global_expert + i
    with torch.no_grad():
        gate.wg.weight.copy_(wg)
        if bias is not None:
            gate.score_bias = bias.to(device=gate.wg.weight.device, copy=True)  # the block's dtype (fp32)
        first = experts.first_global_expert
        experts.weight1.copy_(gate_up[first:first + experts.num_local_experts])
        experts.weight2.copy_(down[first:first + experts.num_local_experts])
    return HFMoEBlock(moe, **spec["shared"], routed_scaling_factor=spec["routed_scaling_factor"],
                      experts_transposed=spec["transposed"]).train(spec["training"])


def convert_hf_moe(model: nn.Module, ep_size: int = 1) -> List[str]:
    """Replace every sparse MoE block of ``model`` by an :class:`HFMoEBlock` (in place); returns their names.

    With ``ep_size`` > 1 (call after ``deepspeed.init_distributed``) each rank keeps its own experts,
    ``E / ep_size`` of them, as DeepSpeed's MoE lays them out. Raises ValueError naming the first block
    that looks like a MoE block but cannot be converted exactly (before any block is replaced), and when
    there is no MoE block at all. Blocks are built and swapped one at a time, so the peak memory is the
    model's plus one converted block.
    """
    names = [name for name, module in model.named_modules()
             if name and _is_moe_block(module) and not isinstance(module, (HFMoEBlock, LRMoE))]
    if not names:
        raise ValueError(f"no sparse MoE block (a .gate with a [E, H] weight and top_k, and .experts) in "
                         f"{type(model).__name__}")
    for name in names:  # every block checked before any swap
        _block_spec(name, model.get_submodule(name))
    for name in names:
        parent_name, _, child = name.rpartition(".")
        new = _build(_block_spec(name, model.get_submodule(name)), ep_size)
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)  # the old block is freed
    return names


def hf_state_dict(model: nn.Module) -> Dict[str, torch.Tensor]:
    """``model.state_dict()`` under Hugging Face's own names: each converted block's entries as the block it
    replaced held them (``gate.weight``, ``gate.e_score_correction_bias`` where it had one,
    ``experts.gate_up_proj`` [E, 2F, H], ``experts.down_proj`` [E, H, F], its shared experts), so that
    ``model.save_pretrained(path, state_dict=hf_state_dict(model))`` writes a checkpoint that transformers
    loads into the unconverted model. With ep_size > 1 every expert is gathered from its EP rank: a
    collective, to be called on every rank (the entries are the same on all)."""
    state = model.state_dict()
    for name, block in model.named_modules():
        if not isinstance(block, HFMoEBlock):
            continue
        prefix = f"{name}." if name else ""
        for key in [k for k in state if k.startswith(prefix + "moe.")]:
            del state[key]
        gate, experts = block.moe.deepspeed_moe.gate, block.moe.deepspeed_moe.experts
        state[prefix + "gate.weight"] = gate.wg.weight.detach()
        if gate.score_bias is not None:
            state[prefix + "gate.e_score_correction_bias"] = gate.score_bias.detach()
        gate_up, down = (_all_experts(W, block.moe) for W in (experts.weight1, experts.weight2))
        if block.experts_transposed:
            gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
        state[prefix + "experts.gate_up_proj"], state[prefix + "experts.down_proj"] = gate_up, down
    return state


def _all_experts(W: torch.Tensor, moe: LRMoE) -> torch.Tensor:
    """[E, ...]: the local experts' stacked weight W [E_l, ...] of every EP rank, in global expert order."""
    W = W.detach()
    if moe.ep_size == 1:
        return W
    parts = [torch.empty_like(W) for _ in range(moe.ep_size)]
    torch.distributed.all_gather(parts, W.contiguous(), group=moe.deepspeed_moe.dispatcher.ep_group)
    return torch.cat(parts)


def aux_loss(model: nn.Module) -> torch.Tensor:
    """The sum of the converted blocks' load-balancing losses of the last forward (0 if none ran)."""
    losses = [m.l_aux for m in model.modules() if isinstance(m, HFMoEBlock) and m.l_aux is not None]
    return torch.stack(losses).sum() if losses else torch.zeros(())
