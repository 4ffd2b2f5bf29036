"""A config names code only from an allowlist (docs/trust.md): the audit's escapes (and
others of the kind) refused by every command that reads a config, before anything is
built; the user's own code, environment variables, remote code and task folders with
Python allowed by `--trust` for the command, never by the config."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from freetx.config.instantiate import import_component
from freetx.errors import ConfigError
from tests.conftest import REPO, flat, one_paragraph, run_freetx_here, run_refused_here

RECIPE = ("--recipe", "full_finetune_fsdp2")

# each runs a program or Python text, writes or reads a file the config names, opens a
# connection, or imports code as a side effect
ESCAPES = [
    "timeit.timeit", "cProfile.run", "sympy.sympify", "torch.utils.collect_env.run",
    "transformers.AutoConfig.from_pretrained", "gzip.open", "numpy.savetxt",
    "linecache.getline", "logging.FileHandler", "setuptools._distutils.spawn.spawn",
    "pdb.run", "code.interact", "runpy.run_path", "importlib.import_module", "pickle.loads",
    "shelve.open", "ctypes.CDLL", "shutil.rmtree", "pathlib.Path.write_text", "os.system",
    "builtins.eval", "builtins.open", "subprocess.run", "torch.load", "torch.hub.load",
    "torch.os.system", "freetx.data.token_cache.os.system", "torch.nn.modules.module.torch.load",
    "antigravity.fly",  # importing it opens a browser: refused before any import
    "freetx.objectives.rollouts.write_samples",  # a freetx function that writes a file it is given
    "freetx.checkpoint.convert",  # freetx, but no component of a config
    "numpy.load", "urllib.request.urlopen", "webbrowser.open", "tempfile.mkstemp",
]  # fmt: skip


@pytest.mark.parametrize("target", ESCAPES)
def test_every_escape_is_refused_before_its_module_runs(target):
    with pytest.raises(ConfigError) as error:
        import_component(target, "dataset.cache_dir._component_")
    text = flat(str(error.value))
    assert f"dataset.cache_dir._component_: '{target}'" in text and "is refused" in text
    assert "--trust" in text and "docs/trust.md" in text


@pytest.mark.parametrize(
    "target",
    ["torch.optim.AdamW", "torch.optim.lr_scheduler.LambdaLR", "torch.nn.Linear",
     "torchao.optim.AdamW8bit", "freetx.data.HFTokenizer", "freetx.models.hf_model",
     "freetx.objectives.GRPOLoss", "freetx.loggers.JSONLLogger",
     "freetx.training.CrossEntropyLoss"],  # a moved name: its new home's
)  # fmt: skip
def test_the_allowlist_builds_what_configs_name(target):
    assert callable(import_component(target, "x._component_"))


def hostile(tmp_path: Path, node: str, value) -> Path:
    cfg = OmegaConf.load(REPO / "recipe_configs" / "llm" / "tiny.yaml")
    OmegaConf.update(cfg, node, value, force_add=True)
    cfg.output_dir = str(tmp_path / "run")
    path = tmp_path / "hostile.yaml"
    path.write_text(OmegaConf.to_yaml(cfg))
    return path


TIMEIT = {"_component_": "timeit.timeit", "stmt": "open('PWNED', 'w')"}


@pytest.mark.parametrize(
    "command",
    [("validate",), ("estimate", "--world-size", "1"), ("data", "prepare"), ("launch",
     "slurm", "full_finetune_fsdp2", "--config")],
    ids=["validate", "estimate", "data_prepare", "launch"],
)  # fmt: skip
def test_every_command_refuses_an_escape(tmp_path, monkeypatch, command):
    monkeypatch.chdir(tmp_path)
    config = hostile(tmp_path, "dataset.cache_dir", TIMEIT)
    extra = () if command[0] == "launch" else RECIPE
    result = run_freetx_here(*command, str(config), *extra)
    text = flat(result.stdout + result.stderr)
    assert result.returncode == 1, text
    assert "dataset.cache_dir._component_: 'timeit.timeit' is refused" in text
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "run").exists()


def test_run_refuses_an_escape_before_launching(tmp_path, monkeypatch):
    config = hostile(tmp_path, "dataset.cache_dir", TIMEIT)
    monkeypatch.chdir(tmp_path)
    result = run_refused_here("--nproc-per-node", "2", "full_finetune_fsdp2", "--config",
                              str(config))  # fmt: skip
    assert "dataset.cache_dir._component_: 'timeit.timeit' is refused" in one_paragraph(result)
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "run").exists()


def test_eval_refuses_an_escape(tmp_path):
    result = run_freetx_here(
        "eval", str(tmp_path), f"output_dir={tmp_path / 'out'}", "tasks=[x]",
        "rewards=[{_component_: timeit.timeit, stmt: 'open(1)'}]",
    )  # fmt: skip
    text = flat(result.stdout + result.stderr)
    assert result.returncode == 1 and "rewards[0]._component_: 'timeit.timeit' is refused" in text


def own_module(tmp_path: Path, monkeypatch) -> Path:
    (tmp_path / "my_lengths.py").write_text("def seq_len():\n    return 128\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return hostile(tmp_path, "model.max_seq_len", {"_component_": "my_lengths.seq_len"})


def test_the_users_own_module_runs_when_trusted_for_the_command(tmp_path, monkeypatch):
    config = own_module(tmp_path, monkeypatch)
    refused = run_freetx_here("validate", str(config), *RECIPE)
    text = flat(refused.stdout)
    assert refused.returncode == 1 and "'my_lengths.seq_len' is refused" in text
    assert "freetx run --trust my_lengths" in text and "FREETX_TRUST=my_lengths" in text
    trusted = run_freetx_here("validate", str(config), *RECIPE, "--trust", "my_lengths")
    assert trusted.returncode == 0, trusted.stdout + trusted.stderr
    # the trust was the command's: the next command without it is refused again
    assert run_freetx_here("validate", str(config), *RECIPE).returncode == 1


def test_the_environment_variable_trusts_too(tmp_path, monkeypatch):
    config = own_module(tmp_path, monkeypatch)
    monkeypatch.setenv("FREETX_TRUST", "my_lengths")
    assert run_freetx_here("validate", str(config), *RECIPE).returncode == 0


def test_trusting_a_module_does_not_trust_what_it_imports(tmp_path, monkeypatch):
    (tmp_path / "my_tools.py").write_text("import os\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FREETX_TRUST", "my_tools")
    with pytest.raises(ConfigError, match=r"'my_tools.os.system' \(which is os\) is refused"):
        import_component("my_tools.os.system", "x._component_")


def test_a_config_cannot_trust_itself(tmp_path):
    config = hostile(tmp_path, "dataset.cache_dir", TIMEIT)
    for key in ("trust=[timeit]", "FREETX_TRUST=timeit"):
        result = run_freetx_here("validate", str(config), *RECIPE, key)
        assert result.returncode == 1 and "'timeit.timeit' is refused" in flat(result.stdout)


# -- environment variables and remote code -----------------------------------------------


def test_an_environment_variable_in_a_config_needs_trust(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SECRET", "hunter2")
    monkeypatch.setenv("FREETX_RUN_NAME", "nightly")
    config = hostile(tmp_path, "wandb_tag", "${oc.env:MY_SECRET}")
    result = run_freetx_here("cat", str(config))
    text = flat(result.stderr)
    assert result.returncode == 1 and "hunter2" not in result.stdout + result.stderr
    assert "wandb_tag: ${oc.env:MY_SECRET} copies the environment variable MY_SECRET" in text
    assert "--trust env:MY_SECRET" in text
    trusted = run_freetx_here("cat", str(config), "--trust", "env:MY_SECRET")
    assert trusted.returncode == 0 and "hunter2" in trusted.stdout
    allowed = run_freetx_here("cat", "llm/tiny", "output_dir=runs/${oc.env:FREETX_RUN_NAME}")
    assert allowed.returncode == 0 and "runs/nightly" in allowed.stdout


def test_an_environment_variable_in_an_override_is_refused_by_validate(tmp_path, monkeypatch):
    monkeypatch.setenv("MY_SECRET", "hunter2")
    result = run_freetx_here("validate", "llm/tiny", "seed=${oc.env:MY_SECRET,0}")
    assert result.returncode == 1 and "seed: ${oc.env:MY_SECRET} copies" in flat(result.stderr)


def test_trust_remote_code_needs_trust(tmp_path):
    config = hostile(tmp_path, "tokenizer.trust_remote_code", True)
    result = run_freetx_here("validate", str(config), *RECIPE)
    text = flat(result.stdout + result.stderr)
    assert result.returncode == 1 and "tokenizer.trust_remote_code: trust_remote_code runs" in text
    assert "--trust remote_code" in text


# -- lm-eval task folders ------------------------------------------------------------------


def task_folder(tmp_path: Path, function: str, module: str | None) -> Path:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "t.yaml").write_text(f"task: t\nprocess_docs: !function {function}\n")
    if module:
        (tasks / f"{module}.py").write_text("def process_docs(docs):\n    return docs\n")
    return tasks


def test_a_task_folder_with_python_needs_trust(tmp_path, monkeypatch):
    from freetx.config.trust import check_task_folder

    tasks = task_folder(tmp_path, "utils.process_docs", "utils")
    with pytest.raises(ConfigError) as error:
        check_task_folder(tasks)
    text = flat(str(error.value))
    assert "t.yaml says `!function utils.process_docs`" in text and f"--trust {tasks}" in text
    monkeypatch.setenv("FREETX_TRUST", str(tasks))
    check_task_folder(tasks)


def test_a_task_function_outside_the_folder_is_one_paragraph(tmp_path):
    tasks = task_folder(tmp_path, "os.system", None)
    result = run_freetx_here(
        "eval", str(tmp_path), "--tasks", "t", "--include-path", str(tasks),
        f"output_dir={tmp_path / 'out'}",
    )  # fmt: skip
    text = flat(result.stderr)
    assert result.returncode == 1 and "Traceback" not in result.stderr, text
    assert "`!function os.system`, and lm-eval would import os.py beside it" in text


@pytest.mark.parametrize("name", ["/tmp/elsewhere.jsonl", "../../metrics.jsonl", ""])
def test_a_logger_writes_in_the_run_folder_only(tmp_path, name):
    from freetx.loggers import JSONLLogger, TensorBoardLogger

    with pytest.raises(ConfigError, match="would write outside the run's output_dir"):
        JSONLLogger(str(tmp_path), filename=name)
    with pytest.raises(ConfigError, match="TensorBoardLogger's subdir="):
        TensorBoardLogger(str(tmp_path), subdir=name)
    assert JSONLLogger(str(tmp_path), filename="logs/m.jsonl").path == tmp_path / "logs/m.jsonl"


def test_launch_checks_with_the_trust_and_writes_it_into_the_run_line(tmp_path, monkeypatch):
    config = own_module(tmp_path, monkeypatch)
    launch = ("launch", "slurm", "--nodes", "1", "--nproc-per-node", "2")
    refused = run_freetx_here(*launch, "full_finetune_fsdp2", "--config", str(config))
    assert refused.returncode == 1 and "--trust my_lengths" in flat(refused.stderr)
    script = run_freetx_here(*launch, "--trust", "my_lengths", "full_finetune_fsdp2", "--config",
                             str(config))  # fmt: skip
    assert script.returncode == 0, script.stderr
    assert "--trust=my_lengths full_finetune_fsdp2 --config" in script.stdout
