"""The native DeepSeek-V3 block's parts on tiny tensors: the router kinds
(`freetx.models.moe.route`: DeepSeek-V3's sigmoid + stored bias + grouped top-k,
DeepSeek-V2's group-limited softmax) against transformers' own routers on the same
weights, shared experts, multi-head latent attention's shapes, packed documents and
refusals, YaRN RoPE against transformers', and the config checks of the new fields."""

from __future__ import annotations

import pytest
import torch

from freetx.distributed import materialize
from freetx.errors import CheckpointError, ConfigError
from freetx.models.attention import document_mask
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.latent_attention import LatentAttention, latent_attention_scale
from freetx.models.decoder.rope import rope_attention_factor, rope_frequencies
from freetx.models.decoder.tensor_parallel import check_tensor_parallel
from freetx.models.moe import MoEFeedForward, RouterKind
from freetx.models.transformer import decoder
from freetx.models.transformer_hf import LLAMA_LAYOUT

# a DeepSeek-V3 shape: MLA (q rank 16, kv rank 24, RoPE 8 + 8 without, values 12), 8
# experts in 4 groups (2 kept), top 3, a shared expert, layer 0 dense
MLA = dict(vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, head_dim=8,
           ffn_hidden_dim=48, max_seq_len=32, kv_lora_rank=24, q_lora_rank=16,
           qk_nope_head_dim=8, v_head_dim=12, rope_interleave=True)  # fmt: skip
EXPERTS = dict(num_experts=8, experts_per_token=3, moe_ffn_hidden_dim=16, mlp_only_layers=[0],
               router_scores="sigmoid", router_bias=True, router_fp32=True, expert_groups=4,
               groups_per_token=2, routed_scaling_factor=2.5, shared_expert_ffn_dim=16,
               hf_model_type="deepseek_v3")  # fmt: skip


def model(**fields):
    with torch.device("meta"):
        built = decoder(**{**MLA, **EXPERTS, **fields})
    materialize(built, torch.device("cpu"), seed=3)
    return built


def chosen_set(weights, chosen):
    """Each row's experts and weights in expert order (transformers' top-k is unsorted)."""
    order = chosen.argsort(dim=-1)
    return chosen.gather(1, order), weights.gather(1, order)


def hf_router(module_path: str, config_class: str, **fields):
    transformers = pytest.importorskip("transformers")
    module = __import__(module_path, fromlist=["_"])
    config = getattr(transformers, config_class)(hidden_size=16, num_attention_heads=4,
                                                 num_key_value_heads=4, num_experts_per_tok=3,
                                                 n_routed_experts=8, **fields)  # fmt: skip
    return config, getattr(module, config_class.replace("Config", "TopkRouter"))(config)


