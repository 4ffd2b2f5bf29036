"""Issue 36: the banner says where the weights came from, and a config that takes its
model's shape from an HF folder but loads no weights is told so loudly, with the fix."""

from __future__ import annotations

import pytest

from tests.conftest import flat, run_freetx
from tests.recipes.test_hf_finetune import tiny_folder

SHORT = ["max_steps=1", "eval.max_batches=1", "dataset.num_builtin_examples=400"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_folder(tmp_path_factory.mktemp("banner"), "llama3_2")


def finetune(model_dir, output_dir, *overrides):
    result = run_freetx(
        "run", "--nproc-per-node", "1", "full_finetune_fsdp2", "--config", "llm/hf_tiny_full",
        f"model_dir={model_dir}", f"output_dir={output_dir}", *SHORT, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def banner_of(out: str) -> str:
    """The banner line (after the `data:` summary lines)."""
    return next(line for line in out.splitlines() if not line.startswith("data:"))


@pytest.mark.slow  # a 1-process run, ~10 s
def test_a_model_dir_without_initial_weights_trains_random_weights_and_says_so(tmp_path, model_dir):
    out = finetune(model_dir, tmp_path / "run", "checkpoint.initial_weights=null")
    banner = banner_of(out)
    assert "| weights: random init (seed 0) |" in banner
    notice = flat(out)
    assert f"NOTICE: the model's shape comes from the HF folder {model_dir}" in notice
    assert f"set checkpoint.initial_weights={model_dir}" in notice


@pytest.mark.slow  # two 1-process runs, ~20 s
def test_banner_names_the_hf_weights_then_the_checkpoint_resumed_from(tmp_path, model_dir):
    run = tmp_path / "run"
    first = finetune(model_dir, run)
    assert f"| weights: {model_dir} (HF safetensors) |" in banner_of(first)
    assert "NOTICE" not in first
    resumed = finetune(model_dir, run, "max_steps=2")
    checkpoint = run / "checkpoints" / "step_000001"
    assert f"| weights: resumed from {checkpoint} |" in banner_of(resumed)
    assert "NOTICE" not in resumed


def test_banner_has_no_weights_part_when_not_given():
    """A recipe's banner without the weights' origin (an older caller) keeps its shape."""
    from types import SimpleNamespace

    from freetx.distributed import MeshShape
    from freetx.loggers import training_banner

    mp = SimpleNamespace(param_dtype="float32", reduce_dtype="float32")
    cfg = SimpleNamespace(
        batch_size=4, gradient_accumulation_steps=1,
        distributed=SimpleNamespace(mixed_precision=mp),
    )  # fmt: skip
    runtime = SimpleNamespace(world_size=1, device="cpu", backend="gloo")
    shape = MeshShape("ddp", dp_replicate=1)
    assert "weights" not in training_banner("r", runtime, shape, cfg)
    with_it = training_banner("r", runtime, shape, cfg, weights="random init (seed 3)")
    assert with_it.endswith("| weights: random init (seed 3)")


def test_a_model_dir_without_initial_weights_gets_the_notice_naming_the_fix(tmp_path):
    from freetx.training.lifecycle import random_weights_notice

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    node = {"_component_": "freetx.models.hf_model", "path": str(folder)}
    notice = random_weights_notice(node, loads_weights=False, seed=7)
    assert notice.startswith(f"NOTICE: the model's shape comes from the HF folder {folder}")
    assert "random weights (seed 7)" in notice
    assert f"set checkpoint.initial_weights={folder}" in notice
    # weights loaded, or a shape not from a folder: nothing to say
    assert random_weights_notice(node, loads_weights=True, seed=7) is None
    preset = {"_component_": "freetx.models.transformer.decoder", "preset": "tiny"}
    assert random_weights_notice(preset, loads_weights=False, seed=7) is None
    assert random_weights_notice({"path": str(tmp_path / "none")}, False, 7) is None
