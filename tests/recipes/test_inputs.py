"""A run's inputs are recorded by identity (the checkpoint a path meant, a fingerprint of
its files) and checked on resume: a LoRA run whose base run folder trained on resumes
on the checkpoint it started from, or is refused when that checkpoint is gone."""

from __future__ import annotations

import json

import pytest

from tests.conftest import flat, hashes, run_freetx

TINY = ["max_steps=4", "checkpoint.every_n_steps=2", "checkpoint.keep_last=2",
        "eval.every_n_steps=0", "checkpoint.save_final=true", "log_every_n_steps=1",
        "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"]  # fmt: skip


def losses(output_dir):
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def train(config, output_dir, *overrides):
    result = run_freetx("run", "full_finetune_fsdp2", "--config", config,
                        f"output_dir={output_dir}", *TINY, *overrides)  # fmt: skip
    assert result.returncode in (0, 1), result.stderr
    return result


@pytest.mark.slow  # 40 s: six runs (a base, LoRA on it, the base trained on twice)
def test_a_lora_resume_reads_the_base_it_started_from(tmp_path):
    base, lora, straight = tmp_path / "base", tmp_path / "lora", tmp_path / "straight"
    assert train("llm/tiny", base).returncode == 0  # checkpoints 2, 4
    assert train("llm/lora_tiny", lora, f"model_dir={base}", "max_steps=2").returncode == 0
    assert train("llm/tiny", base, "max_steps=6").returncode == 0  # the base trains on: 4, 6
    resumed = train("llm/lora_tiny", lora, f"model_dir={base}")
    assert resumed.returncode == 0, resumed.stderr
    assert "frozen base is read from" in flat(resumed.stdout) and "step_000004" in resumed.stdout
    step_4 = base / "checkpoints" / "step_000004"
    assert train("llm/lora_tiny", straight, f"model_dir={step_4}").returncode == 0
    assert losses(lora) == losses(straight)  # the same base: the same run

    assert train("llm/tiny", base, "max_steps=8").returncode == 0  # step 4 is pruned
    refused = train("llm/lora_tiny", lora, f"model_dir={base}", "max_steps=6")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    message = flat(refused.stderr)
    assert "trained on other inputs" in message and "checkpoint.initial_weights" in message
    assert "step_000004" in message and "step_000008" in message
    assert max(losses(lora)) == 4  # nothing was trained or saved


@pytest.mark.slow  # 9 s: a run and a refused resume
def test_a_resume_on_rewritten_data_is_refused_before_any_work(tmp_path):
    """The files a dataset read are recorded by identity: a resume after the data file
    was rewritten in place (same path, same config) is refused, naming the file."""
    data, run = tmp_path / "corpus.txt", tmp_path / "run"
    data.write_text(
        "".join(f"the quick brown fox {i} jumps over the lazy dog. " for i in range(400))
    )
    assert train("llm/tiny", run, f"dataset.source={data}", "max_steps=2").returncode == 0
    meta = json.loads((run / "checkpoints" / "step_000002" / "meta.json").read_text())
    assert meta["inputs"]["dataset"]["path"] == [str(data.resolve())]
    saved = hashes(run)

    data.write_text("another text entirely, same path. " * 500)
    refused = train("llm/tiny", run, f"dataset.source={data}")
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    message = flat(refused.stderr)
    assert "trained on other inputs" in message and f"dataset: {data.resolve()}" in message
    assert "changed since the run read them" in message and "another output_dir" in message
    assert hashes(run) == saved  # nothing trained, saved or logged


def test_the_files_a_tokenizer_and_dataset_read_are_their_identity(tmp_path):
    from freetx.checkpoint import files_read_by, input_identity
    from freetx.checkpoint.identity import changed_inputs
    from freetx.data import ByteTokenizer, PackedTextDataset

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha " * 300)
    (folder / "b.jsonl").write_text('{"text": "beta beta"}\n' * 200)
    tokenizer = ByteTokenizer()
    dataset = PackedTextDataset(tokenizer, source=str(folder), seq_len=16)
    read = files_read_by(tokenizer=tokenizer, dataset=dataset)
    assert read == {"dataset": [folder / "a.txt", folder / "b.jsonl"]}  # bytes read no file

    def identities(read):
        return {name: input_identity(files) for name, files in read.items()}

    recorded = identities(read)
    assert changed_inputs(recorded, identities(read)) == []
    (folder / "c.txt").write_text("gamma " * 300)  # a new file in the folder
    now = files_read_by(dataset=PackedTextDataset(tokenizer, source=str(folder), seq_len=16))
    (line,) = changed_inputs(recorded, identities(now))
    assert line.startswith("dataset: the run read") and "c.txt" in line
