"""Model folders as `transformers` writes them (tiny, random weights), for the tests of
freetx's HF reading and writing. Every family freetx reads (Llama, Mistral, Qwen2,
Qwen3, OLMo 2, Phi-3/Phi-4, Gemma 2, Gemma 3 text and multimodal, Mixtral, Qwen3-MoE,
SmolLM3), sharded and not, in the current config layout (`rope_parameters`) and the older one
(`rope_theta` + `rope_scaling` at the top); and causal LMs freetx has no native layout for,
read through the generic transformers path (`GENERIC_FAMILIES`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 384
# the configs' learning rates suit pretrained weights (llm/hf_tiny_full: 2e-5); the tiny
# folders here are random, and tests that look for training take a larger step
RANDOM_WEIGHTS_LR = "optimizer.lr=1e-3"
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)  # fmt: skip
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # fmt: skip
# Phi3Config's default ids (32000) lie outside the tiny vocabulary
PHI3_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
# LongRoPE: one factor per frequency (head_dim 16: 8; Phi-4-mini's 0.75 of it: 6), short up
# to original_max_position_embeddings=64 tokens, long beyond; max 256 / 64 sets the
# attention factor, sqrt(1 + ln 4 / ln 64)
SHORT_FACTOR = [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8]
LONG_FACTOR = [1.0, 1.5, 2.4, 3.9, 6.2, 9.7, 15.0, 23.0]


def longrope(factors: int, **more) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": SHORT_FACTOR[:factors],
            "long_factor": LONG_FACTOR[:factors], **more}  # fmt: skip


# Gemma's default token ids (pad 0, eos 1, bos 2) lie inside the tiny vocabulary
GEMMA_TOKENS = dict(pad_token_id=0, eos_token_id=1, bos_token_id=2)
GEMMA3 = dict(GEMMA_TOKENS, num_hidden_layers=3, head_dim=32, query_pre_attn_scalar=32,
              sliding_window=40,
              layer_types=["sliding_attention", "sliding_attention", "full_attention"],
              rope_parameters={
                  "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})  # fmt: skip

SMOLLM3 = dict(num_hidden_layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# a SigLIP vision tower of 2x2 patches of 14 pixels, one layer (Gemma 3's, tiny)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)  # fmt: skip

# family name -> (transformers config class name, config fields, save options; a multimodal
# config's text model shape is its text_config's)
FAMILIES = {
    # Llama 3.2: tied embeddings, llama3 rope, GQA, sharded
    "llama3_2": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=True),
                 dict(max_shard_size="40KB")),
    # Llama 3.1: untied, llama3 rope, written in the older layout (rope_theta + rope_scaling)
    "llama3_1_old_layout": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE), {}),
    # Llama 2: plain rope theta 10000, MHA, older layout
    "llama2_old_layout": ("LlamaConfig", dict(num_key_value_heads=4,
                                              rope_parameters={"rope_type": "default",
                                                               "rope_theta": 10000.0}), {}),
    # an explicit head_dim that is not hidden / heads
    "llama_head_dim": ("LlamaConfig", dict(head_dim=32), {}),
    "mistral": ("MistralConfig", dict(sliding_window=None,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1000000.0}),
                dict(max_shard_size="60KB")),
    # Qwen2.5: q/k/v biases, tied, theta 1e6
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0}), {}),
    # Qwen3: q/k RMSNorm per head, an explicit head_dim (not hidden / heads), tied, sharded
    "qwen3": ("Qwen3Config", dict(head_dim=32, tie_word_embeddings=True,
                                  rope_parameters={"rope_type": "default",
                                                   "rope_theta": 1000000.0}),
              dict(max_shard_size="40KB")),
    "qwen3_old_layout": ("Qwen3Config", dict(rope_parameters={"rope_type": "default",
                                                              "rope_theta": 1000000.0}), {}),
    # OLMo 2: post-norms, q/k RMSNorm over the whole projections, untied
    # (Olmo2Config's default eos_token_id, 50279, lies outside the tiny vocabulary)
    "olmo2": ("Olmo2Config", dict(eos_token_id=2, rope_parameters={"rope_type": "default",
                                                                   "rope_theta": 500000.0}),
              dict(max_shard_size="40KB")),
    "olmo2_old_layout": ("Olmo2Config", dict(eos_token_id=2,
                                             rope_parameters={"rope_type": "default",
                                                              "rope_theta": 500000.0}), {}),
    # Mixtral: every block a mixture of 4 experts, top 2 (weights renormalized), sharded
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2,
                                      sliding_window=None, router_aux_loss_coef=0.02,
                                      rope_parameters={"rope_type": "default",
                                                       "rope_theta": 1000000.0}),
                dict(max_shard_size="40KB")),
    # Qwen3-MoE: q/k norms per head, 4 experts of 48, top 2 not renormalized; block 1 dense
    # (mlp_only_layers), sharded
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_hidden_layers=3, num_experts=4,
                                         num_experts_per_tok=2, moe_intermediate_size=48,
                                         mlp_only_layers=[1], head_dim=32,
                                         router_aux_loss_coef=0.01,
                                         rope_parameters={"rope_type": "default",
                                                          "rope_theta": 1000000.0}),
                  dict(max_shard_size="40KB")),
    # Phi-3-mini-4k: fused qkv_proj and gate_up_proj, plain rope, sharded
    "phi3": ("Phi3Config", dict(**PHI3_IDS, rope_parameters={"rope_type": "default",
                                                             "rope_theta": 10000.0}),
             dict(max_shard_size="40KB")),
    # Phi-3/3.5-mini-128k: LongRoPE (short and long factors, the attention factor)
    "phi3_longrope": ("Phi3Config", dict(**PHI3_IDS, original_max_position_embeddings=64,
                                         rope_parameters=longrope(8)), {}),
    # Phi-4-mini as its hub folder is written: partial_rotary_factor 0.75 at the top,
    # rope_scaling with LongRoPE, tied embeddings, a sliding window no shorter than the model
    "phi4_mini_old_layout": ("Phi3Config", dict(
        **PHI3_IDS, original_max_position_embeddings=64, tie_word_embeddings=True,
        sliding_window=256, rope_parameters=longrope(6, partial_rotary_factor=0.75)), {}),
    # Qwen2 with a window on the layers from max_window_layers on
    "qwen2_window": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=48,
                                         max_window_layers=1), {}),
    # Mistral with a window shorter than the tests' sequences (160 tokens)
    "mistral_window": ("MistralConfig", dict(sliding_window=48), {}),
    # Gemma 2: sandwich norms (1 + w), GeGLU, scaled embeddings, query_pre_attn_scalar,
    # both soft-caps (low enough to bite), sliding and full layers alternating, tied
    "gemma2": ("Gemma2Config", dict(GEMMA_TOKENS, head_dim=16, query_pre_attn_scalar=24,
                                    sliding_window=40, attn_logit_softcapping=2.0,
                                    final_logit_softcapping=1.5),
               dict(max_shard_size="60KB")),
    "gemma2_old_layout": ("Gemma2Config", dict(GEMMA_TOKENS, head_dim=16, sliding_window=40,
                                               attn_logit_softcapping=2.0), {}),
    # Gemma 3 text: q/k norms per head (1 + w), local (theta 10000) and global (theta 1e6,
    # linear scaling) RoPE, 2 sliding layers then a full one, no soft-caps, sharded
    "gemma3_text": ("Gemma3TextConfig", dict(GEMMA3), dict(max_shard_size="40KB")),
    "gemma3_text_old_layout": ("Gemma3TextConfig", dict(GEMMA3), {}),
    # Gemma 3 4B-27B's form: Gemma3ForConditionalGeneration, the text model above in
    # text_config (its tensors under language_model.) beside a vision tower and projector
    "gemma3": ("Gemma3Config", dict(text_config=dict(SHAPE, **GEMMA3), vision_config=VISION,
                                    mm_tokens_per_image=4, boi_token_index=380,
                                    eoi_token_index=381, image_token_index=382),
               dict(max_shard_size="40KB")),
    # SmolLM3: Llama's blocks, every 4th layer without RoPE (NoPE), tied; sharded
    # (SmolLM3Config's default ids, 128000 and on, lie outside the tiny vocabulary)
    "smollm3": ("SmolLM3Config", dict(SMOLLM3, rope_parameters={"rope_type": "default",
                                                                "rope_theta": 2000000.0}),
                dict(max_shard_size="40KB")),
    # SmolLM3 with a window on its NoPE layers (transformers' default layer_types)
    "smollm3_window": ("SmolLM3Config", dict(SMOLLM3, use_sliding_window=True,
                                             sliding_window=48), {}),
    # Phi-3-mini-4k's window (2047 there) shorter than the tests' sequences (160 tokens)
    "phi3_window": ("Phi3Config", dict(**PHI3_IDS, sliding_window=48,
                                       rope_parameters={"rope_type": "default",
                                                        "rope_theta": 10000.0}), {}),
}  # fmt: skip

# architectures outside the native families (freetx.models.hf_generic), same form; token ids
# inside the tiny vocabulary (some configs' defaults lie outside it)
IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
GENERIC_FAMILIES = {
    # GPT-NeoX (Pythia): fused query_key_value, LayerNorms with biases, parallel residual,
    # partial rotary (rotary_pct 0.25), untied; sharded
    "gpt_neox": ("GPTNeoXConfig", dict(IDS, rotary_pct=0.25), dict(max_shard_size="40KB")),
    # StarCoder2: biases everywhere, LayerNorm, GELU MLP, tied
    "starcoder2": ("Starcoder2Config", dict(IDS, tie_word_embeddings=True, sliding_window=None),
                   {}),
    # Granite: Llama blocks with embedding, residual, attention and logits multipliers
    "granite": ("GraniteConfig", dict(IDS, embedding_multiplier=4.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2, logits_scaling=2.0),
                dict(max_shard_size="40KB")),
    # Phi-2: partial rotary (0.5), parallel attention and MLP, q/k/v/dense with biases
    "phi": ("PhiConfig", IDS, {}),
    # Gemma 1: (1 + weight) RMSNorms, embeddings scaled by sqrt(hidden), tied, GeGLU
    "gemma": ("GemmaConfig", dict(IDS, head_dim=16, tie_word_embeddings=True), {}),
    # GPT-2: Conv1D projections (weights stored transposed), learned positions, tied
    "gpt2": ("GPT2Config", IDS, {}),
}  # fmt: skip


# MoE architectures whose folders transformers converts on load (experts stored one tensor
# each, held stacked), read by the generic path with transformers' own rules; sharded so
# that experts span shards. Routers' biases (DeepSeek-V3's e_score_correction_bias, a
# stored buffer) are nonzero (`make_folder`)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)
CONVERTED_MOE_FAMILIES = {
    # DeepSeek-V3: MLA (q and kv low-rank), sigmoid routing with a bias and grouped top-k
    # (2 groups, 1 kept), a shared expert, layer 0 dense
    "deepseek_v3": ("DeepseekV3Config", dict(IDS, **MOE, n_routed_experts=4, n_shared_experts=1,
                                             first_k_dense_replace=1, n_group=2, topk_group=1,
                                             q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                             qk_nope_head_dim=8, v_head_dim=16),
                    dict(max_shard_size="40KB")),
    # Qwen2-MoE (Qwen1.5-MoE): softmax top-2 of 4 experts, a gated shared expert, qkv biases
    "qwen2_moe": ("Qwen2MoeConfig", dict(IDS, **MOE, num_experts=4,
                                         shared_expert_intermediate_size=48),
                  dict(max_shard_size="40KB")),
    # GLM-4.5: DeepSeek-V3's router (one group), partial rotary, a shared expert, layer 0 dense
    "glm4_moe": ("Glm4MoeConfig", dict(IDS, **MOE, n_routed_experts=4, n_shared_experts=1,
                                       first_k_dense_replace=1, n_group=1, topk_group=1,
                                       head_dim=16), dict(max_shard_size="40KB")),
    # OLMoE: q/k norms over the projections, 4 experts of intermediate_size, top 2
    "olmoe": ("OlmoeConfig", dict(IDS, num_experts=4, num_experts_per_tok=2),
              dict(max_shard_size="40KB")),
}  # fmt: skip

# MoE architectures whose folders already hold the experts fused, as transformers' modules
# do (nothing converted on load)
FUSED_MOE_FAMILIES = {
    # GPT-OSS: experts stored transposed ([E, in, out]) with biases, gate and up interleaved,
    # a clamped SwiGLU; attention sinks, sliding and full layers, YaRN rope
    "gpt_oss": ("GptOssConfig", dict(IDS, num_local_experts=4, num_experts_per_tok=2,
                                     intermediate_size=32, head_dim=16, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"]),
                dict(max_shard_size="40KB")),
}  # fmt: skip

# DeepSeek-V3, V2 and GLM-4.5 as freetx reads them natively, beyond the folders above: queries
# without the low-rank bottleneck (q_proj) and RoPE on halves; YaRN RoPE (its softmax
# scale by mscale_all_dim), biases on q_a/kv_a/o, 8 experts in 4 groups of which 2 are
# kept, top 3
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                 "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.707,
                 "beta_fast": 32, "beta_slow": 1}  # fmt: skip
DEEPSEEK_VARIANTS = {
    "deepseek_v3_q_proj": ("DeepseekV3Config",
                           dict(CONVERTED_MOE_FAMILIES["deepseek_v3"][1], q_lora_rank=None,
                                rope_interleave=False), {}),
    "deepseek_v3_yarn": ("DeepseekV3Config",
                         dict(CONVERTED_MOE_FAMILIES["deepseek_v3"][1], attention_bias=True,
                              rope_parameters=DEEPSEEK_YARN, n_routed_experts=8, n_group=4,
                              topk_group=2, num_experts_per_tok=3), dict(max_shard_size="40KB")),
    # GLM-4.5 with its q/k/v biases (attention_bias, none on o) and 8 experts in 2 groups
    "glm4_moe_biases": ("Glm4MoeConfig",
                        dict(CONVERTED_MOE_FAMILIES["glm4_moe"][1], attention_bias=True,
                             n_routed_experts=8, n_group=2, topk_group=1,
                             routed_scaling_factor=2.5), {}),
    # DeepSeek-V2: softmax routing limited to 2 of 4 groups (group_limited_greedy), scaled
    # by 16, never normed; 2 shared experts; queries without the bottleneck (V2-Lite's)
    "deepseek_v2": ("DeepseekV2Config",
                    dict(IDS, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=2,
                         first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=4,
                         topk_group=2, num_experts_per_tok=3, routed_scaling_factor=16.0,
                         q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16), dict(max_shard_size="40KB")),
}  # fmt: skip

# hybrid models: gated linear attention (Qwen3.5's Gated DeltaNet) or state-space layers
# beside full attention; transformers' DynamicCache holds each layer's kind
QWEN3_5 = dict(IDS, head_dim=16, linear_key_head_dim=16, linear_value_head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
               layer_types=["linear_attention", "full_attention"])  # fmt: skip
HYBRID_FAMILIES = {
    "qwen3_5_text": ("Qwen3_5TextConfig", QWEN3_5, dict(max_shard_size="40KB")),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig",
                         dict(QWEN3_5, **MOE, num_experts=4, shared_expert_intermediate_size=32),
                         dict(max_shard_size="40KB")),
    # no attention layer at all: transformers' cache cannot say how long it is
    "qwen3_5_text_all_linear": ("Qwen3_5TextConfig",
                                dict(QWEN3_5, layer_types=["linear_attention"] * 2), {}),
    # LFM2: short convolutions, layer 1 attention
    "lfm2_conv": ("Lfm2Config", dict(IDS, full_attn_idxs=[1]), {}),
    # Mamba: selective state-space layers only (a cache of its own kind)
    "mamba": ("MambaConfig", dict(IDS, state_size=8, expand=2, conv_kernel=4), {}),
}  # fmt: skip


def to_old_layout(folder: Path) -> None:
    """Rewrite config.json as transformers 4.x wrote it: rope_theta and rope_scaling."""
    path = folder / "config.json"
    hf = json.loads(path.read_text())
    params = hf.pop("rope_parameters")
    if "full_attention" in params:  # Gemma 3: the local base apart, scaling of global layers
        hf["rope_local_base_freq"] = params["sliding_attention"]["rope_theta"]
        hf.pop("use_bidirectional_attention", None)
        params = params["full_attention"]
    if hf["model_type"] in ("gemma2", "gemma3_text"):  # no layer_types: a full layer every n
        types = hf.pop("layer_types")
        hf.pop("_sliding_window_pattern", None)
        hf["sliding_window_pattern"] = types.index("full_attention") + 1
    hf["rope_theta"] = params.pop("rope_theta")
    if params.get("partial_rotary_factor", 1.0) != 1.0:  # Phi-4-mini keeps it at the top
        hf["partial_rotary_factor"] = params["partial_rotary_factor"]
    params.pop("partial_rotary_factor", None)
    if params.get("rope_type", "default") != "default":
        hf["rope_scaling"] = params
    hf["torch_dtype"] = hf.pop("dtype", "float32")
    path.write_text(json.dumps(hf, indent=2))


def make_folder(folder: Path, family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """Write the family's tiny model with `save_pretrained`; returns the folder."""
    import transformers

    moe = {**CONVERTED_MOE_FAMILIES, **FUSED_MOE_FAMILIES, **DEEPSEEK_VARIANTS}
    families = {**FAMILIES, **GENERIC_FAMILIES, **moe, **HYBRID_FAMILIES}
    class_name, fields, options = families[family]
    shape = {} if "text_config" in fields else SHAPE
    config = getattr(transformers, class_name)(**{**shape, **fields})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # biases nonzero and norms not all ones, so that a dropped
        for name, param in model.named_parameters():  # or misplaced one shows
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
            elif "norm" in name:
                param.normal_(1.0, 0.1)
            elif name.endswith(("mlp.gate.weight", "mlp.router.weight")):  # routers that
                param.normal_(0.0, 0.5)  # spread tokens over experts
            elif ".experts." in name and family in moe:  # experts that
                param.normal_(0.0, 0.2)  # matter: a misplaced row shows in the logits
        for name, buffer in model.named_buffers():  # a stored router bias (DeepSeek-V3's)
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.5)
    model.to(dtype).save_pretrained(folder, **options)
    if family.endswith("old_layout"):
        to_old_layout(folder)
    return Path(folder)


