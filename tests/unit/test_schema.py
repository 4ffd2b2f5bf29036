"""Schema checks: typos with suggestions, types, Literal choices, required keys."""

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import ConfigAttributeError

from freetx.config import apply_schema, check_config
from freetx.errors import ConfigError


@dataclass
class Section:
    every_n_steps: int = 100
    keep_last: Optional[int] = None


@dataclass
class Schema:
    output_dir: str = MISSING
    max_steps: int = 10
    lr: float = 1e-3
    strategy: Literal["fsdp", "ddp"] = "fsdp"
    tags: list[str] = field(default_factory=list)
    checkpoint: Section = field(default_factory=Section)
    optimizer: Any = None


def problems_of(**values):
    return check_config(OmegaConf.create({"output_dir": "x", **values}), Schema)


def test_clean_config_has_no_problems():
    assert problems_of(max_steps=3, lr=1, tags=["a"], checkpoint={"keep_last": 2}) == []


def test_misspelt_key_suggests_the_valid_one():
    (problem,) = problems_of(max_stpes=10)
    assert "max_stpes" in problem and "did you mean 'max_steps'" in problem


def test_misspelt_nested_key_suggests_with_path():
    (problem,) = problems_of(checkpoint={"evry_n_steps": 5})
    assert "checkpoint.evry_n_steps" in problem and "'checkpoint.every_n_steps'" in problem


def test_key_at_the_wrong_level_points_to_its_section():
    (problem,) = problems_of(keep_last=3)
    assert "did you mean 'checkpoint.keep_last'" in problem


@pytest.mark.parametrize(
    "values,fragment",
    [
        ({"max_steps": "ten"}, "'max_steps' must be int"),
        ({"max_steps": 1.5}, "'max_steps' must be int"),
        ({"lr": "fast"}, "'lr' must be float"),
        ({"strategy": "fsdpp"}, "'strategy' must be one of 'fsdp', 'ddp'"),
        ({"tags": "a"}, "'tags' must be a list"),
        ({"checkpoint": {"keep_last": "all"}}, "'checkpoint.keep_last' must be int or null"),
    ],
)
def test_wrong_types(values, fragment):
    (problem,) = problems_of(**values)
    assert fragment in problem


def test_missing_required_key():
    problems = check_config(OmegaConf.create({}), Schema)
    assert problems == ["missing required key 'output_dir' (str)."]


def test_all_problems_at_once():
    problems = problems_of(max_stpes=1, lr="x", strategy="y", optimizer={"_component_": "nope.x"})
    assert len(problems) == 4


def test_apply_schema_fills_defaults_and_is_strict():
    cfg = apply_schema(OmegaConf.create({"output_dir": "x", "lr": 1}), Schema)
    assert cfg.max_steps == 10 and cfg.checkpoint.every_n_steps == 100
    assert isinstance(cfg.lr, float)
    with pytest.raises(ConfigAttributeError):
        _ = cfg.not_a_key


def test_config_error_lists_every_problem():
    err = ConfigError(["one", "two"], fix="Fix them.")
    assert "2 problems" in str(err) and "  - one" in str(err) and str(err).endswith("Fix them.")
