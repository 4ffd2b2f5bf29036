"""`freetx import axolotl` and `freetx import trl`: configs as axolotl's examples and TRL's
docs write them (SFT with LoRA, QLoRA, DPO, GRPO; TRL's as a YAML file and as the trl CLI's
arguments) read as overrides that `freetx validate` accepts on a tiny HF folder; every
other key listed with why; junk is one paragraph."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.conftest import flat, one_paragraph, run_freetx_here
from tests.hf_folders import make_folder, make_tokenizer

# examples/llama-3/lora-1b.yml
AXOLOTL_LORA = """\
base_model: {model}
load_in_8bit: true
load_in_4bit: false
datasets:
  - path: {data}
    type: alpaca
dataset_prepared_path: last_run_prepared
val_set_size: 0.1
output_dir: {out}
adapter: lora
lora_model_dir:
sequence_len: 128
sample_packing: true
eval_sample_packing: true
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
lora_fan_in_fan_out:
lora_target_modules:
  - gate_proj
  - down_proj
  - up_proj
  - q_proj
  - v_proj
  - k_proj
  - o_proj
wandb_project:
wandb_entity:
gradient_accumulation_steps: 2
micro_batch_size: 2
num_epochs: 1
optimizer: adamw_8bit
lr_scheduler: cosine
learning_rate: 0.0002
bf16: auto
tf32: false
gradient_checkpointing: true
resume_from_checkpoint:
logging_steps: 1
flash_attention: true
loss_watchdog_threshold: 5.0
loss_watchdog_patience: 3
warmup_steps: 10
evals_per_epoch: 4
saves_per_epoch: 1
weight_decay: 0.0
special_tokens:
   pad_token: "<|end_of_text|>"
"""

# examples/llama-3/qlora-1b.yml, on a chat_template dataset of sharegpt rows
AXOLOTL_QLORA = """\
base_model: {model}
load_in_8bit: false
load_in_4bit: true
datasets:
  - path: {data}
    type: chat_template
    field_messages: conversations
    message_property_mappings:
      role: from
      content: value
chat_template: llama3
dataset_prepared_path:
val_set_size: 0.0
output_dir: {out}
adapter: qlora
sequence_len: 128
sample_packing: false
lora_r: 32
lora_alpha: 16
lora_dropout: 0.05
lora_target_linear: true
gradient_accumulation_steps: 4
micro_batch_size: 2
max_steps: 40
optimizer: paged_adamw_8bit
lr_scheduler: cosine
cosine_min_lr_ratio: 0.1
learning_rate: 0.0002
bf16: true
gradient_checkpointing: true
warmup_ratio: 0.1
deepspeed: {deepspeed}
"""

# a DPO example (rl: dpo on chatml.intel pairs)
AXOLOTL_DPO = """\
base_model: {model}
load_in_4bit: false
adapter: lora
lora_r: 16
lora_alpha: 32
lora_dropout: 0.0
lora_target_linear: true
rl: dpo
rl_beta: 0.1
datasets:
  - path: {data}
    split: train
    type: chatml.intel
  - path: Intel/orca_dpo_pairs
    type: chatml.intel
sequence_len: 128
micro_batch_size: 2
gradient_accumulation_steps: 4
num_epochs: 1
optimizer: adamw_torch
learning_rate: 5.0e-6
bf16: true
output_dir: {out}
"""

# a GRPO example (rl: grpo with a trl: section; the reward functions are the user's)
AXOLOTL_GRPO = """\
base_model: {model}
rl: grpo
trl:
  beta: 0.001
  max_completion_length: 64
  use_vllm: true
  vllm_server_host: 0.0.0.0
  num_generations: 4
  reward_funcs: ["rewards.think_format_reward", "rewards.accuracy_reward"]
  reward_weights: [1.0, 2.0]
datasets:
  - path: {data}
    type: rewards.gsm8k_transform
