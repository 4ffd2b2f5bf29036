"""The weak-message audit: each finding refused in one paragraph that names the problem and
the fix, by `freetx validate` and before any work of a run (no output folder, no data
prepared), or said where the run is legal; in-process, no launch."""

import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from torch import nn

from freetx.errors import CheckpointError, ConfigError
from tests.conftest import flat, one_paragraph, run_freetx_here
from tests.unit.test_audit_checks import launch


def refused_by_validate(*args: str) -> str:
    """`freetx validate ARGS`, refused: its problems, flattened."""
    result = run_freetx_here("validate", *args)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    return flat(result.stdout)


def refused_before_any_work(tmp_path: Path, recipe: str, *args: str) -> str:
    """`freetx run RECIPE ARGS` refused in this process before anything is launched: the
    message, and no output folder made."""
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as e:
        launch(recipe, *args, f"output_dir={out}")
    assert not out.exists()
    return flat(str(e.value))


QAT_PAST_THE_END = ["qat.scheme=int8_dynamic_act_int4_weight", "qat.start_step=10", "max_steps=10"]


def test_a_qat_start_step_at_or_past_max_steps_is_refused(tmp_path):
    words = "qat.start_step=10 turns fake quantization on after 10 steps, and the run stops "
    assert words in refused_by_validate("llm/tiny", *QAT_PAST_THE_END)
    said = refused_before_any_work(
        tmp_path, "full_finetune_fsdp2", "--config", "llm/tiny", *QAT_PAST_THE_END
    )
    assert words in said and "Set qat.start_step below 10" in said
    assert (
        run_freetx_here("validate", "llm/tiny", *QAT_PAST_THE_END[:2], "max_steps=11").returncode
        == 0
    )


def test_a_negative_simpo_gamma_is_refused_by_validate(tmp_path):
    said = refused_by_validate(
        "llm/dpo_tiny", "loss.type=simpo", "loss.gamma=-1", f"model_dir={tmp_path}"
    )
    assert "'loss.gamma' is -1: it is SimPO's target reward margin" in said


def test_a_teacher_top_k_past_its_vocabulary_is_refused_before_the_data(tmp_path):
    top_k = ["teacher.precompute=top_k", "teacher.top_k=300", "teacher.weights=null"]
    words = "teacher.top_k=300 keeps the teacher's 300 most likely tokens per position, and its "
    assert words + "vocabulary has 259 tokens" in refused_by_validate("llm/kd_tiny", *top_k)
    said = refused_before_any_work(tmp_path, "kd_fsdp2", "--config", "llm/kd_tiny", *top_k)
    assert "Set teacher.top_k to 259 or fewer" in said


def test_a_teacher_of_an_hf_folder_is_known_by_its_config_json(tmp_path):
    from freetx.training import model_vocab_size

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 384}))
    node = OmegaConf.create({"_component_": "freetx.models.hf_model", "path": str(tmp_path)})
    assert model_vocab_size(node) == 384
    assert model_vocab_size(OmegaConf.merge(node, {"vocab_size": 512})) == 512
    assert model_vocab_size(OmegaConf.create({"path": str(tmp_path / "none")})) is None


def test_teacher_weights_that_do_not_exist_are_refused_naming_the_key(tmp_path):
    missing = tmp_path / "missing"
    words = f"teacher.weights={missing} does not exist. Point teacher.weights at"
    assert words in refused_by_validate("llm/kd_tiny", f"teacher.weights={missing}")
    said = refused_before_any_work(
        tmp_path, "kd_fsdp2", "--config", "llm/kd_tiny", f"teacher.weights={missing}"
    )
    assert words in said


def test_an_adapter_checkpoint_whose_base_moved_names_the_recorded_base_and_the_override(
    tmp_path,
):
    from freetx.checkpoint.loading import adapters_base

    step = tmp_path / "step_000002"
    source = SimpleNamespace(path=step, meta={"frozen_from": str(tmp_path / "base_l")})
    with pytest.raises(CheckpointError) as e:
        adapters_base(source, None, "base")  # the eval recipe's
    said = flat(str(e.value))
    assert (
        f"the base they were trained over, as the run recorded it ({step / 'meta.json'}: " in said
    )
    assert f"frozen_from), is {tmp_path / 'base_l'}, which does not exist now. If the base " in said
    assert "moved, set base=PATH to read it from there" in said
    with pytest.raises(CheckpointError, match="freetx checkpoint merge"):
        adapters_base(source)  # an export, which has no key for it
    assert adapters_base(source, str(tmp_path), "base") == str(tmp_path)
    said = refused_by_validate("llm/hf_eval", f"checkpoint={tmp_path}", f"base={tmp_path / 'x'}")
    assert f"base={tmp_path / 'x'} does not exist" in said


