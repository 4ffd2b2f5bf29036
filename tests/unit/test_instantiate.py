"""Building `_component_` nodes, and the errors that name the config path."""

import pytest
import torch
from omegaconf import OmegaConf

from freetx.config import check_components, instantiate
from freetx.errors import ConfigError


def make(**nodes):
    return OmegaConf.create(nodes)


def test_builds_with_call_site_args_and_kwargs_override():
    cfg = make(optimizer={"_component_": "torch.optim.SGD", "lr": 0.1, "momentum": 0.5})
    params = [torch.nn.Parameter(torch.zeros(2))]
    opt = instantiate(cfg.optimizer, params, lr=0.01)
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["lr"] == 0.01 and opt.defaults["momentum"] == 0.5


def test_nested_components_are_built_first():
    node = make(
        wrapper={
            "_component_": "torch.nn.ModuleDict",
            "modules": {
                "lin": {"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 3}
            },
        }
    )
    built = instantiate(node.wrapper)
    assert isinstance(built["lin"], torch.nn.Linear) and built["lin"].out_features == 3


def test_unknown_module_names_path_and_import():
    cfg = make(optimizer={"_component_": "toch.optim.AdamW"})
    with pytest.raises(ConfigError) as e:
        instantiate(cfg.optimizer)
    assert "optimizer._component_" in str(e.value) and "toch" in str(e.value)


def test_unknown_attribute_suggests_the_closest():
    cfg = make(optimizer={"_component_": "torch.optim.AdamWW"})
    with pytest.raises(ConfigError) as e:
        instantiate(cfg.optimizer)
    assert "optimizer._component_" in str(e.value)
    assert "did you mean 'torch.optim.AdamW'" in str(e.value)


def test_argument_that_does_not_bind_is_named():
    cfg = make(optimizer={"_component_": "torch.optim.SGD", "lrr": 0.1})
    with pytest.raises(ConfigError) as e:
        instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    msg = str(e.value)
    assert msg.startswith("optimizer:") and "'lrr'" in msg and "did you mean 'lr'" in msg


def test_nested_path_in_errors():
    cfg = make(loggers=[{"_component_": "freetx.loggers.JSONLLogger", "filenam": "x"}])
    problems = check_components(cfg)
    assert (
        len(problems) == 1 and problems[0].startswith("loggers[0]:") and "filename" in problems[0]
    )


def test_missing_dependency_inside_a_module_is_reported(tmp_path, monkeypatch):
    (tmp_path / "needs_missing.py").write_text("import not_installed_pkg_xyz\ndef f(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FREETX_TRUST", "needs_missing")
    cfg = make(thing={"_component_": "needs_missing.f"})
    with pytest.raises(ConfigError, match="not_installed_pkg_xyz"):
        instantiate(cfg.thing)


def test_value_errors_from_the_target_name_the_node():
    cfg = make(optimizer={"_component_": "torch.optim.SGD", "lr": -1.0})
    with pytest.raises(ConfigError, match="optimizer: building torch.optim.SGD failed"):
        instantiate(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])


def test_check_components_reports_all_problems():
    cfg = make(
        a={"_component_": "torch.nn.Linear", "in_featurs": 2, "out_features": 2},
        b={"_component_": "torch.nn.Nope"},
        c={"_component_": "torch.nn.Linear", "in_features": 2, "out_features": 2},
    )
    problems = check_components(cfg)
    assert len(problems) == 2
    assert problems[0].startswith("a:") and problems[1].startswith("b._component_")


def test_a_renamed_module_names_its_new_path():
    cfg = make(logger={"_component_": "freetx.logging.JSONLLogger"})
    with pytest.raises(ConfigError) as e:
        instantiate(cfg.logger)
    assert "freetx.loggers.JSONLLogger" in str(e.value)
