"""The ``"lrmoe"`` block of ds_config.json, in DeepSpeed's config style.

Example::

    "lrmoe": {"enabled": true, "retention_ratio": 0.5, "metric": "grad_norm", "seed": 1234,
              "policy": "auto", "budget_gib": 60, "floor": 0.05}

No block, or ``"enabled": false``: every LRMoE layer is an exact dropless MoE.
"""
from typing import Any, List, Literal, Mapping, Optional, Tuple, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
from pydantic import Field, StrictBool, ValidationError, model_validator

CONFIG_KEY = "lrmoe"


class LRMoEConfig(DeepSpeedConfigModel):
    """Settings shared by every LRMoE layer of a model."""

    enabled: StrictBool = False
    """Retention in the backward. false: every routed pair's backward runs (exact)."""

    retention_ratio: float = Field(1.0, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    """Fraction of a layer's routed pairs whose expert backward runs, in (0, 1], shared among the
    experts by ``quota_allocation``."""

    retention_schedule: Optional[List[Tuple[int, float]]] = None
    """The target over optimizer steps instead of one ratio: [step, ratio] points, steps increasing,
    ratios in (0, 1], linear in between, the first ratio before the first point and the last after
    the last, e.g. [[0, 0.35], [300, 0.35], [500, 1.0]]. Not with retention_ratio. (Measured: such a
    schedule of mean 0.5, ending exact, converged no better than a constant 0.5; benchmarks/results.)"""

    quota_allocation: Literal["waterfill", "proportional", "threshold", "metric_mass"] = "metric_mass"
    """How the retained pairs are shared among experts; "metric_mass" by default ("waterfill" where replica_slots is
    set and this is not). "waterfill" (from above: cold experts keep every
    pair, the hottest are capped first) or "proportional" (every expert keeps the same fraction), planned
    in the forward; the budget's and the balance factor's per-rank cuts follow the same rule. "threshold":
    no planned share: each rank keeps the target fraction of its pairs by one priority-sampling threshold
    over all of them, so an expert keeps as many pairs as its metric mass earns (less sampling variance:
    benchmarks/results/grad_noise_alloc_cpu.md); the budget's row cap then bounds each expert (the balance
    factor does not apply), and the backward exchanges its kept counts before its all-to-all (ep_size > 1).
    Not with floor or replica_slots, which need planned quotas. "metric_mass": planned in the forward like the
    water-fill, but each expert's share follows the last training backward's metric mass (Q_e = min(n_e, n_e w_e /
    tau), w_e a pair's mean metric at e there, at least 1 for an expert with pairs): about the threshold's split, so
    most of its lower variance (benchmarks/results/grad_noise_planned_cpu.md), with quotas known in the forward. The
    first step plans by the water-fill; the backward sums the metric per expert (one all-reduce of E numbers where
    ep_size > 1). Not with replica_slots. The default since its held-out loss at retention 0.5 came out closer to the
    exact run's than the water-fill's in 12 of 16 paired seeds (top-2 and top-8, CPU and one H100): +1.48% at top-2 (16 CPU
    seeds), +0.74% at top-8 (18 H100 seeds), for 0-6% more layer time (benchmarks/results/README.md, eighteenth to
    twentieth sessions)."""

    metric: Literal["grad_norm", "gate", "uniform"] = "grad_norm"
    """Contribution of a pair to its expert's update: ||dy_p|| ||x_p|| ("grad_norm"), the gate
    weight ("gate"), or none ("uniform", the ablation baseline)."""

    selection: Literal["priority_sampling", "topk"] = "priority_sampling"
    """"priority_sampling": sample pairs with probability rising with the metric, weighted so the
    gradient is unbiased. "topk": keep the largest metrics, unweighted (biased; an ablation only)."""

    seed: int = Field(1234, ge=0, strict=True)
    """Seed of the retention sampling (combined with the layer, step and rank)."""

    rescale: StrictBool = True
    """Weight each retained pair by its priority-sampling weight max(1, tau/m) so the expert gradient
    is unbiased. false keeps the retained terms unweighted (biased; an ablation)."""

    router_grad: Literal["exact", "retained"] = "exact"
    """"exact": the router's gradient from every pair. "retained": from the retained pairs alone (weighted
    like them); nothing per pair is saved for it."""

    dropped_router_dots: Literal["auto", "saved", "recomputed"] = "auto"
    """Where the exact router gradient's <y_p, dout_t> of a dropped pair p comes from: "saved", the expert
    outputs y [P, H] the forward keeps; "recomputed", the stash's pre-activations, <act(h_p), dout_t W2_e>,
    through a down-projection dgrad over the dropped rows in the backward (more time, no y kept). Only
    under the "stash" policy on one expert-parallel rank in bf16/fp32; elsewhere y is saved. "auto": saved,
    unless the memory planner finds that the stash with y does not fit the budget and the one without y keeps
    less than "recompute" would (or the policy is "stash"). Where no pair drops, every dot comes from the rows
    the backward runs: on one rank nothing is saved for it whatever this says; with ep_size > 1 "recomputed"
    (or "auto" on the planner's word) sends the dots back from the experts in one more all-to-all, of 4 bytes a
    pair, instead of keeping y, 2 H bytes a pair in bf16."""

    floor: float = Field(0.0, ge=0.0, le=1.0, strict=True, allow_inf_nan=False)
    """Minimum retained fraction of every expert's pairs, so that no expert starves. It wins over
    the target and the budget."""

    balance_factor: float = Field(1.25, ge=1.0, strict=True, allow_inf_nan=False)
    """When pairs are dropped, no expert-parallel rank retains more than this times the target's mean
    retained rows per rank (the mean before this cut): its hottest experts are capped further."""

    replica_slots: int = Field(0, ge=0, strict=True)
    """Spare expert slots per expert-parallel rank for replicas of the hottest experts in the backward
    (DESIGN.md steps 8 and 11; ep_size > 1 and the "recompute" policy, where a retained row carries its
    input and can run on any instance of its expert). Each step the planner levels the retained rows per
    rank: part of the most loaded rank's hottest expert runs on a replica at the least loaded rank, a
    token's rows go to the instance on its own rank first, and the replicas' weights are fetched from
    their homes in the backward and their gradients summed back into the home expert's. 0: off."""

    replica_min_rows: int = Field(1024, ge=1, strict=True)
    """A replica is placed only where it takes at least this many retained rows. Why 1024: a replica's
    weights out and gradient back are 12 H F bytes (bf16), the backward of one recomputed row is 16 H F
    FLOPs, so at the H200's ~600 TFLOP/s and ~450 GB/s of NVLink per direction the transfer costs about
    as much time as 0.75 * 600e12 / 450e9 = 1000 rows, whatever the shape. Across nodes, raise it."""

    policy: Literal["auto", "stash", "recompute"] = "auto"
    """What the forward keeps for the expert backward: "stash" (expert inputs and pre-activations of
    every pair; on one rank, where pairs may drop, the token inputs instead of their k-fold per-pair
    copies, which the backward gathers its retained rows from as cheaply), "recompute" (nothing per pair;
    the backward recomputes the retained pairs alone), or "auto" (stash while the memory planner finds
    that it fits the budget, else recompute)."""

    budget_gib: Optional[float] = Field(None, gt=0.0, strict=True, allow_inf_nan=False)
    """Per-GPU memory budget in GiB. None (and no budget_fraction): unbounded."""

    budget_fraction: Optional[float] = Field(None, gt=0.0, le=1.0, strict=True, allow_inf_nan=False)
    """Per-GPU memory budget as a fraction of the accelerator's total memory."""

    reserve_gib: float = Field(1.0, ge=0.0, strict=True, allow_inf_nan=False)
    """Memory kept free under the budget (allocator fragmentation, communication buffers)."""

    warmup_steps: int = Field(3, ge=1, strict=True)
    """Optimizer steps whose peak memory the planner measures before its first budgeted plan."""

    report_interval: int = Field(10, ge=1, strict=True)
    """Every this many steps the planner writes per-expert retention to DeepSpeed's monitor."""

    expert_bias_update_rate: float = Field(0.0, ge=0.0, strict=True, allow_inf_nan=False)
    """Aux-loss-free load balancing (DeepSeek-V3's, GLM-4.5's; Megatron-Core's
    moe_router_bias_update_rate): after every optimizer step, each layer built with ``expert_bias``
    moves its selection bias by this much towards balance, +rate for an expert that got fewer pairs than
    the mean over the step (all ranks, all micro-batches), -rate for one that got more. 0: the bias stays."""

    ops_backend: Literal["auto", "torch", "cuda"] = "auto"
    """Which ops run: the CUDA kernels where they build ("auto"), the torch reference ("torch"), or
    the CUDA kernels or an error that says why not ("cuda")."""

    @model_validator(mode="after")
    def _one_budget(self):
        if self.budget_gib is not None and self.budget_fraction is not None:
            raise ValueError("give budget_gib or budget_fraction, not both")
        if self.budget_gib is not None and self.budget_gib <= self.reserve_gib:
            raise ValueError(f"budget_gib ({self.budget_gib:g}) leaves nothing above reserve_gib ({self.reserve_gib:g}): "
                             "raise the budget or lower the reserve")
        return self

    @model_validator(mode="before")
    @classmethod
    def _replicas_plan_by_waterfill(cls, data: Any) -> Any:
        # the default split places no replicas: with replica_slots and no split named, the water-fill's
        if isinstance(data, Mapping) and data.get("replica_slots") and "quota_allocation" not in data:
            data = {**data, "quota_allocation": "waterfill"}
        return data

    @model_validator(mode="after")
    def _threshold_needs_no_plan(self):
        if self.quota_allocation == "threshold":
            planned = [k for k in ("floor", "replica_slots") if getattr(self, k)]
            if planned:
                raise ValueError(f'quota_allocation "threshold" chooses each expert\'s count in the backward; '
                                 f'{" and ".join(planned)} need planned quotas ("waterfill" or "proportional")')
        if self.quota_allocation == "metric_mass" and self.replica_slots:
            raise ValueError('quota_allocation "metric_mass" does not place replicas: set replica_slots 0, or use '
                             '"waterfill" or "proportional" with replicas')
        return self

    @model_validator(mode="after")
    def _one_target(self):
        points = self.retention_schedule
        if points is None:
            return self
        if "retention_ratio" in self.model_fields_set:
            raise ValueError("give retention_ratio or retention_schedule, not both")
        if not points:
            raise ValueError("retention_schedule needs at least one [step, ratio] point")
        steps = [step for step, _ in points]
        if steps[0] < 0 or any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"retention_schedule steps must be >= 0 and increasing, got {steps}")
        if not all(0.0 < ratio <= 1.0 for _, ratio in points):
            raise ValueError(f"retention_schedule ratios must be in (0, 1], got {[r for _, r in points]}")
        return self

    def retention_at(self, step: int) -> float:
        """The retention target at optimizer step ``step``: ``retention_ratio``, or the schedule's."""
        points = self.retention_schedule
        if points is None:
            return self.retention_ratio
        if step <= points[0][0]:
            return points[0][1]
        for (s0, r0), (s1, r1) in zip(points, points[1:]):
            if step < s1:  # strictly inside: a point's own step gets its ratio exactly (1.0 stays exact)
                return r0 + (r1 - r0) * (step - s0) / (s1 - s0)
        return points[-1][1]



