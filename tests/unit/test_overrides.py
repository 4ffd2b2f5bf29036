"""The override grammar of `key=value` arguments, as a table of cases."""

import pytest
from omegaconf import OmegaConf

from freetx.config.loading import apply_overrides, resolve
from freetx.errors import ConfigError, UsageError

BASE = {
    "lr": 0.1,
    "name": "run",
    "model": {"_component_": "freetx.models.a.tiny", "dim": 8},
    "data": {"paths": ["a.txt"], "split": {"valid": 0.1}},
    "steps": 10,
    "total": "${steps}",
}

CASES = [
    # (overrides, key, expected value)
    (["lr=0.5"], "lr", 0.5),
    (["lr=1e-3"], "lr", 1e-3),
    (["steps=20"], "steps", 20),
    (["name=a=b=c"], "name", "a=b=c"),  # split on the first '=' only
    (["name=hello world"], "name", "hello world"),
    (["data.split.valid=0.2"], "data.split.valid", 0.2),
    (["data.paths=[x.txt,y.txt]"], "data.paths", ["x.txt", "y.txt"]),
    (["data.paths[0]=z.txt"], "data.paths", ["z.txt"]),
    (["data.split={valid: 0.3, test: 0.1}"], "data.split", {"valid": 0.3, "test": 0.1}),
    (["new.deep.key=3"], "new.deep.key", 3),
    (["flag=true"], "flag", True),
    (["name=null"], "name", None),
    (["name='007'"], "name", "007"),
    (["lr=0.5", "lr=0.7"], "lr", 0.7),  # later wins
    # component shorthand: swap _component_, keep the other keys
    (["model=freetx.models.b.small"], "model", {"_component_": "freetx.models.b.small", "dim": 8}),
    (["model.dim=16"], "model", {"_component_": "freetx.models.a.tiny", "dim": 16}),
    # a dict value replaces the node
    (["model={_component_: x.y, width: 2}"], "model", {"_component_": "x.y", "width": 2}),
    # interpolations see the override
    (["steps=30"], "total", 30),
]


@pytest.mark.parametrize("overrides,key,expected", CASES)
def test_override_cases(overrides, key, expected):
    cfg = OmegaConf.create(BASE)
    resolve(apply_overrides(cfg, overrides))
    value = OmegaConf.select(cfg, key)
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    assert value == expected


def test_delete_keys():
    cfg = OmegaConf.create(BASE)
    apply_overrides(cfg, ["~lr", "~data.split"])
    assert "lr" not in cfg and "split" not in cfg.data and cfg.data.paths == ["a.txt"]


def test_delete_list_item():
    cfg = OmegaConf.create({"loggers": ["a", "b", "c"]})
    apply_overrides(cfg, ["~loggers[1]"])
    assert list(cfg.loggers) == ["a", "c"]


def test_delete_missing_key_is_an_error():
    with pytest.raises(ConfigError, match="no key 'nope'"):
        apply_overrides(OmegaConf.create(BASE), ["~nope"])


@pytest.mark.parametrize("bad", ["lr", "=3", "~"])
def test_not_an_override(bad):
    with pytest.raises(UsageError, match="not an override"):
        apply_overrides(OmegaConf.create(BASE), [bad])


def test_override_through_a_scalar_is_an_error():
    with pytest.raises(ConfigError, match="lr.x=1"):
        apply_overrides(OmegaConf.create(BASE), ["lr.x=1"])


def test_bad_interpolation_names_the_problem():
    cfg = OmegaConf.create({"a": "${nope}"})
    with pytest.raises(ConfigError, match="interpolation"):
        resolve(cfg)
