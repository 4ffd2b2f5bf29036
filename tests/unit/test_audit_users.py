"""Issue 36, migrating users: loggers by name (W&B with the run's config), data format
messages that name the value, determinism."""

from __future__ import annotations

import json
import sys
import types

import pytest
from omegaconf import OmegaConf

from freetx.config.loading import apply_overrides
from freetx.data import ByteTokenizer, InstructDataset
from freetx.errors import ConfigError, DataError
from freetx.loggers import LoggersConfig, build_metric_loggers
from freetx.loggers.loggers import logger_nodes
from tests.conftest import flat, run_freetx_here


class FakeRun:
    def __init__(self):
        self.logged = []
        self.finished = False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch):
    """A stand-in for the optional wandb client: records what `init` was given."""
    module = types.ModuleType("wandb")
    module.inits = []

    def init(**settings):
        module.inits.append(settings)
        return FakeRun()

    module.init = init
    monkeypatch.setitem(sys.modules, "wandb", module)
    return module


def test_wandb_by_name_gets_the_project_and_the_run_config(fake_wandb, tmp_path):
    named = LoggersConfig(wandb={"project": "my-project", "mode": "offline"})
    run_config = {"seed": 3, "optimizer": {"_component_": "torch.optim.AdamW", "lr": 0.01}}
    loggers = build_metric_loggers(
        [{"_component_": "freetx.loggers.JSONLLogger"}], str(tmp_path), 10, 0,
        named=named, hyperparameters=run_config,
    )  # fmt: skip
    loggers.log(1, {"loss": 2.5})
    loggers.close()
    assert len(loggers.loggers) == 2  # the list kept, W&B added
    (settings,) = fake_wandb.inits
    assert settings["project"] == "my-project"
    assert settings["mode"] == "offline"
    assert settings["config"] == run_config


def test_wandb_by_name_on_other_ranks_builds_nothing(fake_wandb, tmp_path):
    named = LoggersConfig(wandb={"project": "p"})
    loggers = build_metric_loggers([], str(tmp_path), 10, 1, named=named)
    loggers.log(1, {"loss": 1.0})
    assert loggers.loggers == [] and fake_wandb.inits == []


def test_named_logger_already_listed_gets_the_keys_not_a_second_copy():
    nodes = [{"_component_": "freetx.loggers.JSONLLogger", "filename": "a.jsonl"}]
    found = logger_nodes(nodes, LoggersConfig(jsonl={"filename": "b.jsonl"}))
    assert len(found) == 1 and found[0]["filename"] == "b.jsonl"


def test_wandb_requested_but_not_installed_says_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` fails
    result = run_freetx_here("validate", "llm/tiny", "loggers.wandb.project=X")
    text = flat(result.stdout + result.stderr)
    assert result.returncode != 0
    assert "loggers.wandb" in text and "pip install wandb" in text


def test_wandb_logger_listed_but_not_installed_says_pip_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(ConfigError, match="pip install wandb"):
        build_metric_loggers([{"_component_": "freetx.loggers.WandBLogger"}], str(tmp_path), 1, 0)


def test_loggers_wandb_project_override_is_valid(fake_wandb):
    result = run_freetx_here("validate", "llm/tiny", "loggers.wandb.project=X")
    assert result.returncode == 0, result.stdout + result.stderr


def test_unknown_logger_name_is_refused_with_the_names():
    result = run_freetx_here("validate", "llm/tiny", "loggers.wandbb.project=X")
    assert "did you mean 'loggers.wandb'" in flat(result.stdout + result.stderr)


def test_appending_to_metric_loggers_by_index_names_the_fix():
    cfg = OmegaConf.create({"metric_loggers": [{"_component_": "a"}]})
    with pytest.raises(ConfigError) as e:
        apply_overrides(cfg, ["metric_loggers.1._component_=freetx.loggers.WandBLogger"])
    text = flat(str(e.value))
    assert "list of 1 item" in text and "loggers.wandb.project=NAME" in text
    assert "list index out of range" not in text


# -- data formats: the message names the value, and offers skip only for a minority ----

SHAREGPT_ROW = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
MESSAGES_ROW = {
    "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
}


def write_rows(tmp_path, rows) -> str:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def instruct_error(source: str, **kwargs) -> str:
    with pytest.raises(DataError) as e:
        InstructDataset(
            ByteTokenizer(), seq_len=256, source=source, validation_source=source, **kwargs
        )
    return flat(str(e.value))


@pytest.mark.parametrize(
    ("row", "fix"),
    [
        (SHAREGPT_ROW, "dataset.format=sharegpt"),
        (
            {"conversations": MESSAGES_ROW["messages"]},
            "dataset.format=messages dataset.columns.messages=conversations",
        ),
        ({"instruction": "a", "input": "", "output": "b"}, "dataset.format=alpaca"),
        (
            {"prompt": "a", "completion": "b"},
            "dataset.format=prompt_response dataset.columns.response=completion",
        ),
    ],
)
def test_a_file_of_another_format_names_the_format_value(tmp_path, row, fix):
    message = instruct_error(write_rows(tmp_path, [row] * 6), format="prompt_response")
    assert f"set {fix}" in message


def test_another_format_on_every_row_does_not_suggest_skip(tmp_path):
    message = instruct_error(write_rows(tmp_path, [SHAREGPT_ROW] * 6), format="prompt_response")
    assert "on_bad_row=skip" not in message


def test_a_minority_of_bad_rows_suggests_skip(tmp_path):
    rows = [MESSAGES_ROW] * 9 + [{"messages": []}]
    message = instruct_error(write_rows(tmp_path, rows), format="messages")
    assert "data.jsonl:10" in message and "on_bad_row=skip" in message
    assert "1 of the 10 rows is bad" in message


def test_columnar_source_without_the_format_columns_names_the_format(tmp_path):
    pytest.importorskip("pyarrow")
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"instruction": ["a"] * 4, "output": ["b"] * 4}), path)
    message = instruct_error(str(path), format="prompt_response")
    assert "set dataset.format=alpaca" in message


# -- deterministic: true -------------------------------------------------------------


@pytest.fixture
def torch_flags(monkeypatch):
    """Torch's determinism flags and the environment, put back after the test."""
    import torch

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark)  # fmt: skip
    yield torch
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def test_deterministic_true_sets_torch_cudnn_and_cublas_state(torch_flags):
    import os

    from freetx.training import seed_everything

    torch = torch_flags
    torch.backends.cudnn.benchmark = True
    seed_everything(0, 0, deterministic=True)
    assert torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"


def test_deterministic_false_leaves_torch_nondeterministic(torch_flags):
    from freetx.training import seed_everything

    torch = torch_flags
    seed_everything(0, 0, deterministic=False)
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic


def test_deterministic_env_is_given_to_launched_ranks_and_keeps_the_users(monkeypatch):
    from freetx.training.seed import deterministic_env

    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert deterministic_env(True) == {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert deterministic_env(False) == {}
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert deterministic_env(True) == {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}


def test_deterministic_is_a_top_level_key_of_every_training_config():
    result = run_freetx_here("validate", "llm/tiny", "deterministic=true")
    assert result.returncode == 0, result.stdout + result.stderr