# a chat template that renders tools and tool calls as Qwen 2.5's does (Hermes's format),
# with Llama 3's headers
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "You may call these tools:\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    '\n</tools>\nCall one as <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    "<|eot_id|>{% endif %}"
    "{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'tool' %}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% else %}{{ m['content'] | trim }}{% endif %}"
    "{% for c in m['tool_calls'] or [] %}\n<tool_call>\n{{ c['function'] | tojson }}"
    "\n</tool_call>{% endfor %}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{% endif %}"
)


def make_tokenizer(folder: Path, texts: list[str], template: str | None = None) -> None:
    """A byte-level BPE tokenizer trained on `texts` with Llama 3 special tokens and chat
    template (or `template`: TOOLS_TEMPLATE), saved beside the model (`save_pretrained`),
    vocabulary below VOCAB. It names a BOS and adds none to a text (transformers'
    post-processor for a tokenizer object without one), as SmolLM2's."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
        pad_token="<|end_of_text|>",
    )  # fmt: skip
    fast.chat_template = template or (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
        "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
        "{% endif %}"
    )
    fast.save_pretrained(folder)


def hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(ids).logits


def greedy(forward, ids: torch.Tensor, steps: int) -> list[list[int]]:
    """Greedy continuation with a full forward per token (no cache on either side)."""
    for _ in range(steps):
        with torch.no_grad():
            next_ids = forward(ids)[:, -1].argmax(-1, keepdim=True)
        ids = torch.cat([ids, next_ids], 1)
    return ids.tolist()


def spread_weights(folder: Path, into: Path, std: float = 0.5, seed: int = 1) -> Path:
    """A folder's model with its weights (norms aside) redrawn from N(0, std), written
    into `into`: greedy text from large random weights changes token often, where a tiny
    folder's repeats one token."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.normal_(0.0, std)
    model.save_pretrained(into)
    return Path(into)
