"""`distributed.tp`, `cp` and `pp` through the CLI, on 4 processes: llm/tiny on (dp 2,
tp 2), (dp 2, cp 2) and (cp 2, tp 2) meshes, and llm/tiny_pp on (pp 2, dp 2) by 1F1B and
interleaved 1F1B, repeat one process's losses step by step (20 steps); so does a
Qwen3-MoE folder under (pp 2, dp 2), (dp 2, cp 2), (dp 2, tp 2) and (cp 2, tp 2), and
LoRA at tp 2, and hsdp's replicas with tp, cp and pp; a pipeline run's final export holds the
whole model; a checkpoint saved under one layout resumes under another and on one process; packed data under cp 2 gives one
process's losses; an impossible layout is refused in one paragraph before any work."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import one_paragraph, run_freetx

QUIET = ["metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]", "log_every_n_steps=1",
         "dataset.seq_len=64", "batch_size=8", "eval.max_batches=1", "eval.batch_size=8"]  # fmt: skip
# llm/tiny_tp is llm/tiny at tp 2 (the twin of llm/llama3_70b_full's layout)
LAYOUTS = {"dp2_tp2": ["--config", "llm/tiny_tp"], "dp2_cp2": ["distributed.cp=2"],
           "cp2_tp2": ["distributed.cp=2", "distributed.tp=2"]}  # fmt: skip


def losses(output_dir, nproc: int, *overrides: str, config: str = "llm/tiny") -> dict[int, float]:
    """The losses by step of a run; `--config NAME` among `overrides` picks another config."""
    if "--config" in overrides:
        at = overrides.index("--config")
        config, overrides = overrides[at + 1], overrides[:at] + overrides[at + 2 :]
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "full_finetune_fsdp2", "--config", config,
        f"output_dir={output_dir}", *QUIET, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def assert_same(got: dict[int, float], want: dict[int, float], steps) -> None:
    for step in steps:
        assert abs(got[step] - want[step]) <= 1e-5, (step, got[step], want[step])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return losses(out, 1, "max_steps=20", "checkpoint.every_n_steps=0")


@pytest.mark.slow  # a 20-step run of 4 processes per layout: ~25 s each on 2 cores
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_repeats_one_process(tmp_path, one_process, layout):
    got = losses(tmp_path, 4, "max_steps=20", "checkpoint.every_n_steps=0", *LAYOUTS[layout])
    assert got.keys() == one_process.keys() == set(range(1, 21))
    assert_same(got, one_process, range(1, 21))


PIPELINES = {"1f1b": [], "interleaved_1f1b": ["distributed.pp_schedule=interleaved_1f1b",
                                              "distributed.pp_stages_per_rank=2"]}  # fmt: skip


@pytest.fixture(scope="module")
def one_process_pp(tmp_path_factory):
    """llm/tiny_pp (untied head, 2 micro-batches per step) on one process."""
    out = tmp_path_factory.mktemp("one_pp")
    return losses(out, 1, "max_steps=20", "checkpoint.every_n_steps=0", "distributed.pp=1",
                  config="llm/tiny_pp")  # fmt: skip


@pytest.mark.slow  # a 20-step run of 4 processes per schedule: ~30 s each on 2 cores
@pytest.mark.parametrize("schedule", list(PIPELINES))
def test_pipeline_stages_repeat_one_process(tmp_path, one_process_pp, schedule):
    """llm/tiny_pp: pp 2 x dp 2, validation through the stages too."""
    got = losses(tmp_path, 4, "max_steps=20", "checkpoint.every_n_steps=0", "eval.every_n_steps=10",
                 *PIPELINES[schedule], config="llm/tiny_pp")  # fmt: skip
    assert_same(got, one_process_pp, range(1, 21))
    val = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in val if "val/loss" in r] == [10, 20]


@pytest.mark.slow  # ~1.5 minutes on 2 cores
def test_a_pipeline_save_resumes_on_one_process_and_under_tensor_parallelism(
    tmp_path, one_process_pp
):
    saved = tmp_path / "saved"
    losses(saved, 4, "max_steps=10", "checkpoint.every_n_steps=10",
           "checkpoint.final_export=safetensors", config="llm/tiny_pp")  # fmt: skip
    exported_holds_the_whole_model(saved)  # from the stages' checkpoint
    shutil.copytree(saved, tmp_path / "tp")
    tp = losses(tmp_path / "tp", 4, "max_steps=20", "checkpoint.every_n_steps=0",
                "distributed.pp=1", "distributed.tp=2", config="llm/tiny_pp")  # fmt: skip
    assert_same(tp, one_process_pp, range(1, 21))
    alone = losses(saved, 1, "max_steps=20", "checkpoint.every_n_steps=0", "distributed.pp=1",
                   config="llm/tiny_pp")  # fmt: skip
    assert_same(alone, one_process_pp, range(1, 21))
    # and the other way: saved by one process, resumed by the stages (each loads its part)
    single = tmp_path / "single"
    losses(single, 1, "max_steps=10", "checkpoint.every_n_steps=10", "distributed.pp=1",
           config="llm/tiny_pp")  # fmt: skip
    staged = losses(single, 4, "max_steps=20", "checkpoint.every_n_steps=0", config="llm/tiny_pp")
    assert_same(staged, one_process_pp, range(1, 21))


HSDP = ["distributed.strategy=hsdp", "distributed.replicate_degree=2"]


@pytest.mark.slow  # 4 runs of 4 processes, 10 or 20 steps: ~1.5 minutes on 2 cores
def test_hsdp_replicas_compose_with_every_axis_and_resume_across_them(
    tmp_path, one_process, one_process_pp
):
    """hsdp's 2 replicas as the data-parallel axis, each sharded over its own ranks, with
    tp 2 (saved at step 10), then cp 2 (resumed from it), and pp 2 (llm/tiny_pp): one
    process's losses; the hsdp x tp save resumes on one process too."""
    saved = tmp_path / "hsdp_tp"
    tp = losses(saved, 4, "max_steps=10", "checkpoint.every_n_steps=10", *HSDP, "distributed.tp=2")
    assert_same(tp, one_process, range(1, 11))
    shutil.copytree(saved, tmp_path / "hsdp_cp")
    cp = losses(tmp_path / "hsdp_cp", 4, "max_steps=20", "checkpoint.every_n_steps=0", *HSDP,
                "distributed.cp=2")  # fmt: skip
    assert_same(cp, one_process, range(11, 21))
    alone = losses(saved, 1, "max_steps=20", "checkpoint.every_n_steps=0")
    assert_same(alone, one_process, range(11, 21))
    pp = losses(tmp_path / "hsdp_pp", 4, "max_steps=20", "checkpoint.every_n_steps=0", *HSDP,
                config="llm/tiny_pp")  # fmt: skip
    assert_same(pp, one_process_pp, range(1, 21))


