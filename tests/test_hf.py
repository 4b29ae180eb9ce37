"""The Hugging Face converter: tiny Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, GLM-4.5 and DeepSeek-V3 models
(built from configs, nothing downloaded) compute the same logits and gradients after their MoE blocks
become LRMoE layers."""
import pytest
import torch

import lrmoe_ds
from lrmoe_ds.hf import HFMoEBlock, aux_loss, convert_hf_moe

transformers = pytest.importorskip("transformers")

H, E, K, F, V, LAYERS = 32, 4, 2, 24, 64, 2


def tiny(family: str, **overrides):
    common = dict(vocab_size=V, hidden_size=H, num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, num_experts_per_tok=K, hidden_act="silu", tie_word_embeddings=False)
    if family == "qwen3":
        config = transformers.Qwen3MoeConfig(num_experts=E, moe_intermediate_size=F, intermediate_size=2 * F,
                                             decoder_sparse_step=1, mlp_only_layers=[], head_dim=16,
                                             **{**common, **overrides})
        model = transformers.Qwen3MoeForCausalLM(config)
    elif family == "qwen2":  # a shared expert behind a sigmoid gate, beside the routed ones
        config = transformers.Qwen2MoeConfig(num_experts=E, moe_intermediate_size=F, intermediate_size=2 * F,
                                             shared_expert_intermediate_size=F + 8, decoder_sparse_step=1,
                                             mlp_only_layers=[], **{**common, **overrides})
        model = transformers.Qwen2MoeForCausalLM(config)
    elif family == "olmoe":
        config = transformers.OlmoeConfig(num_experts=E, intermediate_size=F, **{**common, **overrides})
        model = transformers.OlmoeForCausalLM(config)
    elif family == "glm4":  # sigmoid router with a selection bias, a scaling factor, an ungated shared expert
        config = transformers.Glm4MoeConfig(n_routed_experts=E, moe_intermediate_size=F, intermediate_size=2 * F,
                                            first_k_dense_replace=0, n_shared_experts=1, head_dim=16,
                                            **{**common, "routed_scaling_factor": 2.5, **overrides})
        model = transformers.Glm4MoeForCausalLM(config)
    elif family == "deepseek_v3":
        config = transformers.DeepseekV3Config(n_routed_experts=E, moe_intermediate_size=F, intermediate_size=2 * F,
                                               first_k_dense_replace=0, n_shared_experts=1, q_lora_rank=None,
                                               kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                                               **{**common, "n_group": 1, "topk_group": 1, **overrides})
        model = transformers.DeepseekV3ForCausalLM(config)
    else:
        config = transformers.MixtralConfig(num_local_experts=E, intermediate_size=F,
                                            **{**common, "router_jitter_noise": 0.0, **overrides})
        model = transformers.MixtralForCausalLM(config)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # the routers start at zero: random weights make routing non-trivial
            p.normal_(0.0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # large enough to change which experts are chosen
                b.normal_(0.0, 0.3)
    return model.float()


def logits_and_grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids).logits
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def expert_grads_hf(grads, prefix):
    """Per expert (gate_up [2F, H], down [H, F]) gradients from the stacked Hugging Face ones."""
    gu, dn = grads[f"{prefix}.experts.gate_up_proj"], grads[f"{prefix}.experts.down_proj"]
    return [(gu[e], dn[e]) for e in range(E)]


@pytest.mark.parametrize("family,overrides", [("qwen3", {"norm_topk_prob": True}), ("qwen3", {"norm_topk_prob": False}),
                                              ("mixtral", {}), ("qwen2", {"norm_topk_prob": False}),
                                              ("olmoe", {"norm_topk_prob": False}), ("glm4", {}),
                                              ("glm4", {"norm_topk_prob": False, "routed_scaling_factor": 1.0}),
                                              ("deepseek_v3", {"routed_scaling_factor": 1.5}),
                                              ("deepseek_v3", {"n_group": 2, "topk_group": 1})])
def test_converted_model_matches_the_original(family, overrides):
    model = tiny(family, **overrides)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    ref_out, ref_grads = logits_and_grads(model, ids)
    names = convert_hf_moe(model)
    assert names == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    assert all(isinstance(model.get_submodule(n), HFMoEBlock) for n in names)
    assert len(lrmoe_ds.lrmoe_layers(model)) == LAYERS
    out, grads = logits_and_grads(model, ids)
    # the same routing and weights; the router's logits are fp32 in both, its scores differ by rounding
    assert torch.allclose(out, ref_out, rtol=1e-4, atol=1e-4), float((out - ref_out).abs().max())
    for n, g in ref_grads.items():
        if ".mlp." not in n or ".shared_expert" in n:  # shared experts keep their names
            assert torch.allclose(grads[n], g, rtol=1e-3, atol=1e-4), n
    for i, name in enumerate(names):
        moe = model.get_submodule(name).moe
        assert torch.allclose(grads[f"{name}.moe.deepspeed_moe.gate.wg.weight"], ref_grads[f"{name}.gate.weight"],
                              rtol=1e-3, atol=1e-4)
        experts = moe.deepspeed_moe.experts
        for e, (gu, dn) in enumerate(expert_grads_hf(ref_grads, name)):
            assert torch.allclose(experts.weight1.grad[e], gu, rtol=1e-3, atol=1e-4), (name, e)
            assert torch.allclose(experts.weight2.grad[e], dn, rtol=1e-3, atol=1e-4), (name, e)
    assert aux_loss(model).ndim == 0 and float(aux_loss(model).detach()) > 0  # each block's load-balancing loss


