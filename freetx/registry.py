"""The built-in recipes and their configs: names -> files.

Recipes live in the repository's `recipes/` folder and configs in
`recipe_configs/`; the wheel carries both as `freetx.recipes` and
`freetx.recipe_configs`. This module imports nothing heavy, so that
`freetx ls` and `freetx cp` answer at once.
"""

from __future__ import annotations

import difflib
import importlib.util
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Recipe:
    """A built-in recipe: its name, file, configs, and whether it runs distributed."""

    name: str
    file: str
    configs: tuple[str, ...]
    supports_distributed: bool = True
    description: str = ""
    trains_adapters: bool = False  # a config with no `peft:` method is refused (a full fine-tune)


RECIPES: tuple[Recipe, ...] = (
    Recipe(
        name="full_finetune_fsdp2",
        file="full_finetune_fsdp2.py",
        configs=(
            "llm/tiny",
            "llm/small",
            "llm/instruct_tiny",
            "llm/mixture_tiny",
            "llm/tiny_tp",
            "llm/tiny_cp",
            "llm/tiny_pp",
            "llm/llama3_1b",
            "llm/llama3_8b",
            "llm/hf_tiny_full",
            "llm/calculator_sft_tiny",
            "llm/games_sft_tiny",
            "llm/tiny_llama_bench",
            "llm/llama3_2_1b_full",
            "llm/llama3_1_8b_full",
            "llm/llama3_1_8b_full_1gpu",
            "llm/llama3_1_8b_128k",
            "llm/llama3_70b_full",
            "llm/qwen2_5_7b_full",
            "llm/qwen3_8b_full",
            "llm/qwen3_30b_a3b_full",
            "llm/moe_tiny_ep",
            "llm/gemma2_2b_full",
            "free_transformer/tiny",
            "free_transformer/baseline_tiny",
            "free_transformer/text_tiny",
            "free_transformer/1_5b",
            "free_transformer/8b",
        ),
        description="decoder LMs and the Free Transformer: pretrain or fine-tune, any strategy",
    ),
    Recipe(
        name="lora_finetune_fsdp2",
        file="full_finetune_fsdp2.py",  # one loop: the `peft:` section picks what trains
        trains_adapters=True,
        configs=(
            "llm/lora_tiny",
            "llm/dora_tiny",
            "llm/qlora_tiny",
            "llm/hf_tiny_lora",
            "llm/spectrum_tiny",
            "llm/llama3_1_8b_lora",
            "llm/llama3_1_8b_lora_24gb",
            "llm/llama3_70b_lora",
            "llm/llama3_1_8b_qlora",
            "llm/phi4_mini_lora",
            "llm/qwen3_30b_a3b_lora",
            "llm/moe_lora_tiny",
            "llm/mixtral_8x7b_qlora",
            "llm/gpt_oss_20b_lora",
            "llm/deepseek_v2_lite_lora",
            "llm/qwen3_5_lora",
            "llm/gemma3_4b_lora",
        ),
        description="LoRA / QLoRA / DoRA / Spectrum fine-tuning (full_finetune_fsdp2's loop)",
    ),
    Recipe(
        name="rm_fsdp2",
        file="rm_fsdp2.py",
        configs=("llm/rm_tiny", "llm/hf_tiny_rm", "llm/qwen3_8b_rm"),
        description="reward models: a decoder with a scalar head trained on preference "
        "pairs (Bradley-Terry), exported as transformers' sequence classifier",
    ),
    Recipe(
        name="dpo_fsdp2",
        file="dpo_fsdp2.py",
        configs=(
            "llm/dpo_tiny",
            "llm/dpo_lora_tiny",
            "llm/kto_tiny",
            "llm/hf_tiny_dpo",
            "llm/hf_tiny_kto",
            "llm/llama3_1_8b_dpo_lora",
            "llm/qwen3_8b_dpo",
            "llm/gemma3_4b_dpo_lora",
            "llm/qwen3_8b_kto",
        ),
        description="preference optimization: DPO, IPO, robust DPO, hinge, SimPO, ORPO, KTO; "
        "full or LoRA / QLoRA / DoRA",
    ),
    Recipe(
        name="grpo_fsdp2",
        file="grpo_fsdp2.py",
        configs=(
            "llm/grpo_tiny",
            "llm/grpo_lora_tiny",
            "llm/rloo_tiny",
            "llm/reinforce_pp_tiny",
            "llm/grpo_rm_tiny",
            "llm/calculator_grpo_tiny",
            "llm/guess_grpo_tiny",
            "llm/darkroom_text_grpo_tiny",
            "llm/hf_tiny_grpo",
            "llm/llama3_1_8b_grpo_lora",
            "llm/qwen3_8b_grpo",
            "llm/qwen3_8b_reinforce_pp",
        ),
        description="online RL with verifiable rewards: GRPO, Dr. GRPO, DAPO, GSPO, the "
        "policy generating its rollouts; full or LoRA / QLoRA / DoRA",
    ),
    Recipe(
        name="kd_fsdp2",
        file="kd_fsdp2.py",
        configs=(
            "llm/kd_tiny",
            "llm/hf_tiny_kd",
            "llm/on_policy_kd_tiny",
            "llm/hf_tiny_on_policy_kd",
            "llm/qwen3_1_7b_on_policy_kd",
        ),
        description="knowledge distillation: a student learns a frozen teacher's "
        "distribution (forward / reverse KL, JSD) on the data or on its own samples "
        "(on-policy, GKD) and the labels; full or LoRA",
    ),
    Recipe(
        name="ad_ddp",
        file="ad_ddp.py",
        configs=("ad/darkroom_tiny", "ad/darkroom", "ad/darkroom_ed", "ad/darkroom_compressed"),
        description="Algorithm Distillation on Dark Room, DDP, in-context evaluation",
    ),
    Recipe(
        name="crosscoder_fsdp2",
        file="crosscoder_fsdp2.py",
        configs=(
            "crosscoder/synthetic_tiny",
            "crosscoder/lm_layers_tiny",
            "crosscoder/diff_tiny",
            "crosscoder/gpt2_layers",
            "crosscoder/gemma2_2b_diff",
        ),
        description="sparse crosscoders over model activations (cross-layer, model diffing), FSDP2",
    ),
    Recipe(
        name="eval",
        file="eval.py",
        configs=("llm/hf_eval",),
        description="evaluate a checkpoint: lm-evaluation-harness tasks, perplexity over a "
        "dataset, rewards over generations",
    ),
    Recipe(
        name="generate",
        file="generate.py",
        configs=("free_transformer/generate", "llm/hf_generate"),
        supports_distributed=False,
        description="sample from a trained decoder or Free Transformer (Z kept per position)",
    ),
)


