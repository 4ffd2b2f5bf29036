"""`freetx import`'s mapping (freetx/planning/config_import.py and each format's importer):
each foreign key, read from small files written here, to the freetx override it means or
to the unmapped list."""

from __future__ import annotations

import json

import pytest
import yaml

from freetx.errors import FreetxError
from freetx.planning.config_import import import_config, read_config_file

BF16 = {  # what bf16 means: bfloat16 compute, float32 gradient reduction
    "distributed.mixed_precision.param_dtype": "bfloat16",
    "distributed.mixed_precision.reduce_dtype": "float32",
}


def imported(tmp_path, kind, data, world_size=None, suffix=".json"):
    path = tmp_path / f"old{suffix}"
    path.write_text(json.dumps(data) if suffix == ".json" else yaml.safe_dump(data))
    return import_config(kind, read_config_file(str(path)), world_size)


@pytest.mark.parametrize("stage, strategy", [(0, "ddp"), (1, "zero1"), (2, "zero2"), (3, "fsdp")])
def test_zero_stage_to_strategy(tmp_path, stage, strategy):
    found = imported(tmp_path, "deepspeed", {"zero_optimization": {"stage": stage}})
    assert found.overrides == {"distributed.strategy": strategy}


def test_deepspeed_batch_is_multiplied_out_to_freetx_global_batch(tmp_path):
    data = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 16}
    found = imported(tmp_path, "deepspeed", data, world_size=8)
    assert found.overrides == {"gradient_accumulation_steps": 16, "batch_size": 4 * 16 * 8}
    without = imported(tmp_path, "deepspeed", data)
    assert "batch_size" not in without.overrides
    assert [k for k, _ in without.unmapped] == ["train_micro_batch_size_per_gpu"]
    assert "--world-size" in without.unmapped[0][1]
    total = imported(tmp_path, "deepspeed", {"train_batch_size": 512, **data}, world_size=8)
    assert total.overrides["batch_size"] == 512  # already global


def test_deepspeed_auto_values_are_listed_not_guessed(tmp_path):
    data = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "train_batch_size": "auto"}  # fmt: skip
    found = imported(tmp_path, "deepspeed", data, world_size=8)
    assert found.overrides == {}
    assert {k for k, _ in found.unmapped} == set(data)
    assert all(why.startswith("auto:") for _, why in found.unmapped)


def test_deepspeed_precision_clipping_offload_optimizer_scheduler(tmp_path):
    data = {
        "bf16": {"enabled": True},
        "gradient_clipping": 0.3,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                              "offload_param": {"device": "nvme"}, "overlap_comm": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-5, "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 100,
                                                           "total_num_steps": 1000}},
    }  # fmt: skip
    found = imported(tmp_path, "deepspeed", data)
    assert found.overrides == {
        "optimizer._component_": "torch.optim.AdamW",
        "lr_schedule.decay": "cosine",
        "lr_schedule.min_lr_ratio": 0.0001,  # DeepSpeed's cos_min_ratio default
        **BF16,
        "max_grad_norm": 0.3,
        "distributed.strategy": "fsdp",
        "optimizer.offload": "cpu",  # offload_optimizer's: ZeRO-Offload, not FSDP2's
        "optimizer.lr": 3e-5,
        "optimizer.weight_decay": 0.1,
        "lr_schedule.warmup_steps": 100,
        "max_steps": 1000,
    }
    unmapped = dict(found.unmapped)
    assert "NVMe" in unmapped["zero_optimization.offload_param.device"]
    assert "overlap" in unmapped["zero_optimization.overlap_comm"]
    assert any("ZeRO-Offload" in n for n in found.notes)
    fp16 = imported(tmp_path, "deepspeed", {"fp16": {"enabled": True}, "gradient_clipping": 0})
    assert fp16.overrides["distributed.mixed_precision.param_dtype"] == "float16"
    assert fp16.overrides["max_grad_norm"] is None  # DeepSpeed's 0: no clipping


