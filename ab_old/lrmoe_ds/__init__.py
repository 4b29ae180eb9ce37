"""lrmoe_ds: LRMoE for DeepSpeed.

A dropless MoE layer (``LRMoE``, a drop-in for ``deepspeed.moe.layer.MoE``) whose expert backward
can run on a sampled, unbiasedly weighted subset of the routed pairs, within per-expert quotas.

Dimension letters used in docstrings throughout:
    T tokens, H hidden, F expert hidden, E experts, E_l local experts, K top-k,
    R expert-parallel ranks, P = T*K routed pairs, M rows on an expert rank, G groups.
"""
from lrmoe_ds.balancing import ExpertBiasBalancer
from lrmoe_ds.config import LRMoEConfig, parse_config
from lrmoe_ds.experts import GELUExpert, SwiGLUExpert
from lrmoe_ds.hf import convert_hf_moe, hf_state_dict
from lrmoe_ds.integration import configure_model, initialize, lrmoe_layers
from lrmoe_ds.layer import LRMoE

__all__ = ["LRMoE", "LRMoEConfig", "SwiGLUExpert", "GELUExpert", "initialize", "configure_model",
           "lrmoe_layers", "parse_config", "convert_hf_moe", "hf_state_dict", "ExpertBiasBalancer"]
__version__ = "0.1.0"