# where the wheel's packages come from in a source checkout (pyproject.toml's package-dir)
CHECKOUT_DIRS = {"freetx.recipes": "recipes", "freetx.recipe_configs": "recipe_configs"}


def _package_dir(package: str) -> Path:
    """An installed package's folder; in a source checkout on PYTHONPATH (not installed,
    as on a machine that cannot install), the folder the wheel maps it from."""
    spec = importlib.util.find_spec(package)
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0])
    checkout = Path(__file__).resolve().parents[1]
    project = checkout / "pyproject.toml"
    if project.is_file() and 'name = "freetx"' in project.read_text():  # freetx's own checkout
        return checkout / CHECKOUT_DIRS[package]
    raise RuntimeError(f"freetx is installed without {package}; reinstall it")


def recipes_dir() -> Path:
    """The folder holding the built-in recipe files."""
    return _package_dir("freetx.recipes")


def configs_dir() -> Path:
    """The folder holding the built-in configs (one subfolder per model family)."""
    return _package_dir("freetx.recipe_configs")


def get_recipe(name: str) -> Recipe | None:
    """The built-in recipe called `name`, or None."""
    return next((r for r in RECIPES if r.name == name), None)


def recipe_file(recipe: Recipe) -> Path:
    return recipes_dir() / recipe.file


def config_names() -> list[str]:
    """Every built-in config name, e.g. `llm/tiny`."""
    return [c for r in RECIPES for c in r.configs]


def config_file(name: str) -> Path | None:
    """The YAML file of the built-in config `name` (with or without .yaml), or None."""
    name = name.removesuffix(".yaml")
    if name not in config_names():
        return None
    return configs_dir() / f"{name}.yaml"


def recipe_for_config(name: str) -> Recipe | None:
    """The built-in recipe that a built-in config belongs to."""
    name = name.removesuffix(".yaml")
    return next((r for r in RECIPES if name in r.configs), None)


def recipe_guessed_for(keys: set[str]) -> Recipe | None:
    """The built-in recipe whose configs use the top-level `keys` of a config file most
    alike (every key among theirs, fewest others), or None: for a hint naming whose
    config a file is."""
    import yaml

    best, score = None, None
    for recipe in RECIPES:
        known: set[str] = set()
        for name in recipe.configs:
            try:
                data = yaml.safe_load((configs_dir() / f"{name}.yaml").read_text())
            except (OSError, yaml.YAMLError):
                continue
            known |= set(data) if isinstance(data, dict) else set()
        if keys and keys <= known and (score is None or len(known - keys) < score):
            best, score = recipe, len(known - keys)
    return best


def closest(name: str, candidates: list[str]) -> str | None:
    """The candidate closest to `name`, for 'did you mean' hints."""
    matches = difflib.get_close_matches(name, candidates, n=1, cutoff=0.6)
    return matches[0] if matches else None
