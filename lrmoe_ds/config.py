"""The ``"lrmoe"`` block of ds_config.json, in DeepSpeed's config style.

Example::

    "lrmoe": {"enabled": true, "retention_ratio": 0.5, "metric": "grad_norm", "seed": 1234}

No block, or ``"enabled": false``: every LRMoE layer is an exact dropless MoE.
"""
import json
from typing import Any, Dict, Literal, Mapping, Union

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import Field, ValidationError

CONFIG_KEY = "lrmoe"


class LRMoEConfig(DeepSpeedConfigModel):
    """Settings shared by every LRMoE layer of a model."""

    enabled: bool = False
    """Retention in the backward. false: every routed pair's backward runs (exact)."""

    retention_ratio: float = Field(1.0, gt=0.0, le=1.0)
    """Fraction of a layer's routed pairs whose expert backward runs, in (0, 1]. Quotas are a
    water-fill from above: cold experts keep every pair, the hottest are capped first."""

    metric: Literal["grad_norm", "gate", "uniform"] = "grad_norm"
    """Contribution of a pair to its expert's update: ||dy_p|| ||x_p|| ("grad_norm"), the gate
    weight ("gate"), or none ("uniform", the ablation baseline)."""

    selection: Literal["priority_sampling", "topk"] = "priority_sampling"
    """"priority_sampling": sample pairs with probability rising with the metric, weighted so the
    gradient is unbiased. "topk": keep the largest metrics, unweighted (biased; an ablation only)."""

    seed: int = Field(1234, ge=0)
    """Seed of the retention sampling (combined with the layer, step and rank)."""

    ops_backend: Literal["auto", "torch", "cuda"] = "auto"
    """Which ops run: the CUDA kernels where they build ("auto"), the torch reference ("torch"), or
    the CUDA kernels or an error that says why not ("cuda")."""


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
    """The ``"lrmoe"`` block of a DeepSpeed config (a path to the json, or its dict), validated.

    Raises ValueError naming the bad key and what is accepted.
    """
    if config is None:
        return LRMoEConfig()
    if isinstance(config, str):
        with open(config) as f:
            config = json.load(f)
    if not isinstance(config, Mapping):
        raise TypeError(f"DeepSpeed config must be a path or a dict, got {type(config).__name__}")
    block: Dict[str, Any] = config.get(CONFIG_KEY) or {}
    if not isinstance(block, Mapping):
        raise ValueError(f'ds_config "{CONFIG_KEY}" must be an object, got {type(block).__name__}')
    try:
        return LRMoEConfig(**block)
    except ValidationError as err:
        raise ValueError(f'invalid ds_config "{CONFIG_KEY}" block: {_format_error(err)}') from None
