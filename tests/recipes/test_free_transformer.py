"""The Free Transformer through the CLI: training metrics, then sampling from the checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here, run_refused_here


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    out = tmp_path_factory.mktemp("free_transformer")
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "free_transformer/tiny",
        f"output_dir={out}", "max_steps=40", "log_every_n_steps=20", "eval.every_n_steps=0",
        "eval.max_batches=2", "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return out


@pytest.mark.slow  # the module's trained run: 21 s (make demo trains it too)
def test_training_logs_the_latent_metrics(trained):
    records = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    assert train[-1]["loss"] < train[0]["loss"]
    for key in ("ce", "kl_bits", "honest_nll", "kl_active"):
        assert key in train[-1]
    last = train[-1]
    assert last["honest_nll"] == pytest.approx(
        last["ce"] + last["kl_bits"] * 0.6931471805599453, rel=1e-5
    )
    final = records[-1]
    for key in ("val/ce", "val/prior_ce", "val/honest_nll", "val/kl_bits"):
        assert key in final


@pytest.mark.slow  # the module's trained run: 21 s (make demo trains it too)
def test_generate_samples_with_fixed_z(trained, tmp_path):
    result = run_freetx(
        "run", "generate", "--config", "free_transformer/generate", f"checkpoint={trained}",
        f"output_dir={tmp_path}", "prompts=[B>]", "num_groups=2", "samples_per_group=3",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "block start position: spread within groups sharing Z" in result.stdout
    samples = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and all(s["prompt"] == "B>" and s["reply"] for s in samples)
    stats = json.loads((tmp_path / "sample_metrics.json").read_text())
    assert stats["samples"] == 6


@pytest.mark.slow  # the module's trained run: 21 s (make demo trains it too)
def test_generate_refuses_launch_options(trained):
    result = run_freetx(
        "run", "--nproc-per-node", "2", "generate", "--config", "free_transformer/generate",
        f"checkpoint={trained}",
    )  # fmt: skip
    assert result.returncode == 1 and "one process only" in result.stderr


@pytest.mark.slow  # the module's trained run: 21 s (make demo trains it too)
def test_generation_keeps_each_positions_z(trained):
    """Every forward pass of a generation sees the same codes for the positions it had."""
    import sys

    from freetx.cli.common import load_recipe
    from freetx.config import load_recipe_config

    target = load_recipe("generate")
    module = sys.modules[f"freetx_recipe_{target.path.stem}"]
    cfg = load_recipe_config(
        "free_transformer/generate",
        [
            f"checkpoint={trained}",
            "max_new_tokens=5",
            "samples_per_group=2",
            "posterior_prefill=true",
        ],
        target.schema,
    )
    recipe = module.GenerateRecipe(cfg)  # makes a world-size-1 process group here
    try:
        check_codes_are_kept(recipe)
    finally:
        torch.distributed.destroy_process_group()


def check_codes_are_kept(recipe) -> None:
    recipe.setup()
    seen = []
    forward = recipe.model.forward

    def recording(input_ids, mode="training", codes=None, noise=None):
        seen.append(None if codes is None else codes.clone())
        return forward(input_ids, mode=mode, codes=codes, noise=noise)

    recipe.model.forward = recording
    recipe.sample([recipe.encode("C>")])
    codes = [z for z in seen if z is not None]
    assert len(codes) == 5
    for earlier, later in zip(codes, codes[1:]):
        assert torch.equal(later[:, : earlier.shape[1]], earlier)  # Z_t kept once drawn
    assert torch.equal(codes[-1][0], codes[-1][1])  # fixed_z: the group shares Z


@pytest.mark.slow  # ~35 s: a launch, 3 steps and a sampling run
def test_a_64_bit_latent_trains_and_samples(tmp_path):
    """The factored post-sampler at H = 64 (2^64 codes: none of them is ever enumerated)."""
    out = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", "full_finetune_fsdp2", "--config", "free_transformer/tiny",
        f"output_dir={out}", "model.latent_dim=64", "model.factored_post_sampler=true",
        "max_steps=3", "log_every_n_steps=1", "eval.every_n_steps=3", "eval.max_batches=1",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in records if "loss" in r)
    assert math.isfinite(records[-1]["val/prior_ce"])
    result = run_freetx(
        "run", "generate", "--config", "free_transformer/generate", f"checkpoint={out}",
        f"output_dir={tmp_path / 'samples'}", "prompts=[B>]", "num_groups=1",
        "samples_per_group=2", "max_new_tokens=4", "posterior_prefill=true",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert len((tmp_path / "samples" / "samples.jsonl").read_text().splitlines()) == 2


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_table_above_16_bits_is_refused_before_launch(command, tmp_path):
    out = tmp_path / "run"
    launch = ("--nproc-per-node", "2", "full_finetune_fsdp2", "--config")
    run = run_freetx_here if command == "validate" else run_refused_here
    args = ("validate",) if command == "validate" else launch
    result = run(*args, "free_transformer/tiny", f"output_dir={out}", "model.latent_dim=20")
    assert result.returncode == 1
    output = flat(result.stdout + result.stderr)
    assert "Traceback" not in output
    assert "'model.latent_dim' is 20" in output and "stops at latent_dim=16" in output
    assert "set factored_post_sampler=true" in output
    assert not out.exists()
