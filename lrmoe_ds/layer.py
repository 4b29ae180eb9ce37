"""LRMoE: a drop-in replacement for ``deepspeed.moe.layer.MoE``.

forward: route -> plan -> dispatch -> experts -> combine; the backward runs back through the same
stages, the experts' backward on the retained pairs alone when the "lrmoe" block enables retention.
"""
import hashlib
from typing import Literal, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.moe.layer import MoE
from deepspeed.utils import log_dist
from torch import nn

from lrmoe_ds import ops
from lrmoe_ds.autograd import apply_fast
from lrmoe_ds.config import LRMoEConfig
from lrmoe_ds.dispatcher import AllToAllDispatcher, DispatchPlan, HostCopy
from lrmoe_ds.experts import EXPERT_TYPES, GroupedExperts
from lrmoe_ds.placement import plan_with_replicas
from lrmoe_ds.pipeline import ExpertWeights, RoutedMLP, WeightGrads, router_dots_from_rows, stash_keeps_rows
from lrmoe_ds.quotas import (MemoryPlan, RetentionStats, expert_row_bytes, mass_weights, plan_quotas, quota_granule,
                             rank_shares, quota_weights, share_weights, target_pairs)
from lrmoe_ds.retention import BackwardSpec
from lrmoe_ds.router import Router


class RoutedExperts(nn.Module):
    """The layer's router (``gate``), local experts (``experts``) and dispatcher, under the attribute
    name ``deepspeed_moe`` that DeepSpeed's engine and checkpoints look for."""

    def __init__(self, gate: Router, experts: GroupedExperts, dispatcher: AllToAllDispatcher):
        super().__init__()
        self.gate, self.experts, self.dispatcher = gate, experts, dispatcher

    def _set_ep_group(self, ep_group):
        self.dispatcher.ep_group = ep_group


