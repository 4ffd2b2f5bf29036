"""dpo_fsdp2 through the CLI: LoRA's first step is ln 2 (the policy is its reference),
validate refuses what the run refuses, the losses are the same on 1 process, 2 (fsdp,
cp 2) and 4 (dp 2 x tp 2), a precomputed reference gives the live reference's losses, and a
resume at another world size repeats the uninterrupted run's losses (and refuses the
precomputed reference once a byte of it flipped). KTO: its first loss is half of each
example's weight (the policy is its reference), and 2 processes (with a precomputed
reference, resumed) give 1 process's losses, KL baselines and rewards."""

from __future__ import annotations

import json
import math

import pytest

from tests.conftest import flat, flip_byte, one_paragraph, run_freetx, run_freetx_here
from tests.hf_folders import make_folder, make_tokenizer

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
# full DPO of a randomly initialized tiny decoder (seed 0): the reference is a frozen copy
# of the same random weights, so no SFT run is needed; the built-in pairs; a constant lr,
# so that a run stopped at step 2 and resumed to 4 sees the same lrs as a straight one
RANDOM = ["model_dir=null", "dataset.num_builtin_examples=400", "eval.every_n_steps=0",
          "eval.max_batches=1", "log_every_n_steps=1", "checkpoint.every_n_steps=0",
          "batch_size=8", "eval.batch_size=8", "lr_schedule.warmup_steps=0",
          "lr_schedule.decay=constant", "loss.rpo_alpha=null", "optimizer.lr=1e-4", "~dataset.tasks",
          JSONL]  # fmt: skip


KTO = [x for x in RANDOM if "rpo_alpha" not in x]  # llm/kto_tiny's loss has no rpo_alpha


def losses(output_dir) -> dict[int, float]:
    """step -> the logged training loss."""
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def dpo(tmp_path, name, *overrides, nproc=1, config="llm/dpo_tiny"):
    out = tmp_path / name
    args = ["run"] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    common = KTO if config == "llm/kto_tiny" else RANDOM
    result = run_freetx(*args, "dpo_fsdp2", "--config", config, f"output_dir={out}",
                        *common, *overrides)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="module")
