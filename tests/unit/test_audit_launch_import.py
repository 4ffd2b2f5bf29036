"""Issue 36's launch and import cases: the SLURM script (CPUs, memory, set-up before
`set -u`, the venv's python and a free port found at run time), every value in a script
quoted or refused, `launch torchrun -o`, `freetx import` refusing bad files and values
with one paragraph, DeepSpeed's auto precision, WarmupDecayLR and the seeds' keys, and
the hints torchtune's and the seeds' names get."""

from __future__ import annotations

import json
import os
import shlex
import stat
import subprocess
import sys

import pytest
import yaml

from freetx.config.foreign_names import PER_DEVICE_BATCH_NAMES
from freetx.planning.config_import import import_config, read_config_file
from tests.conftest import flat, one_paragraph, run_freetx_here

RECIPE = ["full_finetune_fsdp2", "--config", "llm/tiny"]


def slurm(tmp_path, *args, overrides=(), name="job.sbatch"):
    out = tmp_path / name
    result = run_freetx_here("launch", "slurm", *args, "-o", str(out), *RECIPE, *overrides)
    return result, out


# -- launch slurm: what the script asks for and finds at run time -----------------------
def test_slurm_script_requests_cpus_and_memory(tmp_path):
    result, out = slurm(tmp_path, "--nproc-per-node", "2", overrides=["num_workers=3"])
    assert result.returncode == 0, result.stderr
    script = out.read_text()
    assert "#SBATCH --cpus-per-task=8" in script  # 2 processes x (1 + 3 loader workers)
    assert "#SBATCH --mem=0" in script  # all of the node's memory by default
    result, out = slurm(tmp_path, "--cpus-per-task", "16", "--mem", "64G", name="b.sbatch")
    script = out.read_text()
    assert "#SBATCH --cpus-per-task=16" in script and "#SBATCH --mem=64G" in script


def test_slurm_setup_lines_come_before_set_u(tmp_path):
    result, out = slurm(tmp_path, "--setup", "module load cuda")
    script = out.read_text()
    assert script.index("module load cuda") < script.index("set -uo pipefail")


def test_slurm_script_has_no_fixed_port_or_python_of_the_writer(tmp_path):
    result, out = slurm(tmp_path)
    srun = next(line for line in out.read_text().splitlines() if line.startswith("srun"))
    assert '"$python" -m freetx run' in srun and '"$head_node:$port"' in srun
    assert "29500" not in out.read_text()