@pytest.mark.parametrize("family", ["qwen3", "glm4"])
def test_converted_model_trains_with_retention(family):
    """After conversion the model is an LRMoE model: the "lrmoe" block applies, and at retention 0.5
    the expert backward keeps about half of each layer's pairs."""
    model = tiny(family)
    convert_hf_moe(model)
    lrmoe_ds.configure_model(model, lrmoe_ds.LRMoEConfig(enabled=True, retention_ratio=0.5))
    model.train()
    ids = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(2))
    model(input_ids=ids).logits.sum().backward()
    for layer in lrmoe_ds.lrmoe_layers(model):
        kept, pairs = int(layer.last_stats.quotas.sum()), int(layer.last_stats.counts.sum())
        assert pairs == 2 * 16 * K and pairs // 2 - E <= kept <= pairs // 2


def test_refuses_what_it_cannot_convert_exactly():
    model = tiny("mixtral", router_jitter_noise=0.1)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp \(MixtralSparseMoeBlock\).*jitter"):
        convert_hf_moe(model)
    assert not any(isinstance(m, HFMoEBlock) for m in model.modules())  # nothing swapped
    model = tiny("qwen3", hidden_act="gelu")
    with pytest.raises(ValueError, match="not SiLU"):
        convert_hf_moe(model)
    block = tiny("qwen3").model.layers[0].mlp
    OtherRouting = type("OtherRoutingMoeBlock", (torch.nn.Module,), {})  # same structure, unread routing
    other = OtherRouting()
    other.gate, other.experts = block.gate, block.experts
    with pytest.raises(ValueError, match=r"mlp \(OtherRoutingMoeBlock\).*not one read and found"):
        convert_hf_moe(torch.nn.ModuleDict({"mlp": other}))
    model = tiny("deepseek_v3", n_group=4, topk_group=1)  # 1 expert per group: too few to choose k = 2 from
    with pytest.raises(ValueError, match=r"\(DeepseekV3MoE\).*expert groups.*topk_groups must be"):
        convert_hf_moe(model)
    model = tiny("qwen3", num_experts_per_tok=1, norm_topk_prob=True)  # the one weight renormalised to 1
    with pytest.raises(ValueError, match="renormalises a single choice"):
        convert_hf_moe(model)
    with pytest.raises(ValueError, match="no sparse MoE block"):
        convert_hf_moe(torch.nn.Sequential(torch.nn.Linear(2, 2)))


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "glm4", "deepseek_v3", "mixtral", "olmoe"])
def test_hf_state_dict_is_the_original_models_and_loads_back(family, tmp_path):
    """hf_state_dict gives the unconverted model's own entries (the same names, shapes, dtypes and, before any
    training, values); after the LRMoE weights change, transformers loads it into a fresh unconverted model,
    which then computes what the converted one does."""
    model = tiny(family)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    convert_hf_moe(model)
    exported = lrmoe_ds.hf_state_dict(model)
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) and exported[k].dtype == original[k].dtype for k in original)
    with torch.no_grad():  # as a training step would: every converted parameter moves
        for layer in lrmoe_ds.lrmoe_layers(model):
            for p in layer.parameters():
                p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.02)
            if layer.deepspeed_moe.gate.score_bias is not None:
                layer.deepspeed_moe.gate.score_bias.add_(0.1)
    fresh = tiny(family)
    fresh.load_state_dict(lrmoe_ds.hf_state_dict(model), strict=True)
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours, theirs = model(input_ids=ids).logits, fresh(input_ids=ids).logits
    assert not torch.allclose(theirs, tiny(family)(input_ids=ids).logits, atol=1e-3)  # the moved weights count
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4), float((ours - theirs).abs().max())
    if family == "qwen3":  # through the files transformers writes and reads
        model.save_pretrained(tmp_path, state_dict=lrmoe_ds.hf_state_dict(model))
        with torch.no_grad():
            loaded = type(fresh).from_pretrained(tmp_path)(input_ids=ids).logits
        assert torch.equal(loaded, theirs)


def test_transposed_expert_storage_converts_to_the_same_weights():
    """transformers marks experts stored as [E, H, 2F] / [E, F, H] with is_transposed."""
    import copy
    model = tiny("qwen3")
    flipped = copy.deepcopy(model)
    for block in (flipped.model.layers[i].mlp for i in range(LAYERS)):
        ex = block.experts
        ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj.detach().transpose(1, 2).contiguous())
        ex.down_proj = torch.nn.Parameter(ex.down_proj.detach().transpose(1, 2).contiguous())
        ex.is_transposed = True
    stored = {k: v.clone() for k, v in flipped.state_dict().items()}
    convert_hf_moe(model)
    convert_hf_moe(flipped)
    for a, b in zip(lrmoe_ds.lrmoe_layers(model), lrmoe_ds.lrmoe_layers(flipped)):
        assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    exported = lrmoe_ds.hf_state_dict(flipped)  # and back to the transposed storage
    assert exported.keys() == stored.keys() and all(torch.equal(exported[k], stored[k]) for k in stored)


def test_an_fp32_router_stays_fp32_beside_bf16_experts():
    """DeepSeek-V3 and GLM-4.5 keep the router's weight and bias in fp32 in a bf16 model; so does the conversion."""
    model = tiny("glm4").to(torch.bfloat16)
    for layer in model.model.layers:
        layer.mlp.gate.float()
    ids = torch.randint(0, V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(input_ids=ids).logits.float()
        convert_hf_moe(model)
        out = model(input_ids=ids).logits.float()
    gate = model.model.layers[0].mlp.moe.deepspeed_moe.gate
    experts = model.model.layers[0].mlp.moe.deepspeed_moe.experts
    assert gate.wg.weight.dtype == gate.score_bias.dtype == torch.float32
    assert experts.weight1.dtype == experts.weight2.dtype == torch.bfloat16
    assert float((out - ref).abs().max()) < 0.03 * float(ref.abs().max())  # bf16 rounding of the same routing
