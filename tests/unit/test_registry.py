"""The registry matches the files, and every shipped config validates."""

import pytest
from omegaconf import OmegaConf

from freetx import registry
from freetx.cli.common import load_recipe
from freetx.config import apply_schema, compose
from freetx.config.schema import check_config
from tests.conftest import REPO


def test_every_config_file_is_registered_once():
    on_disk = sorted(
        str(p.relative_to(registry.configs_dir()).with_suffix(""))
        for p in registry.configs_dir().rglob("*.yaml")
    )
    assert on_disk == sorted(registry.config_names())
    assert len(set(registry.config_names())) == len(registry.config_names())


def test_every_recipe_file_exists_and_declares_its_schema():
    for recipe in registry.RECIPES:
        target = load_recipe(recipe.name)
        assert target.path == registry.recipe_file(recipe)
        assert target.schema is not None
        assert target.supports_distributed == recipe.supports_distributed


@pytest.mark.parametrize("config", registry.config_names())
def test_shipped_config_validates(config):
    recipe = registry.recipe_for_config(config)
    target = load_recipe(recipe.name)
    # configs that start from an HF folder take it (and their data) from the command line
    text = registry.config_file(config).read_text()
    keys = ("model_dir", "teacher_dir", "dataset.source", "checkpoint")
    given = [f"{key}=/path/given/by/the/user" for key in keys
             if f"{key.split('.')[-1]}: ???" in text]  # fmt: skip
    if "rewards: ???" in text:  # and their own reward functions
        given.append("rewards=[{_component_: freetx.objectives.ExactMatch}]")
    cfg = compose(config, given)
    assert check_config(cfg, target.schema) == []
    apply_schema(cfg, target.schema)


@pytest.mark.parametrize("config", registry.config_names())
def test_every_shipped_training_config_writes_tensorboard(config):
    """The README says every run writes tb/: every shipped training config logs to
    TensorBoard (generate configs train nothing; the torchtune-timed workload logs as
    torchtune's does)."""
    if (
        registry.recipe_for_config(config).name in ("generate", "eval")
        or config == "llm/tiny_llama_bench"
    ):
        return
    loggers = OmegaConf.load(registry.config_file(config)).metric_loggers
    assert "freetx.loggers.TensorBoardLogger" in [node["_component_"] for node in loggers]


def test_a_checkout_that_is_not_installed_reads_the_recipes_beside_its_package(monkeypatch):
    """On a machine that cannot install (PYTHONPATH=checkout), freetx.recipes and
    freetx.recipe_configs are not packages; the folders the wheel maps them from are read."""
    real = registry.importlib.util.find_spec
    monkeypatch.setattr(
        registry.importlib.util,
        "find_spec",
        lambda name: None if name in registry.CHECKOUT_DIRS else real(name),
    )
    assert registry.recipes_dir() == REPO / "recipes"
    assert registry.configs_dir() == REPO / "recipe_configs"
    assert registry.config_file("llm/tiny").is_file()