def test_accelerate_fsdp_and_launch(tmp_path):
    data = {
        "distributed_type": "FSDP", "mixed_precision": "bf16", "num_machines": 2,
        "num_processes": 16, "machine_rank": 1, "main_process_ip": "10.0.0.1",
        "main_process_port": 29500, "gpu_ids": "0,1", "use_cpu": False, "tpu_env": [],
        "fsdp_config": {"fsdp_sharding_strategy": "HYBRID_SHARD", "fsdp_offload_params": True,
                        "fsdp_activation_checkpointing": True,
                        "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                        "fsdp_state_dict_type": "FULL_STATE_DICT"},
    }  # fmt: skip
    found = imported(tmp_path, "accelerate", data, suffix=".yaml")
    assert found.overrides == {
        **BF16,
        "distributed.strategy": "hsdp",
        "distributed.cpu_offload": True,
        "distributed.activation_checkpointing": "full",
    }
    assert found.launch == ["--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1",
                            "--master-addr", "10.0.0.1", "--master-port", "29500"]  # fmt: skip
    assert found.environment == {"CUDA_VISIBLE_DEVICES": "0,1"}
    unmapped = dict(found.unmapped)
    assert set(unmapped) == {"fsdp_config.fsdp_auto_wrap_policy",
                             "fsdp_config.fsdp_state_dict_type", "tpu_env"}  # fmt: skip
    assert "checkpoint convert" in unmapped["fsdp_config.fsdp_state_dict_type"]


@pytest.mark.parametrize(
    "data, strategy",
    [
        ({"distributed_type": "MULTI_GPU", "num_processes": 4}, "ddp"),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_sharding_strategy": 2}}, "zero2"),
        ({"distributed_type": "FSDP", "fsdp_config": {"fsdp_version": 2,
                                                      "fsdp_reshard_after_forward": False}}, "zero2"),
        ({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 3}}, "fsdp"),
    ],
)  # fmt: skip
def test_accelerate_distributed_types(tmp_path, data, strategy):
    found = imported(tmp_path, "accelerate", data, suffix=".yaml")
    assert found.overrides["distributed.strategy"] == strategy


def test_accelerate_deepspeed_section(tmp_path):
    data = {"distributed_type": "DEEPSPEED", "num_processes": 8,
            "deepspeed_config": {"zero_stage": 2, "offload_optimizer_device": "cpu",
                                 "offload_param_device": "none", "gradient_accumulation_steps": 4,
                                 "gradient_clipping": 1.0, "zero3_init_flag": False}}  # fmt: skip
    found = imported(tmp_path, "accelerate", data, suffix=".yaml")
    assert found.overrides == {
        "distributed.strategy": "zero2", "optimizer.offload": "cpu",
        "gradient_accumulation_steps": 4, "max_grad_norm": 1.0,
    }  # fmt: skip
    assert [k for k, _ in found.unmapped] == ["deepspeed_config.zero3_init_flag"]


def test_seed_fsdp_json_and_training_yaml(tmp_path):
    seed_json = {
        "fsdp_transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
        "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_state_dict_type": "SHARDED_STATE_DICT",
        "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_mixed_precision": "BFLOAT16",
        "fsdp_sync_module_states": True,
    }  # fmt: skip
    found = imported(tmp_path, "fsdp-config", seed_json)
    assert found.overrides == {"distributed.strategy": "fsdp", **BF16}
    assert {k for k, _ in found.unmapped} == {
        "fsdp_transformer_layer_cls_to_wrap", "fsdp_state_dict_type", "fsdp_sync_module_states"
    }  # fmt: skip
    seed_yaml = {
        "distributed": {"use_fsdp": True, "fsdp_sharding_strategy": "shard_grad_op",
                        "fsdp_param_dtype": "bfloat16", "fsdp_reduce_dtype": "float32"},
        "training": {"batch_size": 64, "gradient_accumulation_steps": 2,
                     "learning_rate": 2e-4, "gradient_checkpointing": True},
    }  # fmt: skip
    found = imported(tmp_path, "fsdp-config", seed_yaml, world_size=4, suffix=".yaml")
    assert found.overrides == {
        "gradient_accumulation_steps": 2, "batch_size": 64 * 2 * 4,
        "distributed.strategy": "zero2",
        **BF16,
        "optimizer.lr": 2e-4, "distributed.activation_checkpointing": "full",
    }  # fmt: skip


@pytest.mark.parametrize(
    "name, text, words",
    [
        ("missing.json", None, "does not exist"),
        ("bad.json", "{not json", "is not valid JSON"),
        ("bad.yaml", "a: [1, 2", "is not valid YAML"),
        ("list.yaml", "- 1\n- 2\n", "holds a list, not a mapping"),
    ],
)
def test_a_bad_file_is_one_paragraph(tmp_path, name, text, words):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    with pytest.raises(FreetxError, match=words):
        read_config_file(str(path))