adapter: lora
lora_r: 16
lora_alpha: 32
lora_target_linear: true
sequence_len: 256
micro_batch_size: 4
gradient_accumulation_steps: 2
max_steps: 20
learning_rate: 5.3e-6
bf16: true
output_dir: {out}
"""

# TRL's SFTConfig + ModelConfig (the `trl sft --config` file of TRL's docs), LoRA
TRL_SFT = """\
model_name_or_path: {model}
dataset_name: {data}
learning_rate: 2.0e-4
num_train_epochs: 1
packing: true
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
gradient_checkpointing: true
eval_strategy: steps
eval_steps: 100
use_peft: true
lora_r: 32
lora_alpha: 16
lora_target_modules: all-linear
max_length: 128
bf16: true
report_to: wandb
output_dir: {out}
"""

# a QLoRA SFT (load_in_4bit with use_peft)
TRL_QLORA = """\
model_name_or_path: {model}
dataset_name: {data}
torch_dtype: bfloat16
use_peft: true
load_in_4bit: true
lora_r: 16
lora_alpha: 32
lora_dropout: 0.05
max_steps: 40
lr_scheduler_type: cosine
warmup_ratio: 0.05
per_device_train_batch_size: 4
optim: paged_adamw_8bit
output_dir: {out}
"""

TRL_DPO = """\
model_name_or_path: {model}
dataset_name: {data}
beta: 0.1
loss_type: ipo
max_length: 128
max_prompt_length: 64
learning_rate: 5.0e-7
per_device_train_batch_size: 2
gradient_accumulation_steps: 8
max_steps: 30
warmup_ratio: 0.1
lr_scheduler_type: linear
bf16: true
gradient_checkpointing: true
output_dir: {out}
"""

TRL_GRPO = """\
model_name_or_path: {model}
dataset_name: {data}
reward_funcs: [trl.rewards.accuracy_reward, think_format_reward]
learning_rate: 1.0e-6
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
num_generations: 4
max_prompt_length: 64
max_completion_length: 64
temperature: 0.9
beta: 0.04
epsilon: 0.2
epsilon_high: 0.28
loss_type: dr_grpo
scale_rewards: false
use_vllm: true
max_steps: 20
use_peft: true
lora_r: 16
lora_alpha: 32
output_dir: {out}
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("ax") / "Llama-3.2-1B", "llama3_2")
    make_tokenizer(folder, ["a tiny corpus for a tiny tokenizer"] * 4)
    return folder


ROWS = {
    "alpaca": {"instruction": "say hi", "input": "", "output": "hi"},
    "sharegpt": {"conversations": [{"from": "human", "value": "hi"},
                                   {"from": "gpt", "value": "hello"}]},
    "messages": {"messages": [{"role": "user", "content": "hi"},
                              {"role": "assistant", "content": "hello"}]},
    "intel": {"system": "", "question": "hi?", "chosen": "hello", "rejected": "go away"},
    "pairs": {"prompt": "hi?", "chosen": "hello", "rejected": "go away"},
    "prompts": {"prompt": "What is 6 x 7?", "answer": "42", "solution": "\\boxed{42}"},
}  # fmt: skip


def data_file(tmp_path, kind):
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("\n".join(json.dumps(ROWS[kind]) for _ in range(40)))
    return path


def imported(tmp_path, fmt, template, *args, **values):
    config = tmp_path / "old.yaml"
    config.write_text(template.format(out=tmp_path / "run", **values))
    result = run_freetx_here("import", fmt, str(config), *args)
    assert result.returncode == 0, result.stderr
    return result, shlex.split(result.stdout.splitlines()[0])


def validated(result, overrides, *more):
    """The printed recipe and config, validated with the printed overrides (and `more`)."""
    line = next(line for line in result.stdout.splitlines() if "freetx run " in line)
    recipe, config = line.split("freetx run ")[1].split(" <")[0].split(" --config ")
    checked = run_freetx_here("validate", config, "--recipe", recipe, *overrides, *more)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    return recipe, config


