"""One layout check (`freetx.training.check_layout`): what a run refuses before its first
step, `freetx validate`, `freetx run` (before it launches a process), `freetx launch` and
`freetx estimate` refuse alike, with the same paragraph."""

from __future__ import annotations

import pytest

from tests.conftest import flat, run_freetx_here, run_refused_here

REFUSED = [
    (["distributed.strategy=ddp", "distributed.cpu_offload=true"], "works with fsdp, zero2"),
    (["distributed.strategy=hsdp", "distributed.replicate_degree=3"], "does not divide"),
    (["batch_size=10"], "cannot be split into 4 rank(s)"),
]


@pytest.mark.parametrize("overrides,fragment", REFUSED)
def test_validate_and_launch_refuse_what_a_4_process_run_refuses(tmp_path, overrides, fragment):
    checked = run_freetx_here("validate", "llm/tiny", "--world-size", "4", *overrides)
    assert checked.returncode == 1 and fragment in flat(checked.stdout), checked.stdout
    script = tmp_path / "job.sbatch"
    launched = run_freetx_here("launch", "slurm", "--nodes", "2", "--nproc-per-node", "2",
                               "-o", str(script), "full_finetune_fsdp2", "--config", "llm/tiny",
                               *overrides)  # fmt: skip
    assert launched.returncode == 1 and fragment in flat(launched.stderr), launched.stderr
    assert not script.exists()


def test_run_refuses_before_it_launches_a_process(tmp_path):
    result = run_refused_here("--nproc-per-node", "3", "full_finetune_fsdp2", "--config",
                              "llm/tiny", f"output_dir={tmp_path}")  # fmt: skip
    assert result.returncode == 1 and "cannot be split into 3 rank(s)" in flat(result.stderr)
    assert not (tmp_path / "config.yaml").exists()


def test_validate_without_a_world_size_checks_what_it_can():
    assert run_freetx_here("validate", "llm/tiny").returncode == 0
    bad = run_freetx_here("validate", "llm/tiny", "distributed.strategy=zero1",
                          "distributed.cpu_offload=true")  # fmt: skip
    assert bad.returncode == 1 and "cpu_offload works with" in flat(bad.stdout)


def test_estimate_shows_no_row_a_run_would_refuse():
    result = run_freetx_here("estimate", "llm/small", "--world-size", "4", "--replicas", "3",
                             "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = [line.split()[0] for line in result.stdout.splitlines() if line[:1].isalpha()]
    assert "fsdp" in rows and "hsdp" not in rows
    assert "hsdp: not estimated" in result.stdout and "does not divide" in result.stdout
    fp16 = run_freetx_here("estimate", "llm/small", "--world-size", "4", "--device", "cpu",
                           "distributed.mixed_precision.param_dtype=float16")  # fmt: skip
    assert fp16.returncode == 0, fp16.stderr
    assert "not estimated" not in fp16.stdout  # float16 works with every strategy
    rows = [line.split()[0] for line in fp16.stdout.splitlines() if line[:1].isalpha()]
    assert {"ddp", "zero1", "zero2", "fsdp", "hsdp"} <= set(rows)


@pytest.mark.parametrize("flag", ["--world-size", "--replicas"])
def test_estimate_refuses_a_count_below_one(flag):
    result = run_freetx_here("estimate", "llm/small", flag, "0")
    assert result.returncode == 2 and "0 is less than 1" in result.stderr


@pytest.mark.parametrize(
    "config,overrides,fragment",
    [
        ("llm/tiny", ["checkpoint.final_export=peft"], "writes LoRA adapters, and this run trains none"),
        ("llm/lora_tiny", ["checkpoint.final_export=hf"], "checkpoints hold only what it trains"),
        ("free_transformer/tiny", ["checkpoint.final_export=hf"], "FreeTransformer has none"),
        ("llm/tiny", ["checkpoint.final_export=hf", "checkpoint.save_final=false"], "saves none"),
        ("llm/tiny", ["checkpoint.final_export=onnx"], "must be one of 'hf', 'peft', 'safetensors', 'auto'"),
    ],
)  # fmt: skip
def test_a_final_export_the_run_cannot_write_is_refused_by_validate(config, overrides, fragment):
    checked = run_freetx_here("validate", config, *overrides)
    assert checked.returncode == 1 and fragment in flat(checked.stdout), checked.stdout
    assert "Traceback" not in checked.stdout + checked.stderr


def test_run_refuses_a_final_export_before_it_trains(tmp_path):
    result = run_refused_here("full_finetune_fsdp2", "--config", "llm/tiny",
                              f"output_dir={tmp_path}", "checkpoint.final_export=peft")  # fmt: skip
    assert result.returncode == 1 and "Set peft.method=lora" in flat(result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "config.yaml").exists() and not (tmp_path / "checkpoints").exists()


def test_final_export_auto_follows_what_the_run_trains():
    """auto: LoRA adapters -> peft, the whole model -> hf (safetensors for a model without an
    HF layout), Spectrum's trained part alone -> none: hf_tiny_grpo's `~peft` exports hf."""
    from types import SimpleNamespace

    from freetx.models.free_transformer import FreeTransformer
    from freetx.models.transformer import Transformer
    from freetx.training.export import check_final_export

    def export(method: str, model_class) -> str | None:
        checkpoint = SimpleNamespace(final_export="auto", save_final=True)
        return check_final_export(
            SimpleNamespace(checkpoint=checkpoint, peft=SimpleNamespace(method=method)),
            model_class,
        )

    assert export("lora", Transformer) == "peft" and export("none", Transformer) == "hf"
    assert export("none", FreeTransformer) == "safetensors" and export("none", None) == "hf"
    assert export("spectrum", Transformer) is None
    for peft in ("peft.method=none", "peft.method=lora"):
        checked = run_freetx_here("validate", "llm/tiny", "checkpoint.final_export=auto", peft)
        assert checked.returncode == 0, checked.stdout