def test_sigmoid_grouped_router_with_bias_equals_transformers_deepseek_v3_router():
    config, reference = hf_router(
        "transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3Config",
        n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    torch.manual_seed(0)
    reference.weight.data.normal_(0, 0.5)
    reference.e_score_correction_bias.normal_(0, 0.5)
    kind = RouterKind("sigmoid", True, 4, 2, True, 2.5, True)
    layer = MoEFeedForward(16, 8, 8, 3, True, True, kind)
    layer.gate.weight.data.copy_(reference.weight)
    layer.e_score_correction_bias.copy_(reference.e_score_correction_bias)
    x = torch.randn(64, 16)
    _, hf_weights, hf_chosen = reference(x)
    from freetx.models.moe import route

    weights, chosen, probs = route(layer.gate(x), kind, 3, layer.e_score_correction_bias)
    ours, theirs = chosen_set(weights, chosen), chosen_set(hf_weights, hf_chosen)
    assert torch.equal(ours[0], theirs[0]) and (ours[1] - theirs[1]).abs().max() < 1e-6
    groups = chosen // 2  # every token's experts lie in at most 2 of the 4 groups
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    assert len(set(groups.flatten().tolist())) == 4  # and the groups differ by token
    unbiased = route(layer.gate(x), RouterKind("sigmoid", False, 4, 2, True, 2.5, True), 3)[1]
    assert not torch.equal(unbiased, chosen)  # the bias steers the choice
    assert torch.allclose(probs.sum(-1), torch.ones(64))


def test_group_limited_softmax_router_equals_transformers_deepseek_v2_router():
    config, reference = hf_router(
        "transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2Config",
        n_group=4, topk_group=2, routed_scaling_factor=16.0, topk_method="group_limited_greedy",
    )  # fmt: skip
    torch.manual_seed(1)
    reference.weight.data.normal_(0, 0.5)
    kind = RouterKind("softmax", False, 4, 2, False, 16.0, True)
    x = torch.randn(64, 16)
    from freetx.models.moe import route

    weights, chosen, _ = route(torch.nn.functional.linear(x, reference.weight), kind, 3)
    _, hf_weights, hf_chosen = reference(x)
    ours, theirs = chosen_set(weights, chosen), chosen_set(hf_weights, hf_chosen)
    assert torch.equal(ours[0], theirs[0]) and (ours[1] - theirs[1]).abs().max() < 1e-6


def test_the_router_bias_is_a_float32_persistent_buffer_and_the_router_runs_in_float32():
    layer = MoEFeedForward(16, 8, 8, 3, True, True, RouterKind("sigmoid", True, fp32=True))
    assert layer.state_dict()["e_score_correction_bias"].dtype == torch.float32
    assert "e_score_correction_bias" not in dict(layer.named_parameters())
    layer.to(torch.bfloat16)
    assert layer.gate(torch.randn(4, 16, dtype=torch.bfloat16)).dtype == torch.float32


def test_lora_on_every_linear_leaves_the_router_and_keeps_its_bias():
    """`all-linear` leaves the router (PEFT's does on transformers' routers, no Linear
    modules, so an adapter there could not be exported) and adapts the experts: the block
    still routes, by the stored bias too."""
    from freetx.models.moe import Router
    from freetx.models.peft import apply_lora

    built = model()
    names = apply_lora(built, ["all-linear"], rank=2, alpha=4.0)
    block = built.layers[1].feed_forward
    assert type(block.gate) is Router and "layers.1.feed_forward.gate" not in names
    assert "layers.1.feed_forward.experts" in names
    assert "layers.1.feed_forward.e_score_correction_bias" in built.state_dict()
    out, _ = block(torch.randn(2, 3, 32))
    assert out.shape == (2, 3, 32)


def test_shared_experts_add_an_ungated_mlp_that_every_token_goes_through():
    built = model()
    block = built.layers[1].feed_forward
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out, routing = block(x)
        shared, block.shared_experts = block.shared_experts, None
        alone, _ = block(x)
        assert (out - alone - shared(x.reshape(-1, 32)).reshape(x.shape)).abs().max() < 1e-6
    assert routing.counts.sum() == 10 * 3
    assert isinstance(built.layers[0].feed_forward, type(shared))  # layer 0 dense (mlp_only)


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_latent_attention_shapes_with_and_without_the_query_bottleneck(q_lora_rank):
    built = model(q_lora_rank=q_lora_rank).eval()
    attention = built.layers[0].attention
    assert isinstance(attention, LatentAttention)
    shapes = {n: tuple(p.shape) for n, p in attention.named_parameters()}
    queries = {"wq_a.weight": (16, 32), "q_a_norm.weight": (16,), "wq_b.weight": (64, 16)}
    assert shapes == {
        **(queries if q_lora_rank else {"wq.weight": (4 * 16, 32)}),
        "wkv_a.weight": (24 + 8, 32), "kv_a_norm.weight": (24,),
        "wkv_b.weight": (4 * (8 + 12), 24), "wo.weight": (32, 4 * 12),
    }  # fmt: skip
    assert attention.spec.scale == 16**-0.5
    out = built(torch.randint(0, 64, (2, 7)))
    assert out.shape == (2, 7, 64)


def test_yarn_mscale_all_dim_scales_the_softmax_as_transformers_does():
    yarn = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 16,
            "mscale": 1.0, "mscale_all_dim": 1.0}  # fmt: skip
    cfg = TransformerConfig(**{**MLA, "rope_scaling": yarn})
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert latent_attention_scale(cfg) == pytest.approx(16**-0.5 * mscale**2)


def test_yarn_frequencies_and_attention_factor_equal_transformers():
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
              "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
              "beta_fast": 32, "beta_slow": 1}  # fmt: skip
    config = transformers.DeepseekV3Config(qk_rope_head_dim=16, rope_parameters=dict(params))
    inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    assert torch.equal(rope_frequencies(16, 10000.0, scaling), inv_freq)
    assert rope_attention_factor(scaling) == pytest.approx(factor)


def test_a_packed_batch_computes_each_document_as_if_alone():
    built = model().eval()
    a, b = torch.randint(0, 64, (1, 5)), torch.randint(0, 64, (1, 7))
    documents = torch.tensor([[0] * 5 + [1] * 7])
    with torch.no_grad():
        packed = built(torch.cat([a, b], dim=1), documents=documents)
        alone = torch.cat([built(a), built(b)], dim=1)
    assert (packed - alone).abs().max() < 1e-5


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flexattention_takes_the_value_heads_of_another_size():
    """On CUDA a packed batch's mask is a FlexAttention block mask: its kernel takes values
    of v_head_dim beside queries and keys of qk_nope_head_dim + head_dim (eager on CPU)."""
    attention = model().layers[0].attention
    x, documents = torch.randn(1, 12, 32), torch.tensor([[0] * 5 + [1] * 7])
    cos, sin = model().rope(12)
    with torch.no_grad():
        boolean = attention(x, cos, sin, mask=document_mask(documents, attention.spec))
        flex = attention(x, cos, sin, mask=document_mask(documents, attention.spec, kernel="flex"))
    assert (flex - boolean).abs().max() < 1e-5