@pytest.mark.slow  # a Qwen3-MoE folder, 6 runs of 8 steps: ~1.5 minutes on 2 cores
def test_an_moe_folder_under_every_layout_repeats_one_process(tmp_path):
    """Its router loss over every stage's statistics (pp), over the whole sequence (cp),
    from the same whole tokens on every tp rank (tp)."""
    pytest.importorskip("transformers")
    from tests.hf_folders import RANDOM_WEIGHTS_LR
    from tests.recipes.test_hf_finetune import tiny_folder

    folder = tiny_folder(tmp_path, "qwen3_moe")
    moe = ["--config", "llm/hf_tiny_full", f"model_dir={folder}", RANDOM_WEIGHTS_LR,
           "max_steps=8", "checkpoint.every_n_steps=0", "dataset.num_builtin_examples=400",
           "gradient_accumulation_steps=2"]  # fmt: skip
    # the router loss is a micro-batch's: one process takes the data-parallel ranks'
    # micro-batches one after another (the same rows in each)
    one = {dp: losses(tmp_path / f"one{dp}", 1, *moe, f"gradient_accumulation_steps={2 * dp}")
           for dp in (1, 2)}  # fmt: skip
    layouts = {"pp2_dp2": (2, ["distributed.pp=2"]), "dp2_cp2": (2, ["distributed.cp=2"]),
               "dp2_tp2": (2, ["distributed.tp=2"]),
               "cp2_tp2": (1, ["distributed.cp=2", "distributed.tp=2"])}  # fmt: skip
    for name, (dp, layout) in layouts.items():
        got = losses(tmp_path / name, 4, *moe, *layout)
        assert_same(got, one[dp], range(1, 9))