def test_data_show_of_a_data_file_shows_its_rows_columns_and_format(tmp_path):
    data = tmp_path / "pairs.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": "d"}\n')
    result = run_freetx_here("data", "show", str(data), "1")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"{data}: rows: 2; columns: prompt, completion"
    assert lines[1] == (
        "format: prompt_response (with dataset.format=prompt_response "
        "dataset.columns.response=completion)"
    )
    assert lines[2] == '1: {"prompt": "a", "completion": "b"}'
    assert f"freetx data show llm/instruct_tiny dataset.source={data} dataset.format=" in lines[-1]
    said = one_paragraph(run_freetx_here("data", "prepare", str(data)))
    assert (
        f"Give a config whose dataset reads it: freetx data prepare llm/instruct_tiny dataset.source={data}"
        in said
    )


@pytest.mark.parametrize(
    "section, value, words",
    [({"scheduler": {"type": ["WarmupLR"]}}, "scheduler.type is ['WarmupLR']", "a scheduler's name"),
     ({"optimizer": {"type": 3}}, "optimizer.type is 3", "an optimizer's name (Adam, AdamW or SGD)"),
     ({"zero_optimization": {"offload_param": "cpu"}}, "zero_optimization.offload_param is 'cpu'",
      "a mapping of keys to values"),
     ({"bf16": True}, "bf16 is True", "a mapping of keys to values")],
    ids=["scheduler_type_a_list", "optimizer_type_a_number", "offload_a_string", "bf16_a_bool"],
)  # fmt: skip
def test_deepspeed_values_of_the_wrong_type_are_one_paragraph(tmp_path, section, value, words):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(section))
    said = one_paragraph(run_freetx_here("import", "deepspeed", str(path)))
    assert f"{path}: {value}, but it must be {words}" in said


def test_a_model_dir_that_is_no_hf_folder_is_named_before_its_tokenizer(tmp_path):
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\0" * 8)
    said = refused_by_validate("llm/hf_tiny_full", f"model_dir={weights}")
    assert "model.path and tokenizer.path read it as an HF model folder, and it is a file" in said
    assert "point model_dir at an HF model folder (config.json, *.safetensors, tokenizer" in said
    said = refused_by_validate("llm/hf_tiny_full", f"model_dir={tmp_path}")
    assert "model.path reads it as an HF model folder, and it holds no config.json" in said
    assert run_freetx_here("validate", "llm/dora_tiny", f"model_dir={weights}").returncode == 0


LORA_DROPOUT_ON_EXPERTS = ["peft.target_modules=[all-linear]", "peft.dropout=0.05"]


def test_lora_dropout_on_all_linear_experts_is_refused_before_launch(tmp_path):
    words = "'peft.dropout' is 0.05: LoRA on MoE experts adapts the grouped expert tensors"
    config = ["--config", "llm/moe_lora_tiny", f"model_dir={tmp_path}"]
    assert words in refused_by_validate(*config[1:], *LORA_DROPOUT_ON_EXPERTS)
    said = refused_before_any_work(
        tmp_path, "--nproc-per-node", "2", "lora_finetune_fsdp2", *config, *LORA_DROPOUT_ON_EXPERTS
    )
    assert words in said
    dense = ["--config", "llm/lora_tiny", f"model_dir={tmp_path}", *LORA_DROPOUT_ON_EXPERTS]
    assert run_freetx_here("validate", *dense[1:]).returncode == 0


def test_torchaos_low_bit_optimizer_does_not_warn_of_its_compile_cache():
    from freetx.distributed.optimizer import build_optimizer

    model = nn.Linear(4, 4)
    node = OmegaConf.create({"_component_": "torchao.optim.AdamW8bit", "lr": 1e-3})
    build_optimizer(node, model, {id(p): n for n, p in model.named_parameters()}, False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn(
            "OptimState8bit does not implement _stable_hash_for_caching. For PT2-compatible "
            "tensor subclasses, it is recommended to implement ...",
            UserWarning,
            stacklevel=1,
        )
        warnings.warn("another warning", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["another warning"]


def test_resume_false_says_the_accepted_values():
    said = refused_by_validate("llm/tiny", "resume=false")
    assert (
        "'resume' must be auto (the newest checkpoint in output_dir, if any), never (start "
        "afresh) or the path of a checkpoint to continue from (for resume=false, write "
        "resume=never), got False."
    ) in said


def test_a_saved_safetensors_file_has_the_mode_of_the_files_beside_it(tmp_path):
    import torch

    from freetx.checkpoint.formats import save_tensors

    save_tensors({"a": torch.zeros(2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    modes = {os.stat(p).st_mode & 0o777 for p in tmp_path.iterdir()}
    assert len(modes) == 1, modes
