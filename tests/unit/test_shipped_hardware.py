"""Every shipped config names its hardware in its header, and fits it by `freetx estimate`.

The grammar (docs/configs.md): a header line `# hardware: N x H100 80GB` (or A100), or
`# hardware: N CPU process(es)`. For each training config (every recipe's but
generate's), the analytic estimate of its own strategy at N ranks of that device must
leave 10% of the device's memory free (the allocator's caching and fragmentation).
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import torch
from safetensors.torch import save_file

from freetx.cli.common import load_recipe
from freetx.config.run_config import load_recipe_config
from freetx.planning.config import estimate_config, meta_model
from freetx.planning.estimate import DEVICES, GIB
from freetx.registry import recipe_for_config
from tests.conftest import REPO, flat, run_freetx_here

CONFIGS = sorted(
    str(path.relative_to(REPO / "recipe_configs").with_suffix(""))
    for path in (REPO / "recipe_configs").glob("*/*.yaml")
)
# the GPUs a header names -> the estimate's device
GPUS = {"H100 80GB": "h100", "A100 80GB": "a100", "RTX 4090 24GB": "rtx4090"}
HARDWARE = re.compile(rf"^# hardware: (\d+) (?:x ({'|'.join(GPUS)})|CPU process(?:es)?)$", re.M)
ESTIMATED = {
    "full_finetune_fsdp2",
    "lora_finetune_fsdp2",
    "ad_ddp",
    "crosscoder_fsdp2",
    "dpo_fsdp2",
    "grpo_fsdp2",
    "rm_fsdp2",
    "kd_fsdp2",  # the student (the teacher is not counted: docs/recipes/kd_fsdp2.md)
}
NOT_ESTIMATED = {"generate", "eval"}  # no training
HEADROOM = 0.9
# tiny CPU configs whose model is a file another command makes first
MADE_FIRST = {"llm/hf_tiny_full": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_lora": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_dpo": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_kto": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_rm": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_grpo": "a tiny HF folder (tests write one)",
              "llm/hf_tiny_kd": "two tiny HF folders (tests write them)",
              "llm/hf_tiny_on_policy_kd": "two tiny HF folders (tests write them)",
              "llm/grpo_rm_tiny": "llm/rm_tiny's run (its reward model's weights)",
              "llm/spectrum_tiny": "`freetx spectrum scan`'s selection of runs/llm_tiny"}  # fmt: skip
# the shapes of the HF models the fine-tuning configs name (their config.json's, public),
# for the configs that read the shape from `model_dir`
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
MODEL_OF = {"llm/llama3_1_8b_full": "Llama-3.1-8B", "llm/llama3_1_8b_lora": "Llama-3.1-8B",
            "llm/llama3_1_8b_full_1gpu": "Llama-3.1-8B", "llm/llama3_1_8b_lora_24gb": "Llama-3.1-8B",
            "llm/llama3_1_8b_128k": "Llama-3.1-8B", "llm/llama3_70b_full": "Llama-3.1-70B",
            "llm/llama3_70b_lora": "Llama-3.1-70B",
            "llm/llama3_1_8b_qlora": "Llama-3.1-8B", "llm/llama3_2_1b_full": "Llama-3.2-1B",
            "llm/qwen2_5_7b_full": "Qwen2.5-7B", "llm/qwen3_8b_full": "Qwen3-8B",
            "llm/phi4_mini_lora": "Phi-4-mini", "llm/qwen3_30b_a3b_lora": "Qwen3-30B-A3B",
            "llm/qwen3_30b_a3b_full": "Qwen3-30B-A3B",
            "llm/mixtral_8x7b_qlora": "Mixtral-8x7B", "llm/gemma2_2b_full": "gemma-2-2b",
            "llm/gemma3_4b_lora": "gemma-3-4b", "llm/llama3_1_8b_dpo_lora": "Llama-3.1-8B",
            "llm/qwen3_8b_dpo": "Qwen3-8B", "llm/gemma3_4b_dpo_lora": "gemma-3-4b",
            "llm/qwen3_8b_grpo": "Qwen3-8B", "llm/llama3_1_8b_grpo_lora": "Llama-3.1-8B",
            "llm/qwen3_8b_reinforce_pp": "Qwen3-8B", "llm/qwen3_8b_kto": "Qwen3-8B",
            "llm/qwen3_8b_rm": "Qwen3-8B", "llm/qwen3_1_7b_on_policy_kd": "Qwen3-1.7B",
            "llm/gpt_oss_20b_lora": "gpt-oss-20b", "llm/deepseek_v2_lite_lora": "DeepSeek-V2-Lite",
            "llm/qwen3_5_lora": "Qwen3.5-27B"}  # fmt: skip
# distillation configs -> their teacher's HF model (`teacher_dir`; not counted, but read)
TEACHER_OF = {"llm/qwen3_1_7b_on_policy_kd": "Qwen3-8B"}
# crosscoder configs -> the HF source model of each of their sources (local folders a user has)
SOURCES_OF = {"crosscoder/gemma2_2b_diff": ["gemma-2-2b", "gemma-2-2b"],
              "crosscoder/gpt2_layers": ["gpt2"]}  # fmt: skip
# tiny crosscoders whose sources are runs made first from llm/tiny: a freetx model file that
# records llm/tiny's model (as a checkpoint does, no real weights) stands in for each
FROM_LLM_TINY = {"crosscoder/diff_tiny", "crosscoder/lm_layers_tiny"}


def llm_tiny_model_file(folder) -> str:
    """A .safetensors file recording llm/tiny's model class and config, as freetx writes them."""
    tiny = load_recipe_config("llm/tiny", [], load_recipe("full_finetune_fsdp2").schema)
    model = meta_model(tiny.model)
    path = folder / "llm_tiny.safetensors"
    save_file({"unused": torch.zeros(1)}, str(path), metadata={
        "freetx_model_class": f"{type(model).__module__}.{type(model).__qualname__}",
        "freetx_model_config": json.dumps(dataclasses.asdict(model.config))})  # fmt: skip
    return str(path)