def hf_pairs(tmp_path_factory):
    """A tiny Llama-shaped HF folder with a chat template, and a file of string pairs."""
    from freetx.data.corpus import builtin_documents

    root = tmp_path_factory.mktemp("dpo_hf")
    folder = make_folder(root / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    pairs = root / "pairs.jsonl"
    words = ["garden", "river", "window", "planet", "silver", "forest", "candle", "marble"]
    with pairs.open("w") as f:
        for i in range(64):
            word = words[i % len(words)]
            f.write(json.dumps({"prompt": f"Reverse the word {word} ({i}).",
                                "chosen": word[::-1], "rejected": word}) + "\n")  # fmt: skip
    return folder, pairs


def test_lora_dpo_first_step_is_ln2_on_an_hf_folder_and_exports_for_peft(tmp_path, hf_pairs):
    folder, pairs = hf_pairs
    out = tmp_path / "hf_dpo"
    result = run_freetx(
        "run", "dpo_fsdp2", "--config", "llm/hf_tiny_dpo", f"model_dir={folder}",
        f"dataset.source={pairs}", f"output_dir={out}", "max_steps=1", "log_every_n_steps=1",
        "eval.every_n_steps=0", "eval.max_batches=1", JSONL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "reference adapters off" in flat(result.stdout)
    assert abs(losses(out)[1] - math.log(2)) < 1e-6
    adapter = json.loads((out / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and (out / "export" / "peft" / "adapter_model.safetensors").is_file()


def test_lora_kto_of_an_hf_folder_on_unpaired_conversations_exports_for_peft(tmp_path, hf_pairs):
    """llm/hf_tiny_kto's command: the user's {prompt, completion, label} conversations,
    rendered with the folder's chat template; the first loss is half of each example's
    weight (the base with adapters off is the policy)."""
    folder, _ = hf_pairs
    rows = tmp_path / "unpaired.jsonl"
    words = ["garden", "river", "window", "planet"]
    with rows.open("w") as f:
        for i in range(32):
            word = words[i % 4]
            reply = word[::-1] if i % 2 == 0 else word
            f.write(json.dumps({"prompt": [{"role": "user", "content": f"Reverse {word} ({i})."}],
                                "completion": [{"role": "assistant", "content": reply}],
                                "label": i % 2 == 0}) + "\n")  # fmt: skip
    out = tmp_path / "hf_kto"
    result = run_freetx(
        "run", "dpo_fsdp2", "--config", "llm/hf_tiny_kto", f"model_dir={folder}",
        f"dataset.source={rows}", f"output_dir={out}", "max_steps=1", "log_every_n_steps=1",
        "eval.every_n_steps=0", "eval.max_batches=1", "loss.undesirable_weight=2.0", JSONL,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first = metrics(out)[1]
    # each example of the 8 loses half its weight (1 or 2): (n_desirable + 2 n_undesirable) / 16
    assert 0.5 < first["loss"] < 1.0 and first["kl"] == 0.0
    assert abs(first["loss"] * 16 - round(first["loss"] * 16)) < 1e-5
    adapter = json.loads((out / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["r"] == 16 and (out / "export" / "peft" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["reference.precompute=true"], "the reference is the base with its adapters disabled"),
        (["loss.type=dpo"], "did you mean 'sigmoid'"),
        (["distributed.pp=2"], "dpo_fsdp2 runs no pipeline"),
        (["loss.type=simpo", "loss.label_smoothing=0.1"], "has no label smoothing"),
        (["dataset._component_=freetx.data.InstructDataset"], "whose samples are single sequences"),
        (["loss={_component_: freetx.objectives.KTOLoss}"], "KTO learns from unpaired examples"),
        (
            ["dataset._component_=freetx.data.UnpairedPreferenceDataset"],
            "DPO and its kin compare a chosen with a rejected completion",
        ),
        (
            ["dataset.packed=true", "peft.method=none", "reference.precompute=true"],
            "the precomputed log-probs are kept per pair",
        ),
    ],
)
def test_validate_refuses_what_the_run_refuses(overrides, says):
    result = run_freetx_here("validate", "llm/dpo_lora_tiny", "model_dir=null", *overrides)
    assert result.returncode != 0
    assert says in flat(result.stdout + result.stderr)


def test_estimate_counts_the_frozen_copy_and_not_a_precomputed_one():
    def fsdp_row(*overrides):
        result = run_freetx_here("estimate", "llm/dpo_tiny", "model_dir=null",
                                 "--world-size", "2", "--device", "cpu", *overrides)  # fmt: skip
        assert result.returncode == 0, result.stderr
        return result.stdout

    frozen, precomputed = fsdp_row(), fsdp_row("reference.precompute=true")
    assert "reference" in frozen.splitlines()[1] and "a frozen copy" in flat(frozen)
    assert "reference" not in precomputed.splitlines()[1]
    assert "pairs x 2 x 64 tokens" in frozen


@pytest.mark.slow  # 4 runs of 3 steps on 1, 2, 2 and 4 processes
def test_fsdp_cp2_and_dp2_tp2_losses_equal_one_process(tmp_path):
    steps = "max_steps=3"
    one = losses(dpo(tmp_path, "one", steps)[0])
    fsdp = losses(dpo(tmp_path, "fsdp", steps, nproc=2)[0])
    cp = losses(dpo(tmp_path, "cp", steps, "distributed.cp=2", nproc=2)[0])
    tp = losses(dpo(tmp_path, "tp", steps, "distributed.tp=2", nproc=4)[0])
    for step in (1, 2, 3):
        for name, other in (("fsdp", fsdp), ("cp 2", cp), ("dp 2 x tp 2", tp)):
            assert abs(other[step] - one[step]) <= 1e-5, (name, step, one, other)
    assert one[1] == pytest.approx(math.log(2), abs=1e-6)  # policy = reference at step 1
    assert one[3] < one[1]


@pytest.mark.slow  # 2 runs of 3 steps
def test_precomputed_reference_gives_the_live_references_losses(tmp_path):
    live = losses(dpo(tmp_path, "live", "max_steps=3")[0])
    out, result = dpo(tmp_path, "pre", "max_steps=3", "reference.precompute=true")
    assert "reference: train log-probs of" in result.stdout
    assert (out / "reference_logps" / "train.safetensors").is_file()
    precomputed = losses(out)
    for step in (1, 2, 3):
        assert abs(precomputed[step] - live[step]) <= 1e-5, (live, precomputed)


@pytest.mark.slow  # 3 runs
def test_resume_at_another_world_size_repeats_the_uninterrupted_runs_losses(tmp_path):
    straight = losses(dpo(tmp_path, "straight", "max_steps=4", nproc=2)[0])
    half = ["checkpoint.every_n_steps=2", "reference.precompute=true"]
    out, _ = dpo(tmp_path, "resumed", "max_steps=2", *half, nproc=2)
    # 1 process, twice the accumulation: the same global batches in the same order
    _, result = dpo(tmp_path, "resumed", "max_steps=4", "gradient_accumulation_steps=2", *half)
    assert "read from" in result.stdout  # the precomputed reference is reused
    resumed = losses(out)
    for step in (3, 4):
        assert abs(resumed[step] - straight[step]) <= 1e-5, (straight, resumed)
    # a flipped byte in it is refused, as a checkpoint's, before any training
    table = out / "reference_logps" / "train.safetensors"
    flip_byte(table, at=table.stat().st_size - 5)
    result = run_freetx("run", "dpo_fsdp2", "--config", "llm/dpo_tiny", f"output_dir={out}",
                        *RANDOM, "max_steps=5", *half)  # fmt: skip
    text = one_paragraph(result)
    assert f"cache {table.parent}: train.safetensors is damaged: its bytes differ" in text
    assert f"Delete {table} and run again" in text


def metrics(output_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def test_kto_first_loss_is_half_of_each_examples_weight(tmp_path):
    """At step 1 the policy is its reference: each log-ratio and the KL baseline are 0,
    and each example loses 1 - sigmoid(0) of its weight (TRL's formula)."""
    out, result = dpo(tmp_path, "kto", "max_steps=1", config="llm/kto_tiny")
    assert "train examples" in flat(result.stdout) and "examples ->" in result.stdout
    first = metrics(out)[1]
    assert first["loss"] == pytest.approx(0.5, abs=1e-7) and first["kl"] == 0.0
    assert first["rewards/chosen"] == 0.0 == first["rewards/rejected"]


@pytest.mark.slow  # 3 runs: 4 steps on 1 process; 2 on 2 processes, resumed to 4
def test_kto_on_two_processes_precomputed_and_resumed_repeats_one_process(tmp_path):
    """1 process with 2 micro-batches a step and a live frozen copy; 2 processes with one
    each and the reference precomputed, stopped at step 2 and resumed: the same losses, KL
    baselines and rewards (the baseline is the global batch's however it is split)."""
    one = metrics(dpo(tmp_path, "one", "max_steps=4", "gradient_accumulation_steps=2",
                      "optimizer.lr=1e-3", config="llm/kto_tiny")[0])  # fmt: skip
    two = ["optimizer.lr=1e-3", "reference.precompute=true", "checkpoint.every_n_steps=2"]
    dpo(tmp_path, "two", "max_steps=2", *two, nproc=2, config="llm/kto_tiny")
    resumed = metrics(dpo(tmp_path, "two", "max_steps=4", *two, nproc=2, config="llm/kto_tiny")[0])
    assert one[3]["kl"] > 0 and set(resumed) >= {1, 2, 3, 4}
    for step in (1, 2, 3, 4):
        for key in ("loss", "kl", "rewards/chosen", "rewards/rejected", "grad_norm"):
            assert abs(resumed[step][key] - one[step][key]) <= 1e-5, (step, key)


@pytest.mark.slow  # 2 runs of 3 steps
def test_packed_pairs_under_cp2_equal_one_process(tmp_path):
    packed = ["dataset.packed=true", "dataset.seq_len=128", "model.max_seq_len=128", "max_steps=3"]
    out, result = dpo(tmp_path, "one", *packed)
    assert "(packed)" in result.stdout and "train pairs 377" in flat(result.stdout)
    one, cp = losses(out), losses(dpo(tmp_path, "cp", *packed, "distributed.cp=2", nproc=2)[0])
    for step in (1, 2, 3):
        assert abs(cp[step] - one[step]) <= 1e-5, (step, one, cp)