def test_latent_attention_refuses_cross_and_bidirectional_attention():
    attention = model().layers[0].attention
    cos, sin = model().rope(4)
    with pytest.raises(ValueError, match="takes its keys and values from its own input"):
        attention(torch.randn(1, 4, 32), cos, sin, kv_input=torch.randn(1, 4, 32))
    with pytest.raises(ValueError, match="multi-head latent attention is causal"):
        attention(torch.randn(1, 4, 32), cos, sin, causal=False)


def test_the_free_transformer_refuses_latent_attention_before_it_is_built():
    from freetx.models.free_transformer import free_transformer

    with pytest.raises(ValueError, match="set kv_lora_rank=null"):
        free_transformer("tiny", kv_lora_rank=16)


def test_tensor_parallelism_refuses_latent_attention_by_name():
    with pytest.raises(ConfigError, match="does not slice multi-head latent attention"):
        check_tensor_parallel(TransformerConfig(**MLA), 2)


@pytest.mark.parametrize(
    ("fields", "key"),
    [(dict(expert_groups=3), "expert_groups"),  # 8 experts in 3 groups
     (dict(expert_groups=8, groups_per_token=2), "expert_groups"),  # top-2 sum of 1 expert
     (dict(groups_per_token=5), "groups_per_token"),
     (dict(groups_per_token=1, experts_per_token=3), "groups_per_token"),  # 2 experts kept
     (dict(router_scores="relu"), "router_scores"),
     (dict(kv_lora_rank=0), "kv_lora_rank"), (dict(v_head_dim=0), "v_head_dim")],
)  # fmt: skip
def test_routers_and_latent_sizes_no_model_has_are_meaningless(fields, key):
    assert key in TransformerConfig.meaningless({**MLA, **EXPERTS, **fields})


def test_exports_refuse_what_the_family_cannot_hold():
    """Latent attention as mixtral, DeepSeek's router as mixtral, grouped-query attention as
    deepseek_v3: each refused naming what differs."""
    mla = {**TransformerConfig(**{**MLA, **EXPERTS}).__dict__}
    assert LLAMA_LAYOUT.to_hf_config(mla, "float32")["kv_lora_rank"] == 24
    with pytest.raises(CheckpointError, match="an HF mixtral model cannot have kv_lora_rank=24"):
        LLAMA_LAYOUT.to_hf_config({**mla, "hf_model_type": "mixtral"}, "float32")
    gqa = {**mla, "kv_lora_rank": None, "q_lora_rank": None, "qk_nope_head_dim": 0,
           "rope_interleave": False}  # fmt: skip
    with pytest.raises(CheckpointError, match=r"an HF mixtral model has .*\"router_scores\": "
                       r"\"sigmoid\""):  # fmt: skip
        LLAMA_LAYOUT.to_hf_config({**gqa, "hf_model_type": "mixtral"}, "float32")
    with pytest.raises(CheckpointError, match="an HF deepseek_v3 model has multi-head latent"):
        LLAMA_LAYOUT.to_hf_config(gqa, "float32")


def folder_config(model_type: str, **fields) -> dict:
    """A config.json of a tiny model of `model_type` (transformers' defaults elsewhere)."""
    transformers = pytest.importorskip("transformers")
    shape = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=4, moe_intermediate_size=16,
                 n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1)  # fmt: skip
    return transformers.AutoConfig.for_model(model_type, **{**shape, **fields}).to_dict()


def test_a_deepseek_v2_folder_routed_another_way_is_refused_by_name():
    hf = folder_config("deepseek_v2", topk_method="greedy")
    assert LLAMA_LAYOUT.from_hf_config(hf)["expert_groups"] == 1
    with pytest.raises(CheckpointError, match=r'topk_method="noaux_tc".*greedy and group_limited'):
        LLAMA_LAYOUT.from_hf_config({**hf, "topk_method": "noaux_tc"})


def test_a_glm4_moe_folder_with_qk_norms_is_refused_by_name():
    hf = folder_config("glm4_moe", head_dim=8)
    assert LLAMA_LAYOUT.from_hf_config(hf)["partial_rotary_factor"] == 0.5
    with pytest.raises(CheckpointError, match="use_qk_norm=true"):
        LLAMA_LAYOUT.from_hf_config({**hf, "use_qk_norm": True})