class LRMoE(MoE):
    """A dropless MoE layer with LRMoE's retention in the backward.

    Takes ``deepspeed.moe.layer.MoE``'s arguments where they make sense and returns the same
    ``(output, l_aux, exp_counts)``. Arguments that only matter when tokens are dropped
    (capacity_factor, eval_capacity_factor, min_capacity, use_rts) are accepted and ignored: every
    routed pair is computed.

    Args:
        hidden_size: H.
        expert: the expert module; None builds ``activation`` experts of ``ffn_hidden_size``.
            A :class:`~lrmoe_ds.SwiGLUExpert` or :class:`~lrmoe_ds.GELUExpert` runs as grouped GEMMs;
            another module runs in a per-expert loop (exact, but without retention). As in DeepSpeed,
            a given expert is copied to every local expert. Built-in experts are initialised apart,
            each from a seed drawn from torch's RNG plus its global index (the EP rank is taken as
            rank % ep_size, DeepSpeed's default layout), so the model does not depend on ep_size.
        num_experts: E.  ep_size: expert-parallel ranks (E % ep_size == 0).  k: experts per token.
        use_residual: Residual MoE (DeepSpeed's): a dense copy of the expert mixed in by a learned coefficient.
        ffn_hidden_size, activation ("swiglu" | "gelu"): the built-in experts' shape.
        score_func ("softmax" | "sigmoid"), norm_topk_prob, expert_bias, z_loss_coef, num_groups, topk_groups
            (group-limited selection, DeepSeek-V3's n_group and topk_group): see :class:`Router`.
    forward(hidden_states [..., H]) -> (output [..., H], l_aux scalar, exp_counts [E] pairs per expert
    from this rank's tokens).
    """

    def __init__(self, hidden_size: int, expert: Optional[nn.Module] = None, num_experts: int = 1,
                 ep_size: int = 1, k: int = 1, capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0,
                 min_capacity: int = 4, use_residual: bool = False, noisy_gate_policy: Optional[str] = None,
                 drop_tokens: bool = False, use_rts: bool = True, use_tutel: bool = False,
                 enable_expert_tensor_parallelism: bool = False, top2_2nd_expert_sampling: bool = False, *,
                 ffn_hidden_size: Optional[int] = None, activation: Literal["swiglu", "gelu"] = "swiglu",
                 score_func: Literal["softmax", "sigmoid"] = "softmax", norm_topk_prob: bool = True,
                 expert_bias: bool = False, z_loss_coef: float = 0.0, num_groups: int = 1,
                 topk_groups: Optional[int] = None) -> None:
        nn.Module.__init__(self)  # not MoE.__init__: it would build DeepSpeed's own gate and experts
        unsupported = {"drop_tokens": drop_tokens, "noisy_gate_policy": noisy_gate_policy not in (None, "None"),
                       "use_tutel": use_tutel, "enable_expert_tensor_parallelism": enable_expert_tensor_parallelism,
                       "top2_2nd_expert_sampling": top2_2nd_expert_sampling}
        bad = [name for name, on in unsupported.items() if on]
        if bad:
            raise ValueError(f"LRMoE does not support {', '.join(bad)} (it is dropless and routes "
                             "deterministically); leave them at their defaults")
        if num_experts % ep_size:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep_size ({ep_size})")
        if expert is None:
            if ffn_hidden_size is None:
                raise ValueError("give either `expert` or `ffn_hidden_size` (with `activation`)")
            if activation not in EXPERT_TYPES:
                raise ValueError(f"activation must be one of {sorted(EXPERT_TYPES)}, got {activation!r}")
            expert = EXPERT_TYPES[activation](hidden_size, ffn_hidden_size)
            # drawn from the global RNG, so the same on every rank that seeded it alike
            init_seed = int(torch.randint(0, 2 ** 62, ()))
        else:
            init_seed = None
        self.hidden_size = hidden_size
        self.num_experts, self.ep_size, self.k = num_experts, ep_size, k
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        self.enable_expert_tensor_parallelism = False
        self.use_residual = use_residual
        log_dist(f"Creating LRMoE layer: num_experts {num_experts}, num_local_experts "
                 f"{self.num_local_experts}, ep_size {ep_size}, k {k}", [0])
        router = Router(hidden_size, num_experts, k, score_func, norm_topk_prob, expert_bias, z_loss_coef, num_groups,
                        topk_groups)
        # DeepSpeed's default layout puts consecutive ranks in one EP group: EP rank = rank % ep_size
        ep_rank = dist.get_rank() % ep_size if dist.is_initialized() else 0
        experts = GroupedExperts(expert, self.num_local_experts, self.expert_group_name, init_seed,
                                 first_global_expert=ep_rank * self.num_local_experts)
        self.deepspeed_moe = RoutedExperts(router, experts, AllToAllDispatcher(num_experts, ep_size))
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)
        self.lrmoe_config = LRMoEConfig()
        self.layer_number = 0
        self.memory_plan = MemoryPlan()          # the memory planner overwrites it
        self.last_stats: Optional[RetentionStats] = None
        self.last_selection: Optional[dict] = None  # filled by the backward when keep_last_selection
        self.keep_last_selection = False
        # training forwards with grad so far: seeds the retention sampling; a buffer, so checkpoints restore it.
        # A host copy avoids reading the device buffer (a synchronisation) every forward.
        self.register_buffer("retention_step", torch.zeros((), dtype=torch.long))
        self._retention_step_host: Optional[int] = None
        # the optimizer step, set by the memory planner under lrmoe_ds.initialize (the retention schedule's
        # clock); None: the schedule follows the training forwards instead
        self.optimizer_step: Optional[int] = None

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        self._retention_step_host = None  # re-read from the loaded buffer

    def configure(self, config: LRMoEConfig, layer_number: int = 0) -> None:
        """Apply the "lrmoe" block (``lrmoe_ds.initialize`` calls this for every layer)."""
        if config.enabled and not self.deepspeed_moe.experts.grouped:
            expert = type(self.deepspeed_moe.experts.deepspeed_experts[0]).__name__
            raise ValueError(f'"lrmoe": {{"enabled": true}} needs grouped experts (SwiGLUExpert or GELUExpert), '
                             f"but LRMoE layer {layer_number} has {expert} experts")
        ops.set_default_backend(config.ops_backend)
        self.lrmoe_config, self.layer_number = config, layer_number
        # "auto" starts from stash; the memory planner switches a layer to recompute if it must
        self.memory_plan = MemoryPlan("stash" if config.policy == "auto" else config.policy)

    def _retains(self) -> bool:
        """Whether this forward's expert backward samples pairs (and so plans quotas from the counts)."""
        return self.lrmoe_config.enabled and self.training and torch.is_grad_enabled()

    def _backward_spec(self, plan: DispatchPlan, dtype: torch.dtype):
        """(the backward's settings, a function that fills in its quotas' shares and replicas, or None where no pair
        can be dropped): the plan comes from the global counts (the same on every rank), so on one rank it makes
        the layer's one host read; the caller runs it once the forward's kernels are queued (see forward)."""
        cfg = self.lrmoe_config
        if not self._retains():
            return BackwardSpec(), None
        policy, max_rows = self.memory_plan.policy, self.memory_plan.max_rows_per_rank
        if self._retention_step_host is None:
            self._retention_step_host = int(self.retention_step)
        ratio = cfg.retention_at(self._retention_step_host if self.optimizer_step is None else self.optimizer_step)

        R = self.ep_size
        # replicas can take a retained row only where it carries its input (recompute): a stash stays at home
        replicas = cfg.replica_slots > 0 and R > 1 and policy == "recompute"
        # ratio 1 without a row cap keeps every pair whatever the counts (the floor only raises quotas, the balance
        # factor cuts only where something was dropped): no quotas to plan, no host read of the counts, and x's
        # norms are not needed. (Replicas route even then: their selection keeps every pair, weight 1.)
        may_drop = ratio < 1.0 or max_rows is not None or replicas
        rank = dist.get_rank() if dist.is_initialized() else 0  # every rank samples its own pairs
        key = f"{cfg.seed}/{self.layer_number}/{self._retention_step_host}/{rank}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        self.last_selection = {} if self.keep_last_selection else None
        dots = self.memory_plan.dropped_router_dots if cfg.dropped_router_dots == "auto" else cfg.dropped_router_dots
        spec = BackwardSpec(policy, cfg.router_grad, None, may_drop, cfg.metric, cfg.selection, cfg.rescale, seed,
                            self.last_selection, dropped_router_dots=dots)
        row_bytes = self._cached_row_bytes(spec, dtype)

        def plan_backward(spec: BackwardSpec) -> None:
            n = plan.all_counts.sum(0)
            placed = totals = None
            granule = quota_granule(plan.order.device)
            # the rounding's sampling (proportional quotas, shares): one generator state on every rank, so that all
            # make the same quotas and shares
            rounding_gen = None
            if (R > 1 and cfg.quota_allocation != "threshold") or cfg.quota_allocation == "proportional":
                key = f"{cfg.seed}/{self.layer_number}/{self._retention_step_host}/shares".encode()
                rounding_gen = torch.Generator().manual_seed(
                    int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1)
            if cfg.quota_allocation == "threshold":
                # per-expert caps from the budget alone; each rank keeps `ratio` of its own pairs over all experts
                quotas = plan_quotas(n, 1.0, R, 0.0, cfg.balance_factor, max_rows, granule=granule)
                totals = [target_pairs(ratio, c) for c in plan.all_counts.sum(1).tolist()]
            elif replicas:
                quotas, shares, placed = plan_with_replicas(n, plan.all_counts, cfg.replica_slots, ratio, cfg.floor,
                                                            cfg.balance_factor, max_rows, cfg.quota_allocation,
                                                            cfg.replica_min_rows, rounding_gen)
            else:
                allocation, weights = cfg.quota_allocation, None
                if allocation == "metric_mass":  # from the last backward's masses; the water-fill until there is one
                    weights = self._mass_weights()
                    allocation = "waterfill" if weights is None else allocation
                quotas = plan_quotas(n, ratio, R, cfg.floor, cfg.balance_factor, max_rows, allocation,
                                     granule, rounding_gen, weights)
                if cfg.quota_allocation == "metric_mass":
                    spec.on_mass = lambda mass, n=n: setattr(self, "_metric_mass", (HostCopy(mass), n))
            retained = quotas.view(R, -1).sum(1) if placed is None else placed.retained_per_rank()
            self.last_stats = RetentionStats(n, quotas, n.view(R, -1).sum(1), retained, policy,
                                             replica_rows=0 if placed is None else placed.replica_rows(), **row_bytes)
            if placed is not None:
                spec.shares, spec.replicas = shares, placed
            elif totals is not None and (ratio < 1.0 or not torch.equal(quotas, n)):
                spec.shares, spec.totals = rank_shares(quotas, plan.all_counts), totals
                spec.on_kept = self.last_stats.set_kept
            elif totals is None and not torch.equal(quotas, n):
                spec.shares = rank_shares(quotas, plan.all_counts, rounding_gen)
            if spec.shares is not None and totals is None:  # what the sampled rounding of quotas and shares left
                by_share = share_weights(quotas, plan.all_counts, spec.shares)
                by_quota = quota_weights(n, quotas, ratio, cfg.floor) if cfg.quota_allocation == "proportional" else None
                if by_quota is not None:
                    by_share = by_quota.expand(R, -1) if by_share is None else by_share * by_quota
                spec.share_weights = by_share

        if may_drop:
            return spec, plan_backward
        # every pair kept: nothing to plan; on one rank the counts stay unread until the statistics are asked for
        rows = torch.tensor([plan.order.numel()]) if R == 1 else plan.all_counts.sum(0).view(R, -1).sum(1)
        self.last_stats = RetentionStats(plan.host_counts, None, rows, rows.clone(), policy, **row_bytes)
        return spec, None

    def _mass_weights(self) -> Optional[torch.Tensor]:
        """[E] a pair's mean metric per expert in the last training backward that made one ("metric_mass"); an expert
        that had no pairs there takes the layer's mean; None before the first."""
        last = getattr(self, "_metric_mass", None)
        if last is None:
            return None
        return mass_weights(last[0].get(), last[1])

    def _cached_row_bytes(self, spec: BackwardSpec, dtype: torch.dtype) -> dict:
        """_row_bytes, made once per config object and case (every training forward asks: ~15 us of host time)."""
        key = (dtype, spec.may_drop, spec.dropped_router_dots, self.ep_size)
        cfg, cache = getattr(self, "_row_bytes_cache", (None, None))
        if cfg is not self.lrmoe_config:
            cache = {}
            self._row_bytes_cache = (self.lrmoe_config, cache)
        if key not in cache:
            cache[key] = self._row_bytes(spec, dtype)
        return cache[key]

    def _row_bytes(self, spec: BackwardSpec, dtype: torch.dtype) -> dict:
        """RetentionStats' bytes per row (quotas.expert_row_bytes): what the forward keeps under each policy, the
        expert outputs included where the exact router gradient keeps them (pipeline.router_dots_from_rows); under
        ``"dropped_router_dots": "auto"`` the stash's with them saved, and with them recomputed where that differs.
        Where no pair may drop in this step, also what a step under a row cap would keep (the planner's options
        come with one, and then pairs may drop: the stash keeps x instead of its rows, and the outputs for the
        dropped pairs' dots)."""
        cfg, experts, R = self.lrmoe_config, self.deepspeed_moe.experts, self.ep_size
        shape = (self.hidden_size, experts.weight2.shape[2], experts.expert_type.activation, dtype.itemsize,
                 self.k)  # the second projection is [G, H, F]
        auto = cfg.dropped_router_dots == "auto"
        dots = "saved" if auto else cfg.dropped_router_dots

        def row_bytes(dots, may_drop):
            kept = tuple(cfg.router_grad == "exact" and not router_dots_from_rows(policy, may_drop, dots, dtype, R)
                         for policy in ("stash", "recompute"))
            return expert_row_bytes(*shape, not stash_keeps_rows(may_drop, R), kept)

        def held(may_drop):
            """(stash, the stash with the dots recomputed where "auto" may choose it, recompute, backward)"""
            stash, recompute, backward = row_bytes(dots, may_drop)
            lean = row_bytes("recomputed", may_drop)[0] if auto else stash
            return stash, None if lean == stash else lean, recompute, backward
        stash, lean, recompute, backward = held(spec.may_drop)
        return dict(stash_bytes_per_row=stash, backward_bytes_per_row=backward, recompute_bytes_per_row=recompute,
                    lean_stash_bytes_per_row=lean, capped_bytes_per_row=None if spec.may_drop else held(True)[:3],
                    dropped_router_dots=spec.dropped_router_dots)

    def forward(self, hidden_states: torch.Tensor,
                used_token: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if used_token is not None:
            raise NotImplementedError("LRMoE does not support used_token masks")
        if hidden_states.shape[-1] != self.hidden_size:
            raise ValueError(f"LRMoE expects hidden size {self.hidden_size} in the last dimension, "
                             f"got input of shape {tuple(hidden_states.shape)}")
        moe = self.deepspeed_moe
        x = hidden_states.reshape(-1, self.hidden_size)
        token = None
        if moe.experts.grouped:
            w1, w2, expert_type = moe.experts.projections()
            stacked = (moe.experts.weight1, moe.experts.weight2)
            handoff = WeightGrads()
            if torch.is_grad_enabled() and any(w.requires_grad for w in stacked):
                # before the router, so that the weights' gradients reach autograd after its backward
                token = apply_fast(ExpertWeights, handoff, *stacked)
        routing = moe.gate(x)
        # the counts' host copy is started early only for a forward that will read it
        plan = moe.dispatcher.plan(routing.topk_index, routing.counts,
                                   early_counts=not moe.experts.grouped or self._retains())
        if moe.experts.grouped:
            spec, plan_backward = self._backward_spec(plan, x.dtype)
            out = apply_fast(RoutedMLP, x, routing.topk_weight, token, plan, moe.dispatcher, expert_type, spec,
                             w1, w2, stacked, handoff)
            if plan_backward is not None:
                # Now that the forward's kernels are queued, the counts' early copy (one rank) has landed
                # and the host plans the backward's quotas while the GPU runs the forward.
                plan_backward(spec)
        else:
            rows = moe.dispatcher.dispatch(x, plan)
            out = moe.dispatcher.combine(moe.experts(rows, plan.group_sizes_host), routing.topk_weight, plan)
        if self.training and torch.is_grad_enabled():
            # only forwards that a backward follows: reentrant activation checkpointing's first, no-grad
            # forward does not count, so the counter (and the sampling seed) advances once per step
            self.retention_step += 1
            if self._retention_step_host is not None:
                self._retention_step_host += 1
        out = out.view_as(hidden_states)
        if self.use_residual:
            mlp_out = self.mlp(hidden_states)
            mlp_out = mlp_out[0] if isinstance(mlp_out, tuple) else mlp_out
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            out = out * coef[..., 0:1] + mlp_out * coef[..., 1:]
        return out, routing.aux_loss, routing.counts
