"""kd_fsdp2 through the CLI: 2 processes (fsdp) give 1 process's losses; a teacher of
another vocabulary is refused before any work, naming both; validate refuses a pipeline
and a precomputed teacher with a divergence its top-k cannot give; a precomputed teacher
of the whole vocabulary gives the live teacher's losses, is read back by a second run and
refused by a third once a byte of it flipped; llm/hf_tiny_kd between two HF folders, exported.
On-policy (llm/on_policy_kd_tiny): a run that mixes on- and off-policy steps gives the same
losses and validation on 1 process and 2, and resumed from its checkpoint; validate refuses
the student's samples with a precomputed teacher, packing or cp."""

from __future__ import annotations

import json
import shutil

import pytest

from tests.conftest import flat, flip_byte, one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import make_folder

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
# a random student and a random teacher (seed 0): no teacher run is needed
RANDOM = ["teacher.weights=null", "checkpoint.initial_weights=null",
          "dataset.num_builtin_examples=400", "eval.every_n_steps=0",
          "eval.max_batches=1", "log_every_n_steps=1", "checkpoint.every_n_steps=0",
          "batch_size=8", "eval.batch_size=8", "lr_schedule.warmup_steps=0", JSONL]  # fmt: skip


def logged(output_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def kd(tmp_path, name, *overrides, nproc=1, config="llm/kd_tiny"):
    out = tmp_path / name
    args = ["run"] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    result = run_freetx(*args, "kd_fsdp2", "--config", config, f"output_dir={out}",
                        *RANDOM, *overrides)  # fmt: skip
    return out, result


def test_a_teacher_of_another_vocabulary_is_refused_naming_both(tmp_path):
    out, result = kd(tmp_path, "vocab", "max_steps=1", "teacher.model.vocab_size=300")
    text = one_paragraph(result)
    assert "259" in text and "300" in text and "ByteTokenizer" in text
    assert not list(out.glob("checkpoints/step_*"))  # before any work


def test_validate_refuses_a_pipeline():
    result = run_freetx_here("validate", "llm/kd_tiny", "distributed.pp=2")
    assert result.returncode != 0
    assert "kd_fsdp2 runs no pipeline" in flat(result.stdout + result.stderr)


MIXTURE = ("dataset={_component_: freetx.data.Mixture, names: [tasks, text], weights: [3, 1], "
           "num_samples: 64, sources: [{_component_: freetx.data.InstructDataset, source: "
           "builtin, seq_len: 64, num_builtin_examples: 200, val_fraction: 0.05}, "
           "{_component_: freetx.data.PackedTextDataset, source: builtin, seq_len: 64, "
           "val_fraction: 0.05}]}")  # fmt: skip


@pytest.mark.slow  # 2 runs of 3 steps on 1 and 2 processes
def test_two_processes_give_one_process_losses_on_a_mixture_with_each_sources(tmp_path):
    """On a `freetx.data.Mixture`, whose sources reach the loss and not the models (they
    once ended in a raw TypeError in the student's forward): `loss/<source>` and
    `val/loss/<source>` logged, the same on 1 process and on 2."""
    mixture = ["~dataset", MIXTURE, "max_steps=3", "eval.every_n_steps=3"]
    one_out, one_result = kd(tmp_path, "one", *mixture)
    assert one_result.returncode == 0, one_result.stdout[-3000:] + one_result.stderr[-3000:]
    two_out, two_result = kd(tmp_path, "two", *mixture, nproc=2)
    assert two_result.returncode == 0, two_result.stdout[-3000:] + two_result.stderr[-3000:]
    one, two = logged(one_out), logged(two_out)
    for step in (1, 2, 3):
        for key in one[step].keys() & {"loss", "ce", "kd", "loss/tasks", "loss/text"}:
            assert abs(one[step][key] - two[step][key]) <= 1e-5, (step, key, one, two)
        assert one[step].keys() & {"loss/tasks", "loss/text"} == two[step].keys() & {
            "loss/tasks", "loss/text"}  # fmt: skip
    sources = {k for r in one.values() for k in r if k.startswith("loss/")}
    assert sources == {"loss/tasks", "loss/text"}  # over the steps
    assert one[1]["kd"] > 0 and one[3]["loss"] < one[1]["loss"]
    rows = [json.loads(line) for line in (two_out / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in rows if "val/ce" in r][-1]
    assert val["val/loss/tasks"] > 0 and val["val/loss/text"] > 0


def test_validate_refuses_a_precomputed_teacher_with_reverse_kl():
    result = run_freetx_here(
        "validate", "llm/kd_tiny", "teacher.precompute=top_k", "loss.divergence=reverse_kl"
    )
    assert result.returncode != 0
    text = flat(result.stdout + result.stderr)
    assert "teacher.precompute=top_k" in text and "loss.divergence=forward_kl" in text


@pytest.mark.slow  # 4 runs of 3 steps
def test_a_precomputed_teacher_of_the_whole_vocabulary_gives_the_live_teachers_losses(tmp_path):
    live_out, live = kd(tmp_path, "live", "max_steps=3")
    assert live.returncode == 0, live.stdout[-3000:] + live.stderr[-3000:]
    pre_out, pre = kd(tmp_path, "pre", "max_steps=3", "teacher.precompute=top_k",
                      "teacher.top_k=259", nproc=2)  # fmt: skip
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
    assert "samples computed in" in pre.stdout
    for step in (1, 2, 3):
        for key in ("loss", "ce", "kd"):
            assert abs(logged(live_out)[step][key] - logged(pre_out)[step][key]) <= 1e-5, key
    # under tensor parallelism the top-k is taken over the joined vocabulary slices
    tp_out, tp = kd(tmp_path, "tp", "max_steps=3", "teacher.precompute=top_k",
                    "teacher.top_k=259", "distributed.tp=2", nproc=2)  # fmt: skip
    assert tp.returncode == 0, tp.stdout[-3000:] + tp.stderr[-3000:]
    for key in ("loss", "ce", "kd"):
        assert abs(logged(live_out)[3][key] - logged(tp_out)[3][key]) <= 1e-5, key
    # a second run finds the table made for the same data, k and teacher
    again_out, again = kd(tmp_path, "pre", "max_steps=4", "teacher.precompute=top_k",
                          "teacher.top_k=259", "resume=auto")  # fmt: skip
    assert again.returncode == 0 and "read from" in again.stdout, again.stdout[-3000:]
    # a flipped byte in the table is refused, as a checkpoint's, before any training
    table = pre_out / "teacher_topk" / "train.safetensors"
    flip_byte(table, at=table.stat().st_size - 5)
    _, flipped = kd(tmp_path, "pre", "max_steps=5", "teacher.precompute=top_k",
                    "teacher.top_k=259", "resume=auto")  # fmt: skip
    assert "train.safetensors is damaged: its bytes differ from what was saved" in one_paragraph(
        flipped
    )


def two_folders(tmp_path):
    """A tiny llama student's HF folder and a teacher's of other weights, one tokenizer."""
    from tests.recipes.test_hf_finetune import tiny_folder

    student = tiny_folder(tmp_path / "student", "llama3_2")
    teacher = make_folder(tmp_path / "teacher", "llama3_2", seed=1)
    shutil.copy(student / "tokenizer.json", teacher / "tokenizer.json")
    shutil.copy(student / "tokenizer_config.json", teacher / "tokenizer_config.json")
    return student, teacher


@pytest.mark.slow  # 2 processes, 3 steps of two tiny HF folders
def test_hf_tiny_kd_distills_with_qat_between_two_hf_folders_and_exports(tmp_path):
    from tests.slow.test_decoder_setup_runs import SCHEME, assert_loads_as_freetx

    student, teacher = two_folders(tmp_path)
    out = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", "kd_fsdp2", "--config", "llm/hf_tiny_kd",
        f"model_dir={student}", f"teacher_dir={teacher}", f"output_dir={out}", "max_steps=3",
        "eval.every_n_steps=0", "eval.max_batches=1", "log_every_n_steps=1",
        "dataset.num_builtin_examples=200", "dataset.seq_len=64", JSONL,
        f"qat.scheme={SCHEME}",  # the student fake-quantized, exported quantized too
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = logged(out)
    assert rows[1]["kd"] > 0 and all(r["loss"] == r["loss"] for r in rows.values())
    transformers = pytest.importorskip("transformers")
    transformers.AutoModelForCausalLM.from_pretrained(out / "export" / "hf")  # it loads
    assert f"quantized ({SCHEME}" in result.stdout  # QAT's export, as every decoder recipe's
    assert_loads_as_freetx(out / "export" / "quantized")


def test_validate_refuses_the_students_samples_with_a_precomputed_teacher():
    result = run_freetx_here("validate", "llm/on_policy_kd_tiny", "teacher.weights=null",
                             "checkpoint.initial_weights=null", "teacher.precompute=top_k")  # fmt: skip
    assert result.returncode != 0
    text = flat(result.stdout + result.stderr)
    assert "samples from the student" in text and "teacher.precompute=none" in text, text


@pytest.mark.parametrize(
    "override, named",
    [
        ("dataset.packed=true", "dataset.packed=false"),
        ("distributed.cp=2", "distributed.cp=1"),
        ("dataset={_component_: freetx.data.PackedTextDataset, source: builtin, seq_len: 64}",
         "freetx.data.InstructDataset"),
        ("dataset={_component_: freetx.data.Mixture, names: [tasks], weights: [1], "
         "num_samples: 64, sources: [{_component_: freetx.data.InstructDataset, source: "
         "builtin, seq_len: 64, packed: true}]}", "each source's packed=false"),
        ("on_policy.engine.kv_blocks=1", "Raise on_policy.engine.kv_blocks"),
    ],
)  # fmt: skip
def test_the_students_samples_are_refused_where_they_cannot_run(override, named):
    """What validate and the run check (`refuse_combinations`), in this process."""
    from freetx.cli.common import load_recipe
    from freetx.config.run_config import load_recipe_config
    from freetx.errors import ConfigError

    replaced = ["~dataset", override] if override.startswith("dataset=") else [override]
    schema = load_recipe("kd_fsdp2").schema
    given = ["teacher.weights=null", "checkpoint.initial_weights=null", *replaced]
    cfg = load_recipe_config("llm/on_policy_kd_tiny", given, schema)
    with pytest.raises(ConfigError) as refused:
        cfg.refuse_combinations()
    assert named in flat(str(refused.value)), refused.value


@pytest.mark.slow  # 4 runs of 2-4 steps, sampling on each on-policy step
def test_on_policy_steps_give_one_process_losses_on_two_and_resume_exactly(tmp_path):
    """lmbda 0.5: steps 1-3 sample (the coin keyed by seed 0 and the step), step 4 reads the
    data's answers; the samples are keyed by row, so 2 processes train on the same rows as 1,
    and a run resumed at step 2 (on the other world size) goes on as the whole run did."""
    # a constant LR: the schedule does not depend on max_steps (the part run stops at 2)
    mix = ["on_policy.lmbda=0.5", "lr_schedule.decay=constant", "max_steps=4",
           "eval.every_n_steps=4"]  # fmt: skip
    one_out, one = kd(tmp_path, "one", *mix, config="llm/on_policy_kd_tiny")
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two_out, two = kd(tmp_path, "two", *mix, nproc=2, config="llm/on_policy_kd_tiny")
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    half = [*mix[:2], "max_steps=2", "checkpoint.every_n_steps=2", "eval.every_n_steps=0"]
    part_out, part = kd(tmp_path, "part", *half, nproc=2, config="llm/on_policy_kd_tiny")
    assert part.returncode == 0, part.stdout[-3000:] + part.stderr[-3000:]
    _, resumed = kd(tmp_path, "part", *mix, "resume=auto", config="llm/on_policy_kd_tiny")
    assert resumed.returncode == 0 and "resumed" in resumed.stdout.lower(), resumed.stdout[-3000:]
    a, b, c = logged(one_out), logged(two_out), logged(part_out)
    assert [a[s]["on_policy"] for s in (1, 2, 3, 4)] == [1.0, 1.0, 1.0, 0.0]
    for step in (1, 2, 3, 4):
        for key in ("loss", "ce", "kd"):
            assert abs(a[step][key] - b[step][key]) <= 1e-5, (step, key, a[step], b[step])
            assert abs(a[step][key] - c[step][key]) <= 1e-5, (step, key, a[step], c[step])
    # on a sampled step the labels are the student's own samples: a random student's
    # cross-entropy of them is lower than of the data's answers (step 4)
    assert a[3]["ce"] < a[4]["ce"]
    vals = [
        [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        for out in (one_out, two_out, part_out)
    ]
    key = "val/student_samples/reverse_kl"
    found = [[r[key] for r in rows if key in r][-1] for rows in vals]
    assert found[0] > 0 and max(found) - min(found) <= 1e-5, found


@pytest.mark.slow  # 2 processes, 2 on-policy steps of a LoRA student of an HF folder
def test_hf_tiny_on_policy_kd_samples_with_a_lora_student_and_exports_its_adapters(tmp_path):
    student, teacher = two_folders(tmp_path)
    out = tmp_path / "run"
    result = run_freetx(
        "run", "--nproc-per-node", "2", "kd_fsdp2", "--config", "llm/hf_tiny_on_policy_kd",
        f"model_dir={student}", f"teacher_dir={teacher}", f"output_dir={out}", "max_steps=2",
        "eval.every_n_steps=2", "eval.max_batches=1", "log_every_n_steps=1",
        "dataset.num_builtin_examples=200", "dataset.seq_len=64",
        "on_policy.max_completion_length=16", "peft.method=lora", JSONL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = logged(out)
    assert rows[1]["on_policy"] == 1.0 and rows[1]["kd"] > 0 and rows[1]["time/generation"] > 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r for r in records if "val/student_samples/reverse_kl" in r][-1][
        "val/student_samples/reverse_kl"] > 0  # fmt: skip
    peft = pytest.importorskip("peft")
    config = peft.PeftConfig.from_pretrained(out / "export" / "peft")  # its adapters load
    assert config.task_type == "CAUSAL_LM"
