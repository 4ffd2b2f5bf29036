"""The shapes of public HF models (their config.json's fields, as the Hub publishes them):
the fine-tuning configs' models, for the tests that estimate them on the meta device and for
`benchmarks/gpu_suite.py`, which trains random weights of these shapes (no downloads)."""

from __future__ import annotations

import json
from pathlib import Path

LLAMA = dict(model_type="llama", vocab_size=128256, num_key_value_heads=8, rope_theta=500000.0)
HF_SHAPES = {
    "Llama-3.1-8B": dict(LLAMA, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, max_position_embeddings=131072),
    "Llama-3.1-70B": dict(LLAMA, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                          num_attention_heads=64, max_position_embeddings=131072),
    "Llama-3.2-1B": dict(LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, max_position_embeddings=131072,
                         tie_word_embeddings=True),
    "Qwen2.5-7B": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, rope_theta=1000000.0, max_position_embeddings=32768),
    "Qwen3-1.7B": dict(model_type="qwen3", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True),
    "Qwen3-0.6B": dict(model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                       max_position_embeddings=40960, tie_word_embeddings=True),
    "Qwen3-8B": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rope_theta=1000000.0,
                     max_position_embeddings=40960),
    "Phi-4-mini": dict(model_type="phi3", vocab_size=200064, hidden_size=3072,
                       intermediate_size=8192, num_hidden_layers=32, num_attention_heads=24,
                       num_key_value_heads=8, max_position_embeddings=131072,
                       original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                       tie_word_embeddings=True, sliding_window=262144, rope_theta=10000.0,
                       rope_scaling={"type": "longrope", "short_factor": [1.0] * 48,
                                     "long_factor": [1.0 + i / 8 for i in range(48)]}),
    "Qwen3-30B-A3B": dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                          router_aux_loss_coef=0.001, rope_theta=1000000.0,
                          max_position_embeddings=40960),
    "Mixtral-8x7B": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
                         router_aux_loss_coef=0.02, rope_theta=1000000.0, sliding_window=None,
                         max_position_embeddings=32768),
    # Gemma 3 4B as its Hub folder is (multimodal, transformers 4.50): the text model's few
    # fields that differ from Gemma3TextConfig's defaults, and the vision tower's
    "gemma-3-4b": dict(model_type="gemma3", architectures=["Gemma3ForConditionalGeneration"],
                       eos_token_id=[1, 106], mm_tokens_per_image=256,
                       text_config=dict(model_type="gemma3_text", hidden_size=2560,
                                        intermediate_size=10240, num_hidden_layers=34,
                                        rope_scaling={"factor": 8.0, "rope_type": "linear"},
                                        sliding_window=1024),
                       vision_config=dict(model_type="siglip_vision_model", hidden_size=1152,
                                          intermediate_size=4304, num_hidden_layers=27,
                                          num_attention_heads=16, image_size=896,
                                          patch_size=14, vision_use_head=False)),
    # the crosscoders' source models (read through transformers, on the meta device), and
    # llm/gemma2_2b_full's
    "gemma-2-2b": dict(model_type="gemma2", vocab_size=256000, hidden_size=2304,
                       intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                       num_key_value_heads=4, head_dim=256, max_position_embeddings=8192),
    "gpt2": dict(model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12,
                 n_positions=1024),
    # the MoE and hybrid models of 2026, through the generic transformers path: gpt-oss-20b
    # as its dequantized bf16 copy is (no quantization_config), DeepSeek-V2-Lite, and
    # Qwen3.5-27B's multimodal folder (text_config; the vision tower is not read)
    "gpt-oss-20b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880,
                        intermediate_size=2880, num_hidden_layers=24, num_attention_heads=64,
                        num_key_value_heads=8, head_dim=64, num_local_experts=32,
                        num_experts_per_tok=4, sliding_window=128,
                        layer_types=["sliding_attention", "full_attention"] * 12,
                        max_position_embeddings=131072, attention_bias=True,
                        rope_parameters=dict(rope_type="yarn", rope_theta=150000.0, factor=32.0,
                                             beta_fast=32.0, beta_slow=1.0, truncate=False,
                                             original_max_position_embeddings=4096),
                        router_aux_loss_coef=0.9, swiglu_limit=7.0, tie_word_embeddings=False),
    "DeepSeek-V2-Lite": dict(model_type="deepseek_v2", vocab_size=102400, hidden_size=2048,
                             intermediate_size=10944, moe_intermediate_size=1408,
                             num_hidden_layers=27, num_attention_heads=16,
                             num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
                             num_experts_per_tok=6, first_k_dense_replace=1, kv_lora_rank=512,
                             q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
                             v_head_dim=128, routed_scaling_factor=1.0, topk_method="greedy",
                             n_group=1, topk_group=1, norm_topk_prob=False,
                             max_position_embeddings=163840, tie_word_embeddings=False,
                             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0,
                                                  factor=40.0, beta_fast=32.0, beta_slow=1.0,
                                                  original_max_position_embeddings=4096,
                                                  mscale=0.707, mscale_all_dim=0.707)),
    "Qwen3.5-27B": dict(model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
                        tie_word_embeddings=False,
                        text_config=dict(model_type="qwen3_5_text", vocab_size=248320,
                                         hidden_size=5120, intermediate_size=17408,
                                         num_hidden_layers=64, num_attention_heads=24,
                                         num_key_value_heads=4, head_dim=256,
                                         linear_num_key_heads=16, linear_num_value_heads=48,
                                         linear_key_head_dim=128, linear_value_head_dim=128,
                                         linear_conv_kernel_dim=4, full_attention_interval=4,
                                         max_position_embeddings=262144,
                                         tie_word_embeddings=False,
                                         rope_parameters=dict(rope_type="default",
                                                              rope_theta=10000000.0,
                                                              partial_rotary_factor=0.25))),
}  # fmt: skip

# what a tiny shape of the same family changes (2 layers, width 64, a vocabulary of 512: above
# the byte tokenizer's 259): the fields a family has are replaced, none added
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, vocab_size=512, moe_intermediate_size=32,
            num_experts=4, num_local_experts=4, num_experts_per_tok=2)  # fmt: skip


def tiny_shape(shape: dict) -> dict:
    """`shape`'s family at a tiny size (its text model's fields where it has a text_config)."""
    if "text_config" in shape:
        return {**shape, "text_config": tiny_shape(shape["text_config"])}
    return {**shape, **{key: value for key, value in TINY.items() if key in shape}}


def write_shape(shape: dict, folder: Path) -> Path:
    """A model folder of `shape`: its config.json only (freetx builds random weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(shape, indent=1))
    return folder
