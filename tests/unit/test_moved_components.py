"""Components freetx moved (the losses and rewards from freetx.training to freetx.objectives):
a config naming the old path builds the same object, and a resume compares the two names as
one; a key a schema gained since a save, at its default, is no change on resume."""

from __future__ import annotations

from freetx.config.compare import resume_changes, schema_defaults
from freetx.config.instantiate import import_component, instantiate
from freetx.objectives import DistillationLoss, ExactMatch, GRPOLoss, PreferenceLoss


def test_the_old_paths_build_the_moved_classes():
    for old, cls in [("freetx.training.PreferenceLoss", PreferenceLoss),
                     ("freetx.training.GRPOLoss", GRPOLoss),
                     ("freetx.training.distillation.DistillationLoss", DistillationLoss),
                     ("freetx.training.ExactMatch", ExactMatch)]:  # fmt: skip
        assert import_component(old, "loss") is cls
    built = instantiate({"_component_": "freetx.training.PreferenceLoss", "beta": 0.2})
    assert isinstance(built, PreferenceLoss) and built.beta == 0.2


def test_a_resume_compares_an_old_path_with_its_new_one_as_equal():
    saved = {"loss": {"_component_": "freetx.training.GRPOLoss", "beta": 0.0},
             "rewards": [{"_component_": "freetx.training.ExactMatch"}]}  # fmt: skip
    now = {"loss": {"_component_": "freetx.objectives.GRPOLoss", "beta": 0.0},
           "rewards": [{"_component_": "freetx.objectives.ExactMatch"}]}  # fmt: skip
    assert resume_changes(saved, now, ("loss", "rewards")) == ([], [])
    moved = {**now, "loss": {"_component_": "freetx.objectives.PreferenceLoss", "beta": 0.0}}
    assert resume_changes(saved, moved, ("loss",))[1]  # another class is still a change


def test_a_key_the_schema_gained_is_no_change_at_its_default_and_refused_otherwise():

    from recipes.dpo_fsdp2 import DPOConfig

    defaults = schema_defaults(DPOConfig)
    assert defaults["qat.scheme"] == "none"
    saved = {"seed": 0, "peft": {"method": "none"}}  # saved before dpo_fsdp2 had `qat:`
    now = {"seed": 0, "peft": {"method": "none"},
           "qat": {"scheme": "none", "group_size": 32, "start_step": 0}}  # fmt: skip
    assert resume_changes(saved, now, ("qat", "peft"), defaults) == ([], [])
    now["qat"]["scheme"] = "int8_dynamic_act_int4_weight"
    assert resume_changes(saved, now, ("qat", "peft"), defaults)[1] == [
        "qat.scheme: '(unset)' -> 'int8_dynamic_act_int4_weight'"
    ]