def test_slurm_script_runs_the_venv_activated_in_setup_on_a_free_port(tmp_path):
    """The script itself, run with stand-ins for scontrol and srun: a set-up line that
    reads an unset variable works (it runs before set -u), the `python` its venv puts
    first on PATH is the one srun starts, and the port is one the node found free."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv" / "bin"
    bin_dir.mkdir()
    venv.mkdir(parents=True)
    stand_ins = {
        bin_dir / "scontrol": "#!/bin/bash\necho node001\n",
        bin_dir / "srun": f'#!/bin/bash\necho "$@" > {tmp_path / "srun_args"}\n',
        venv / "python": f'#!/bin/bash\nexec {shlex.quote(sys.executable)} "$@"\n',
    }
    for path, text in stand_ins.items():
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    setup = f'[ -z "$UNSET_BY_THE_CLUSTER" ]; export PATH={venv}:$PATH'
    result, out = slurm(tmp_path, "--setup", setup)
    assert result.returncode == 0, result.stderr
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "node001", "PYTHONPATH": os.getcwd()}  # fmt: skip
    ran = subprocess.run(["bash", str(out)], env=env, capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    args = (tmp_path / "srun_args").read_text().split()
    assert args[args.index("-m") - 1] == str(venv / "python")
    port = int(args[args.index("--rdzv-endpoint") + 1].split(":")[1])
    assert 1024 <= port <= 65535


def test_launch_torchrun_o_writes_a_script_per_node_rank(tmp_path):
    out = tmp_path / "nodes.sh"
    result = run_freetx_here("launch", "torchrun", "--nodes", "2", "--master-addr", "10.0.0.1",
                             "-o", str(out), *RECIPE)  # fmt: skip
    assert result.returncode == 0 and "bash" in result.stdout, result.stderr
    script = out.read_text()
    assert "0) exec" in script and "1) exec" in script and "--node-rank 1" in script
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    printed = run_freetx_here("launch", "torchrun", "--master-addr", "h", *RECIPE)
    assert printed.stdout.count("--master-port 29500") == 1  # printing as before


def test_launch_option_after_the_recipe_says_options_go_before_it(tmp_path):
    result = run_freetx_here("launch", "slurm", *RECIPE, "-o", str(tmp_path / "F"))
    message = one_paragraph(result, 2)
    assert "-o comes after the recipe" in message and "go before the recipe" in message
    assert not (tmp_path / "F").exists()


# -- every value in a script quoted or refused -------------------------------------------
@pytest.mark.parametrize(
    "args, overrides, message",
    [(["--job-name", "../escape"], [], "a job name is letters"),
     (["--job-name", "a/b"], [], "a job name is letters"),
     (["--job-name", "x\n#SBATCH --uid=0"], [], "a job name is letters"),
     (["--partition", "gpu\n#SBATCH --uid=0"], [], "an #SBATCH value cannot hold"),
     (["--partition", "gpu debug"], [], "an #SBATCH value cannot hold"),
     (["--env", "BAD-NAME=1"], [], "a shell variable name"),
     (["--env", "1X=1"], [], "a shell variable name"),
     (["--env", "A=1\nrm -rf /"], [], "control character"),
     (["--mem", "lots"], [], "memory size"),
     ([], ["output_dir=a\ntouch /tmp/x"], "control character"),
     (["--setup", "if then fi ("], [], "does not pass `bash -n`")],
    ids=["job_name_dotdot", "job_name_slash", "job_name_newline", "partition_newline",
         "partition_space", "env_name_dash", "env_name_digit", "env_value_newline",
         "mem_not_a_size", "override_newline", "setup_not_bash"],
)  # fmt: skip
def test_unsafe_script_value_is_refused_and_nothing_written(tmp_path, args, overrides, message):
    result, out = slurm(tmp_path, *args, overrides=overrides)
    assert message in one_paragraph(result, 2), result.stderr
    assert not out.exists() and not (tmp_path.parent / "escape.sbatch").exists()


def test_values_with_spaces_are_quoted_in_the_script(tmp_path):
    result, out = slurm(tmp_path, "--env", "GREETING=a b; touch x",
                        overrides=["output_dir=runs/with space"])  # fmt: skip
    script = out.read_text()
    assert "export GREETING='a b; touch x'" in script
    assert "'output_dir=runs/with space'" in script
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0


# -- freetx import: one paragraph for what it cannot read --------------------------------
BOMB = "a: &a [x, x]\nb: &b [*a, *a]\nc: &c [*b, *b]\nd: [*c, *c]\n"
BAD_FILES = {
    "yaml_alias_bomb": ("deepspeed", "c.yaml", BOMB, "YAML alias"),
    "number_1e400": ("deepspeed", "c.json", '{"train_batch_size": 1e400}', "too large"),
    "nan": ("deepspeed", "c.json", '{"gradient_clipping": NaN}', "NaN"),
    "stage_list": ("deepspeed", "c.json", '{"zero_optimization": {"stage": [3]}}', "ZeRO stage"),
    "batch_not_a_number": ("deepspeed", "c.json", '{"train_batch_size": "many"}', "whole number"),
    "batch_negative": ("deepspeed", "c.json", '{"train_batch_size": -8}', "from 1"),
    "batch_huge": ("deepspeed", "c.json", '{"train_batch_size": 1e30}', "from 1"),
    "lr_negative": ("deepspeed", "c.json", '{"optimizer": {"params": {"lr": -1}}}', "from 0"),
    "bf16_enabled_text": ("deepspeed", "c.json", '{"bf16": {"enabled": "yes"}}', "true, false"),
    "binary_file": ("deepspeed", "c.json", b"\x89PNG\r\n\x1a\n\x00\x00\xff\xfe", "not a text"),
    "slurm_script": ("deepspeed", "run.sh", "#!/bin/bash\n#SBATCH --nodes=2\nsrun x\n",
                     "freetx launch slurm"),
    "accelerate_fsdp_config_number": ("accelerate", "c.yaml",
                                      "distributed_type: FSDP\nfsdp_config: 3\n", "fsdp_config"),
    "accelerate_dynamo_config_text": ("accelerate", "c.yaml", "dynamo_config: inductor\n",
                                      "dynamo_config"),
    "accelerate_deepspeed_config_list": ("accelerate", "c.yaml",
                                         "distributed_type: DEEPSPEED\ndeepspeed_config: [1]\n",
                                         "deepspeed_config"),
    "accelerate_port_99999": ("accelerate", "c.yaml",
                              "num_machines: 2\nnum_processes: 4\nmain_process_port: 99999\n",
                              "from 1 to 65535"),
    "torchtune_epochs_negative": ("torchtune", "c.yaml", "epochs: -1\n", "from 1"),
}  # fmt: skip


@pytest.mark.parametrize("case", list(BAD_FILES))
def test_import_of_a_bad_file_is_one_paragraph(tmp_path, case):
    kind, name, content, message = BAD_FILES[case]
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    result = run_freetx_here("import", kind, str(path))
    assert message in one_paragraph(result), result.stderr
    assert result.stdout == ""


def test_import_accelerate_prints_launch_options_quoted(tmp_path):
    path = tmp_path / "default_config.yaml"
    path.write_text(yaml.safe_dump({"num_machines": 2, "num_processes": 4,
                                    "main_process_ip": "$(touch X)", "main_process_port": 29501}))  # fmt: skip
    result = run_freetx_here("import", "accelerate", str(path))
    launch = next(line for line in result.stdout.splitlines() if "launch options" in line)
    assert "--master-addr '$(touch X)'" in launch and "--master-port 29501" in launch


def test_a_key_with_a_newline_stays_inside_the_comment_lines(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bogus\ntouch /tmp/pwned": 1, "zero_optimization": {"stage": 2}}))
    result = run_freetx_here("import", "deepspeed", str(path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert all(line.startswith("#") for line in lines[1:]), lines
    assert any("bogus\\ntouch" in line for line in lines)


# -- DeepSpeed: auto precision, WarmupDecayLR, the seeds' keys ---------------------------
def imported(tmp_path, kind, data, world_size=None):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    return import_config(kind, read_config_file(str(path)), world_size)


def test_deepspeed_auto_precision_is_named_not_dropped(tmp_path):
    found = imported(tmp_path, "deepspeed", {"bf16": {"enabled": "auto"}})
    why = dict(found.unmapped)["bf16.enabled"]
    assert "recipe's config decides" in why and "param_dtype" in why


def test_deepspeed_warmup_decay_lr_decays_to_zero(tmp_path):
    found = imported(tmp_path, "deepspeed", {"scheduler": {"type": "WarmupDecayLR"}})
    assert found.overrides["lr_schedule.decay"] == "linear"
    assert found.overrides["lr_schedule.min_lr_ratio"] == 0.0


def test_seed_training_yaml_keys_map_to_freetx_keys(tmp_path):
    seed = {"distributed": {"use_deepspeed": True, "deepspeed_config": "config/ds_config.json",
                            "gradient_accumulation_steps": 16},
            "training": {"gradient_clip_norm": 1.0}, "num_workers": 4}  # fmt: skip
    for kind in ("deepspeed", "fsdp-config"):
        found = imported(tmp_path, kind, seed)
        assert found.overrides["max_grad_norm"] == 1.0
        assert found.overrides["gradient_accumulation_steps"] == 16
        assert found.overrides["num_workers"] == 4
        unmapped = dict(found.unmapped)
        assert "no DeepSpeed engine" in unmapped["distributed.use_deepspeed"]
        assert "freetx import deepspeed config/ds_config.json" in unmapped[
            "distributed.deepspeed_config"]  # fmt: skip


# -- per-device batch sizes become the global batch_size, said where met -----------------
@pytest.mark.parametrize("name", PER_DEVICE_BATCH_NAMES)
def test_per_device_batch_name_hint_says_batch_size_is_global(name):
    result = run_freetx_here("validate", "llm/tiny", f"{name}=8")
    message = flat(result.stdout)
    assert f"unknown key '{name}': did you mean 'batch_size'?" in message
    assert "global" in message and "batch_size=64 on 8 ranks" in message


def test_per_device_batch_in_import_output_says_global_with_the_value(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 2}))  # fmt: skip
    result = run_freetx_here("import", "deepspeed", str(path), "--world-size", "8")
    assert "batch_size=64" in result.stdout.splitlines()[0]
    assert "batch_size=64 is global: train_micro_batch_size_per_gpu=4 per device x 8 ranks" in (
        result.stdout
    )


def test_seeds_batch_size_flag_after_the_recipe_says_global():
    from freetx.config.loading import check_override_syntax
    from freetx.errors import UsageError

    with pytest.raises(UsageError) as e:
        check_override_syntax(["--batch_size", "256"])
    assert "batch_size=VALUE" in str(e.value) and "global" in str(e.value)
    assert "go before the recipe" in str(e.value)


# -- torchtune's names ------------------------------------------------------------------
@pytest.mark.parametrize(
    "key, expected",
    [("epochs=3", "did you mean 'max_steps'? freetx counts optimizer steps"),
     ("dtype=bf16", "did you mean 'distributed.mixed_precision.param_dtype'?"),
     ("resume_from_checkpoint=true", "did you mean 'resume'?"),
     ("checkpointer.checkpoint_dir=/m", "did you mean 'model_dir'?"),
     ("lr_scheduler.num_warmup_steps=10", "did you mean 'lr_schedule'?"),
     ("enable_activation_checkpointing=true", "did you mean 'distributed.activation_checkpointing'?"),
     ("compile=true", "did you mean 'distributed.compile'?"),
     ("shuffle=true", "no freetx key: freetx always shuffles"),
     ("max_steps_per_epoch=10", "did you mean 'max_steps'?"),
     ("clip_grad_norm=1.0", "did you mean 'max_grad_norm'?"),
     ("metric_logger.log_dir=x", "did you mean 'metric_loggers'?")],
    ids=lambda v: v.split("=")[0] if "=" in v else "",
)  # fmt: skip
def test_torchtune_key_gets_a_targeted_hint(key, expected):
    result = run_freetx_here("validate", "llm/tiny", key)
    assert result.returncode == 1
    assert expected in flat(result.stdout), result.stdout
    assert "valid keys here" not in result.stdout


def test_imported_text_value_with_a_newline_is_refused(tmp_path):
    path = tmp_path / "tt.yaml"
    path.write_text(yaml.safe_dump({"checkpointer": {"checkpoint_dir": "/m\ntouch /tmp/x"}}))
    result = run_freetx_here("import", "torchtune", str(path))
    assert "text on one line" in one_paragraph(result) and result.stdout == ""