def unmapped(result) -> dict[str, str]:
    lines = [line[4:] for line in result.stdout.splitlines() if line.startswith("#   ")]
    return dict(line.split(": ", 1) for line in lines)


# -- axolotl ---------------------------------------------------------------------------
def test_axolotl_lora_example_imports_and_validates(tmp_path, model_folder):
    data = data_file(tmp_path, "alpaca")
    result, overrides = imported(tmp_path, "axolotl", AXOLOTL_LORA, "--world-size", "2",
                                 "--dataset-size", "1000", model=model_folder, data=data)  # fmt: skip
    for expected in (f"model_dir={model_folder}", "peft.method=lora", "peft.rank=16",
                     "peft.alpha=32", "peft.dropout=0.05",
                     "peft.target_modules=[gate_proj,down_proj,up_proj,q_proj,v_proj,k_proj,o_proj]",
                     "dataset=freetx.data.InstructDataset", "dataset.format=alpaca",
                     f"dataset.source={data}", "dataset.seq_len=128", "model.max_seq_len=128",
                     "dataset.packed=true", "dataset.val_fraction=0.1", "batch_size=8",
                     "gradient_accumulation_steps=2", "max_steps=125",
                     "optimizer._component_=torchao.optim.AdamW8bit", "lr_schedule.decay=cosine",
                     "optimizer.lr=0.0002", "distributed.mixed_precision.param_dtype=bfloat16",
                     "distributed.activation_checkpointing=full", "log_every_n_steps=1",
                     "lr_schedule.warmup_steps=10", f"output_dir={tmp_path / 'run'}"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert validated(result, overrides, "--world-size", "2") == (
        "lora_finetune_fsdp2", "llm/llama3_1_8b_lora")  # fmt: skip
    skipped = unmapped(result)
    for key in ("load_in_8bit", "dataset_prepared_path", "flash_attention", "special_tokens",
                "evals_per_epoch", "eval_sample_packing", "tf32", "loss_watchdog_threshold"):  # fmt: skip
        assert key in skipped, (key, skipped)
    assert "NF4 only" in skipped["load_in_8bit"]
    assert "wandb_project" not in skipped and "lora_model_dir" not in skipped  # null: unset


def test_axolotl_qlora_example_reads_chat_columns_and_its_deepspeed_file(tmp_path, model_folder):
    data = data_file(tmp_path, "sharegpt")
    deepspeed = tmp_path / "zero2.json"
    deepspeed.write_text(json.dumps({"zero_optimization": {"stage": 2, "overlap_comm": True},
                                     "train_micro_batch_size_per_gpu": "auto"}))  # fmt: skip
    result, overrides = imported(tmp_path, "axolotl", AXOLOTL_QLORA, "--world-size", "1",
                                 model=model_folder, data=data, deepspeed=deepspeed)  # fmt: skip
    for expected in ("peft.quantize_base=nf4", "peft.target_modules=[all-linear]",
                     "dataset=freetx.data.ChatDataset", "dataset.format=sharegpt",
                     "batch_size=8", "max_steps=40", "lr_schedule.warmup_steps=4",
                     "lr_schedule.min_lr_ratio=0.1", "distributed.strategy=zero2"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert not any(o.startswith("dataset.columns") for o in overrides)  # sharegpt's own
    validated(result, overrides)
    assert "lora_finetune_fsdp2 --config llm/llama3_1_8b_qlora" in result.stdout
    skipped = unmapped(result)
    assert "chat template" in skipped["chat_template"]
    assert "the config's share is kept" in skipped["val_set_size"]
    assert "auto" in skipped["train_micro_batch_size_per_gpu"]  # the DeepSpeed file's
    assert "zero_optimization.overlap_comm" in skipped
    assert "paged_adamw_8bit: freetx pages no optimizer states" in flat(result.stdout)


def test_axolotl_dpo_maps_to_dpo_with_the_pairs_columns(tmp_path, model_folder):
    data = data_file(tmp_path, "intel")
    result, overrides = imported(tmp_path, "axolotl", AXOLOTL_DPO, "--world-size", "1",
                                 model=model_folder, data=data)  # fmt: skip
    for expected in ("loss.beta=0.1", "peft.method=lora", "dataset.columns={prompt: question}",
                     "batch_size=8", "dataset.seq_len=128", "optimizer.lr=5e-06"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert validated(result, overrides) == ("dpo_fsdp2", "llm/llama3_1_8b_dpo_lora")
    skipped = unmapped(result)
    assert "freetx.data.Mixture" in skipped["datasets[1]"]
    assert "num_train_epochs" not in skipped and "num_epochs" in skipped  # the file's name
    assert "--dataset-size" in skipped["num_epochs"]


@pytest.mark.parametrize("rl, loss", [("ipo", "ipo"), ("orpo", "orpo")])
def test_axolotl_ipo_and_orpo_are_the_dpo_recipes_loss_types(tmp_path, model_folder, rl, loss):
    data = data_file(tmp_path, "intel")
    template = AXOLOTL_DPO.replace("rl: dpo", f"rl: {rl}").replace("rl_beta", "orpo_alpha")
    result, overrides = imported(tmp_path, "axolotl", template, model=model_folder, data=data)
    assert f"loss.type={loss}" in overrides
    assert ("loss.beta=0.1" in overrides) == (rl == "orpo")  # orpo_alpha: ORPO's lambda
    validated(result, overrides)


def test_axolotl_grpo_maps_its_trl_section_and_lists_the_reward_functions(tmp_path, model_folder):
    data = data_file(tmp_path, "prompts")
    result, overrides = imported(tmp_path, "axolotl", AXOLOTL_GRPO, "--world-size", "1",
                                 model=model_folder, data=data)  # fmt: skip
    for expected in ("loss.beta=0.001", "generation.max_completion_length=64",
                     "generation.num_generations=4", "batch_size=2",  # 4 x 2 completions / 4
                     "model.max_seq_len=256", "peft.target_modules=[all-linear]"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert validated(result, overrides) == ("grpo_fsdp2", "llm/llama3_1_8b_grpo_lora")
    skipped = unmapped(result)
    assert "no vLLM" in skipped["trl.use_vllm"]
    assert "f(prompt, completion, row)" in skipped["trl.reward_funcs[1]"]
    assert "no vLLM" in skipped["trl.vllm_server_host"]
    assert "Python transform" in skipped["datasets[0].type"]
    assert "batch_size=2 prompts is global" in flat(result.stdout)


def test_axolotl_kto_has_no_recipe_and_says_so(tmp_path, model_folder):
    data = data_file(tmp_path, "pairs")
    template = AXOLOTL_DPO.replace("rl: dpo", "rl: kto")
    result, overrides = imported(tmp_path, "axolotl", template, model=model_folder, data=data)
    assert "freetx run RECIPE --config CFG" in result.stdout
    assert "no KTO recipe" in unmapped(result)["rl"]


def test_axolotl_hub_model_is_printed_and_said_to_be_local_only(tmp_path):
    config = tmp_path / "a.yml"
    config.write_text("base_model: NousResearch/Llama-3.2-1B\nadapter: lora\n"
                      "datasets:\n  - path: teknium/GPT4-LLM-Cleaned\n    type: alpaca\n")  # fmt: skip
    result = run_freetx_here("import", "axolotl", str(config))
    assert result.returncode == 0, result.stderr
    assert "model_dir=NousResearch/Llama-3.2-1B" in result.stdout.splitlines()[0]
    out = flat(result.stdout)
    assert "huggingface-cli download NousResearch/Llama-3.2-1B --local-dir DIR" in out
    assert "teknium/GPT4-LLM-Cleaned is a Hugging Face Hub dataset" in out


# -- TRL -------------------------------------------------------------------------------
def test_trl_sft_lora_file_imports_and_validates(tmp_path, model_folder):
    data = data_file(tmp_path, "messages")
    result, overrides = imported(tmp_path, "trl", TRL_SFT, "--world-size", "4",
                                 "--dataset-size", "6400", model=model_folder, data=data)  # fmt: skip
    for expected in ("peft.method=lora", "peft.rank=32", "peft.alpha=16",
                     "peft.target_modules=[all-linear]", "dataset.packed=true",
                     "batch_size=64", "max_steps=100", "dataset.seq_len=128",
                     "eval.every_n_steps=100", "optimizer.lr=0.0002"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert validated(result, overrides, "--world-size", "4") == (
        "lora_finetune_fsdp2", "llm/llama3_1_8b_lora")  # fmt: skip
    assert "trainer sft: an SFT config" in flat(result.stdout)
    skipped = unmapped(result)
    assert "metric_loggers" in skipped["report_to"] and "eval_strategy" in skipped


def test_trl_qlora_file_imports_and_validates(tmp_path, model_folder):
    data = data_file(tmp_path, "messages")
    result, overrides = imported(tmp_path, "trl", TRL_QLORA, model=model_folder, data=data)
    for expected in ("peft.quantize_base=nf4", "peft.dropout=0.05", "max_steps=40",
                     "lr_schedule.warmup_steps=2", "lr_schedule.decay=cosine",
                     "optimizer._component_=torchao.optim.AdamW8bit"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert validated(result, overrides)[1] == "llm/llama3_1_8b_qlora"
    skipped = unmapped(result)
    assert "param_dtype" in skipped["torch_dtype"]
    assert "--world-size N" in skipped["per_device_train_batch_size"]


def test_trl_dpo_file_is_told_by_its_keys_and_validates(tmp_path, model_folder):
    data = data_file(tmp_path, "pairs")
    result, overrides = imported(tmp_path, "trl", TRL_DPO, "--world-size", "1",
                                 model=model_folder, data=data)  # fmt: skip
    for expected in ("loss.beta=0.1", "loss.type=ipo", "dataset.seq_len=128",
                     "dataset.max_prompt_len=64", "batch_size=16", "max_steps=30",
                     "lr_schedule.warmup_steps=3", "lr_schedule.decay=linear",
                     "lr_schedule.min_lr_ratio=0.0"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert not any(o.startswith("peft.") for o in overrides)
    assert validated(result, overrides) == ("dpo_fsdp2", "llm/qwen3_8b_dpo")
    assert "trainer dpo: a DPO config: it has beta, max_prompt_length, loss_type" in flat(
        result.stdout)  # fmt: skip


def test_trl_grpo_file_maps_builtin_rewards_and_counts_prompts(tmp_path, model_folder):
    data = data_file(tmp_path, "prompts")
    result, overrides = imported(tmp_path, "trl", TRL_GRPO, "--world-size", "2",
                                 model=model_folder, data=data)  # fmt: skip
    for expected in ("batch_size=8", "generation.num_generations=4", "generation.temperature=0.9",
                     "loss.aggregation=fixed", "loss.scale_rewards=none", "loss.epsilon_low=0.2",
                     "loss.epsilon_high=0.28", "dataset.max_prompt_len=64"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    rewards = next(o for o in overrides if o.startswith("rewards="))
    assert "freetx.objectives.ExactMatch" in rewards and "answer_field: solution" in rewards
    assert "freetx.objectives.RegexFormat" in rewards
    assert validated(result, overrides, "--world-size", "2")[0] == "grpo_fsdp2"
    assert "use_vllm" in unmapped(result)


def test_trl_cli_arguments_with_the_trainer_first(tmp_path, model_folder):
    data = data_file(tmp_path, "pairs")
    config = tmp_path / "dpo.yaml"
    config.write_text(TRL_DPO.format(model=model_folder, data=data, out=tmp_path / "run"))
    result = run_freetx_here("import", "trl", "dpo", "--config", str(config),
                             "--learning_rate", "1e-6", "--loss_type=sigmoid", "--bf16", "false",
                             "--gradient_checkpointing", "--lora_target_modules", "q_proj",
                             "v_proj", "--use_peft", "--world-size", "2")  # fmt: skip
    assert result.returncode == 0, result.stderr
    overrides = shlex.split(result.stdout.splitlines()[0])
    for expected in ("optimizer.lr=1e-06", "loss.type=sigmoid", "batch_size=32",
                     "peft.target_modules=[q_proj,v_proj]",
                     "distributed.activation_checkpointing=full"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert not any("param_dtype" in o for o in overrides)  # --bf16 false
    assert validated(result, overrides, "--world-size", "2") == (
        "dpo_fsdp2", "llm/llama3_1_8b_dpo_lora")  # fmt: skip


def test_trl_cli_sft_without_a_file(model_folder):
    result = run_freetx_here("import", "trl", "sft", "--model_name_or_path", str(model_folder),
                             "--max_steps", "10", "--per_device_train_batch_size", "4")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "max_steps=10" in result.stdout.splitlines()[0]
    assert "freetx run full_finetune_fsdp2 --config llm/llama3_2_1b_full" in result.stdout


# -- junk: one paragraph, nothing printed ----------------------------------------------
BAD = {
    "not_yaml": ("axolotl", "base_model: [unclosed\n", "not valid YAML"),
    "a_list": ("trl", "- learning_rate: 1\n", "not a mapping"),
    "axolotl_unknown_rl": ("axolotl", "rl: ppo\n", "one of dpo, ipo"),
    "axolotl_rl_list": ("axolotl", "rl: [dpo]\n", "one of dpo, ipo"),
    "trl_grpo_scale_rewards_list": ("trl", "num_generations: 2\nscale_rewards: [1]\n",
                                    "true, false, group"),
    "axolotl_lr_text": ("axolotl", "learning_rate: fast\n", "learning_rate is 'fast'"),
    "axolotl_datasets_text": ("axolotl", "datasets: data.jsonl\n", "a list of datasets"),
    "axolotl_lora_r_list": ("axolotl", "adapter: lora\nlora_r: [8]\n", "whole number"),
    "trl_kto_file": ("trl", "desirable_weight: 1.0\n", "no KTO recipe"),
    "trl_batch_negative": ("trl", "per_device_train_batch_size: -2\n", "from 1"),
    "trl_grpo_indivisible": ("trl", "num_generations: 3\nper_device_train_batch_size: 4\n",
                             "num_generations=3 divides"),
    "trl_packing_text": ("trl", "packing: maybe\n", "true or false"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD))
def test_junk_is_one_paragraph(tmp_path, case):
    fmt, content, message = BAD[case]
    path = tmp_path / "c.yaml"
    path.write_text(content)
    result = run_freetx_here("import", fmt, str(path), "--world-size", "1")
    assert message in one_paragraph(result), result.stderr
    assert result.stdout == ""


def test_a_number_for_a_key_is_listed_not_a_traceback(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("1: 2\nrl: dpo\nbase_model: m\n")
    result = run_freetx_here("import", "axolotl", str(path))
    assert result.returncode == 0 and "#   1: not an axolotl key" in result.stdout, result.stderr


def test_unknown_trl_trainer_on_the_command_line_is_one_paragraph():
    result = run_freetx_here("import", "trl", "kto", "--model_name_or_path", "m")
    assert "no KTO recipe" in one_paragraph(result) and result.stdout == ""
    result = run_freetx_here("import", "trl", "ppo", "--model_name_or_path", "m")
    assert "unrecognized arguments" in one_paragraph(result, 2)
    result = run_freetx_here("import", "trl", "sft", "model_name_or_path", "m")
    assert "where a --name of the trl CLI goes" in one_paragraph(result)