@pytest.mark.slow  # two runs of llm/tiny_cp: ~40 s on 2 cores
def test_packed_documents_under_cp_repeat_one_process(tmp_path):
    """llm/tiny_cp (the twin of llm/llama3_1_8b_128k: packed documents, dp 2 x cp 2,
    full activation checkpointing, the loss in 2 chunks) against itself at cp 1."""
    packed = ["max_steps=8", "checkpoint.every_n_steps=0"]
    one = losses(tmp_path / "one", 1, *packed, "distributed.cp=1", config="llm/tiny_cp")
    split = losses(tmp_path / "cp", 4, *packed, config="llm/tiny_cp")
    assert_same(split, one, range(1, 9))


@pytest.mark.slow  # a 4-process launch: make test's budget
def test_heads_that_tp_does_not_divide_are_refused_before_training(tmp_path):
    result = run_freetx(
        "run", "--nproc-per-node", "4", "full_finetune_fsdp2", "--config", "llm/tiny",
        f"output_dir={tmp_path / 'run'}", "distributed.tp=4", "max_steps=2", *QUIET,
    )  # fmt: skip
    message = one_paragraph(result)
    assert "tp=4 does not divide the model's 6 attention heads and 2 key/value heads" in message
    assert "Pick a tp that divides both" in message
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow  # a base, then LoRA on 1 and on 4 processes: ~1 minute on 2 cores
def test_lora_under_tensor_parallelism_repeats_one_process(tmp_path):
    """llm/lora_tiny at tp 2 (the twin of llm/llama3_70b_lora's layout): the frozen base and
    each adapter sliced with its layer, FSDP2 over the other 2 ranks."""
    base = tmp_path / "base"
    losses(base, 1, "max_steps=4", "checkpoint.every_n_steps=4")
    lora = ["--config", "llm/lora_tiny", f"model_dir={base}", "max_steps=10",
            "checkpoint.every_n_steps=0", "peft.dropout=0"]  # dropout's draws follow the ranks  # fmt: skip
    one = lora_losses(tmp_path / "one", 1, *lora)
    sliced = lora_losses(tmp_path / "tp", 4, *lora, "distributed.tp=2")
    assert_same(sliced, one, range(1, 11))


def exported_holds_the_whole_model(run) -> None:
    """A run's final safetensors export loads into the whole model (every tensor, no other)."""
    import torch

    from freetx.checkpoint import load_initial_weights
    from freetx.distributed import materialize
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model = decoder("tiny", vocab_size=259, max_seq_len=256, tie_embeddings=False)
    materialize(model, torch.device("cpu"), seed=1)
    exported = next((run / "export" / "safetensors").rglob("*.safetensors"))
    load_initial_weights(model, exported)  # refuses a missing or an unexpected tensor


def lora_losses(output_dir, nproc: int, *overrides: str) -> dict[int, float]:
    """`losses` of lora_finetune_fsdp2 (the same loop; the peft section picks what trains)."""
    at = overrides.index("--config")
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "lora_finetune_fsdp2", *overrides[at : at + 2],
        f"output_dir={output_dir}", *QUIET, *overrides[:at], *overrides[at + 2 :],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}
