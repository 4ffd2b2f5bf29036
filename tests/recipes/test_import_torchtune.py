"""`freetx import torchtune`: torchtune's own recipe configs (the shapes of llama3_2/1B's
full_finetune_distributed and lora_finetune_distributed) read as freetx overrides that
`freetx validate` accepts on a tiny HF folder; every other key listed with why."""

from __future__ import annotations

import json
import shlex

import pytest

from tests.conftest import flat, run_freetx_here
from tests.hf_folders import make_folder, make_tokenizer

FULL = """\
output_dir: {out}
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {model}/original/tokenizer.model
  max_seq_len: 128
dataset:
  _component_: torchtune.datasets.alpaca_dataset
  source: json
  data_files: {data}
  packed: False
seed: null
shuffle: True
model:
  _component_: torchtune.models.llama3_2.llama3_2_1b
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {model}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3_2
resume_from_checkpoint: False
batch_size: 4
epochs: 2
optimizer:
  _component_: torch.optim.AdamW
  lr: 2e-5
  fused: True
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
max_steps_per_epoch: null
clip_grad_norm: null
compile: False
optimizer_in_bwd: False
gradient_accumulation_steps: 2
device: cpu
enable_activation_checkpointing: True
enable_activation_offloading: False
custom_sharded_layers: ['tok_embeddings', 'output']
dtype: fp32
metric_logger:
  _component_: torchtune.training.metric_logging.DiskLogger
  log_dir: ${{output_dir}}/logs
log_every_n_steps: 1
log_peak_memory_stats: True
"""

LORA = """\
output_dir: {out}
model:
  _component_: torchtune.models.llama3_2.lora_llama3_2_1b
  lora_attn_modules: ['q_proj', 'v_proj', 'output_proj']
  apply_lora_to_mlp: True
  lora_rank: 64
  lora_alpha: 128
  lora_dropout: 0.0
tokenizer:
  _component_: torchtune.models.llama3.llama3_tokenizer
  path: {model}/original/tokenizer.model
  max_seq_len: 128
checkpointer:
  _component_: torchtune.training.FullModelHFCheckpointer
  checkpoint_dir: {model}
  checkpoint_files: [model.safetensors]
  recipe_checkpoint: null
  output_dir: ${{output_dir}}
  model_type: LLAMA3_2
resume_from_checkpoint: False
save_adapter_weights_only: False
dataset:
  _component_: torchtune.datasets.chat_dataset
  source: json
  data_files: {data}
  conversation_column: conversations
  conversation_style: sharegpt
  split: train
seed: 42
shuffle: True
batch_size: 4
optimizer:
  _component_: torch.optim.AdamW
  fused: True
  weight_decay: 0.01
  lr: 3e-4
lr_scheduler:
  _component_: torchtune.training.lr_schedulers.get_cosine_schedule_with_warmup
  num_warmup_steps: 100
loss:
  _component_: torchtune.modules.loss.CEWithChunkedOutputLoss
epochs: 1
max_steps_per_epoch: 50
gradient_accumulation_steps: 8
clip_grad_norm: 1.0
compile: False
device: cpu
enable_activation_checkpointing: False
dtype: bf16
"""


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    folder = make_folder(tmp_path_factory.mktemp("tt") / "Llama-3.2-1B-Instruct", "llama3_2")
    make_tokenizer(folder, ["a tiny corpus for a tiny tokenizer"] * 4)
    return folder


def imported(tmp_path, template, model_folder, data, *args):
    config = tmp_path / "tt.yaml"
    config.write_text(template.format(out=tmp_path / "run", model=model_folder, data=data))
    result = run_freetx_here("import", "torchtune", str(config), *args)
    assert result.returncode == 0, result.stderr
    return result, shlex.split(result.stdout.splitlines()[0])


def test_torchtune_full_finetune_config_imports_and_validates(tmp_path, model_folder):
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps([{"instruction": "say hi", "input": "", "output": "hi"}] * 40))
    result, overrides = imported(tmp_path, FULL, model_folder, data, "--world-size", "2",
                                 "--dataset-size", "1000")  # fmt: skip
    for expected in (f"model_dir={model_folder}", "dataset=freetx.data.InstructDataset",
                     "dataset.format=alpaca", f"dataset.source={data}", "dataset.seq_len=128",
                     "batch_size=16", "gradient_accumulation_steps=2", "max_steps=124",
                     "optimizer.lr=2e-05", "max_grad_norm=null", "device=cpu",
                     "distributed.activation_checkpointing=full",
                     "distributed.mixed_precision.param_dtype=float32",
                     f"output_dir={tmp_path / 'run'}"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert "full_finetune_fsdp2 --config llm/llama3_2_1b_full" in result.stdout
    out = flat(result.stdout)
    assert "max_steps=124: 2 epoch(s) x 62 steps (1000 samples // batch_size 16)" in out
    assert "optimizer.in_backward=false" in overrides
    assert "distributed.activation_offloading=false" in overrides
    for key in ("custom_sharded_layers", "checkpointer.model_type",
                "metric_logger", "shuffle", "optimizer.fused"):  # fmt: skip
        assert f"#   {key}: " in result.stdout, key
    checked = run_freetx_here("validate", "llm/hf_tiny_full", "--world-size", "2", *overrides)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_torchtune_lora_config_imports_to_the_peft_section_and_validates(tmp_path, model_folder):
    data = tmp_path / "chat.jsonl"
    row = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    data.write_text("\n".join(json.dumps(row) for _ in range(40)))
    result, overrides = imported(tmp_path, LORA, model_folder, data, "--world-size", "1")
    for expected in ("peft.method=lora", "peft.target_modules=[q,v,o,gate,up,down]",
                     "peft.rank=64", "peft.alpha=128", "peft.dropout=0.0",
                     "dataset=freetx.data.ChatDataset", "dataset.format=sharegpt",
                     "batch_size=32", "gradient_accumulation_steps=8", "max_steps=50",
                     "lr_schedule.warmup_steps=100", "lr_schedule.decay=cosine",
                     "lr_schedule.min_lr_ratio=0.0", "optimizer.weight_decay=0.01",
                     "seed=42", "max_grad_norm=1.0"):  # fmt: skip
        assert expected in overrides, (expected, overrides)
    assert "lora_finetune_fsdp2 --config llm/llama3_1_8b_lora" in result.stdout
    assert "#   dataset.conversation_column: " in result.stdout
    # the tiny folder on CPU: the 8B config's CUDA and bf16 swapped for it
    tiny = [o for o in overrides if not o.startswith(("distributed.mixed_precision", "device"))]
    checked = run_freetx_here("validate", "llm/hf_tiny_lora", *tiny)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_torchtune_epochs_without_dataset_size_says_what_is_needed(tmp_path, model_folder):
    result, overrides = imported(tmp_path, FULL, model_folder, tmp_path / "a.json")
    assert not any(o.startswith("max_steps=") for o in overrides)
    out = flat(result.stdout)
    assert "epochs: 2 epoch(s): freetx counts optimizer steps; give --dataset-size N" in out
    assert "and --world-size N" in out
