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

from benchmarks.shapes import HF_SHAPES
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