def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "(block)"
        if e["type"] == "extra_forbidden":
            accepted = ", ".join(LRMoEConfig.model_fields)
            lines.append(f'unknown key "{key}"; accepted keys: {accepted}')
        else:
            lines.append(f'"{key}": {e["msg"]} (got {e.get("input")!r})')
    return "; ".join(lines)


def parse_config(config: Union[None, str, Mapping[str, Any]]) -> LRMoEConfig:
    """The ``"lrmoe"`` block of a DeepSpeed config (a path to the json, its dict, or what else DeepSpeed reads:
    hjson, a base64 string), validated.

    Raises ValueError naming the bad key and what is accepted.
    """
    if config is None:
        return LRMoEConfig()
    if isinstance(config, str):
        config = load_ds_config(config)  # DeepSpeed's own reader: hjson (comments allowed), or base64
    if not isinstance(config, Mapping):
        raise TypeError(f"DeepSpeed config must be a path or a dict, got {type(config).__name__}")
    block = config.get(CONFIG_KEY)
    if block is None:
        block = {}
    if not isinstance(block, Mapping):
        raise ValueError(f'ds_config "{CONFIG_KEY}" must be an object, got {type(block).__name__}')
    if "strict" in block:  # DeepSpeedConfigModel's own argument, not a key of this block
        raise ValueError(f'invalid ds_config "{CONFIG_KEY}" block: unknown key "strict"; accepted keys: '
                         f'{", ".join(LRMoEConfig.model_fields)}')
    try:
        # strict: DeepSpeed's models otherwise drop every "auto" value, which would make e.g. budget_gib "auto" unbounded
        return LRMoEConfig(strict=True, **block)
    except ValidationError as err:
        raise ValueError(f'invalid ds_config "{CONFIG_KEY}" block: {_format_error(err)}') from None
