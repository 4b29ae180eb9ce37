"""Connecting the "lrmoe" config block to a model and to DeepSpeed's engine."""
from typing import Any, Dict, List, Optional

import deepspeed
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from torch import nn

from lrmoe_ds.balancing import ExpertBiasBalancer
from lrmoe_ds.config import LRMoEConfig, parse_config
from lrmoe_ds.layer import LRMoE
from lrmoe_ds.planner import MemoryPlanner


def lrmoe_layers(model: nn.Module) -> List[LRMoE]:
    """The LRMoE layers of a model, in module order."""
    return [m for m in model.modules() if isinstance(m, LRMoE)]


def configure_model(model: nn.Module, config: Optional[LRMoEConfig] = None) -> LRMoEConfig:
    """Apply an "lrmoe" block to every LRMoE layer of ``model`` (numbering the layers for seeding)."""
    config = config or LRMoEConfig()
    for number, layer in enumerate(lrmoe_layers(model)):
        layer.configure(config, layer_number=number)
    return config


def initialize(args=None, model: Optional[nn.Module] = None, config: Any = None,
               model_parameters: Optional[Any] = None, **kwargs):
    """``deepspeed.initialize`` for models with LRMoE layers.

    Reads and validates the config's "lrmoe" block (the config given here, or
    ``args.deepspeed_config``) before anything starts, configures every LRMoE layer with it, builds
    DeepSpeed's MoE parameter groups when ``model_parameters`` is not given, then calls
    ``deepspeed.initialize`` with the same arguments, and (when the block is enabled) attaches a
    :class:`~lrmoe_ds.planner.MemoryPlanner` as ``engine.lrmoe_planner``, which sets each layer's
    activation policy and retention cap from the memory budget and logs to DeepSpeed's monitor; with
    ``expert_bias_update_rate`` > 0, an :class:`~lrmoe_ds.balancing.ExpertBiasBalancer` as
    ``engine.lrmoe_balancer``, which updates the layers' selection biases after every optimizer step.
    Returns ``(engine, optimizer, dataloader, lr_scheduler)`` as ``deepspeed.initialize`` does.
    """
    if model is None:
        raise ValueError("lrmoe_ds.initialize needs a model")
    source = config if config is not None else getattr(args, "deepspeed_config", None)
    lrmoe_config = configure_model(model, parse_config(source))
    if model_parameters is None:
        params: Dict[str, Any] = {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"}
        model_parameters = split_params_into_different_moe_groups_for_optimizer(params)
    if config is not None:
        kwargs["config"] = config
    engine, *rest = deepspeed.initialize(args=args, model=model, model_parameters=model_parameters, **kwargs)
    if lrmoe_config.expert_bias_update_rate > 0:
        engine.lrmoe_balancer = ExpertBiasBalancer(lrmoe_layers(model), lrmoe_config.expert_bias_update_rate)
        engine.lrmoe_balancer.attach(engine)
    if lrmoe_config.enabled and lrmoe_layers(model):
        # the memory planner follows every training step through a forward pre-hook on the engine's module
        engine.lrmoe_planner = MemoryPlanner(lrmoe_config, lrmoe_layers(model))
        engine.lrmoe_planner.attach(engine)
    return (engine, *rest)