def hardware(config: str) -> tuple[int, str]:
    """(processes, the estimate's device name) from a config's `# hardware:` line."""
    text = (REPO / "recipe_configs" / f"{config}.yaml").read_text()
    header = text.split("\n\n")[0]
    found = HARDWARE.findall(header)
    assert len(found) == 1, f"{config}: one '# hardware:' line in the header, as docs/configs.md"
    count, gpu = found[0]
    return int(count), GPUS.get(gpu, "cpu")


def test_every_config_names_its_hardware_and_a_known_recipe():
    assert len(CONFIGS) > 20
    for config in CONFIGS:
        hardware(config)
        assert recipe_for_config(config).name in ESTIMATED | NOT_ESTIMATED, config


@pytest.mark.parametrize("config", CONFIGS)
def test_each_training_config_fits_its_hardware(config, tmp_path):
    recipe = recipe_for_config(config).name
    if recipe not in ESTIMATED:
        pytest.skip(f"{recipe}: trains nothing")
    if config in MADE_FIRST:
        pytest.skip(f"its model is {MADE_FIRST[config]}")
    world_size, device = hardware(config)
    overrides = []
    if config in MODEL_OF:
        (tmp_path / "config.json").write_text(json.dumps(HF_SHAPES[MODEL_OF[config]]))
        overrides.append(f"model_dir={tmp_path}")
    if config in TEACHER_OF:
        (tmp_path / "teacher").mkdir()
        (tmp_path / "teacher" / "config.json").write_text(json.dumps(HF_SHAPES[TEACHER_OF[config]]))
        overrides.append(f"teacher_dir={tmp_path / 'teacher'}")
    for i, name in enumerate(SOURCES_OF.get(config, [])):
        (tmp_path / f"source{i}").mkdir()
        (tmp_path / f"source{i}" / "config.json").write_text(json.dumps(HF_SHAPES[name]))
        overrides.append(f"activations.sources.{i}.model={tmp_path / f'source{i}'}")
    if config in FROM_LLM_TINY:
        model_file = llm_tiny_model_file(tmp_path)
        schema = load_recipe(recipe).schema
        sources = load_recipe_config(config, [], schema).activations.sources
        overrides += [f"activations.sources.{i}.model={model_file}" for i in range(len(sources))]
    cfg = load_recipe_config(config, overrides, load_recipe(recipe).schema)
    found = estimate_config(cfg, world_size, device)
    if config in SOURCES_OF or config in FROM_LLM_TINY:  # every source model read and counted
        assert found.sources.unread == [] and found.sources.weights > 0, config
    row = next(r for r in found.rows if r.strategy == cfg.distributed.strategy)
    limit = DEVICES[device][2] * HEADROOM
    assert row.peak / GIB < limit, (
        f"{config}: {row.peak / GIB:.1f} GiB per rank on {world_size} x {device}, over "
        f"{limit:.0f} GiB"
    )


def test_the_cli_says_it_fits():
    result = run_freetx_here("estimate", "free_transformer/8b", "--world-size", "8")
    assert result.returncode == 0, result.stderr
    fsdp = next(line for line in result.stdout.splitlines() if line.startswith("fsdp "))
    assert fsdp.split()[-3] == "yes", flat(result.stdout)
