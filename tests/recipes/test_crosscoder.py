"""crosscoder_fsdp2 through the CLI on 2 processes: planted features recovered (slow tier:
every activation), model diffing of two freetx tiny LMs with the cache, exact resume with
the on-the-fly buffer, analyze and export, and bad input refused in one paragraph."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import flat, run_freetx

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
# what each activation needs on the planted task (crosscoder/synthetic_tiny: relu)
ACTIVATIONS = {
    "relu": [],
    "jumprelu": ["model.activation=jumprelu", "sparsity.coeff=3", "model.pre_act_coeff=0.03",
                 "model.log_threshold_init=-2"],
    "batchtopk": ["model.activation=batchtopk", "model.k=3", "model.dead_after_rows=100000"],
}  # fmt: skip


def records(output_dir):
    return [json.loads(x) for x in (output_dir / "metrics.jsonl").read_text().splitlines()]


def synthetic(tmp_path, *overrides, nproc=2):
    result = run_freetx(
        "run", "--nproc-per-node", str(nproc), "crosscoder_fsdp2", "--config",
        "crosscoder/synthetic_tiny", f"output_dir={tmp_path}", JSONL, *overrides,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result


@pytest.mark.slow
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_planted_features_are_recovered(tmp_path, activation):
    # one process (2 threads): 31 s a run against 59 s on two (the same rows at any world
    # size: test_validation_means_the_same_rows_at_any_world_size)
    synthetic(tmp_path, *ACTIVATIONS[activation], "eval.every_n_steps=0", nproc=1)
    final = records(tmp_path)[-1]
    assert final["val/explained_variance"] > 0.9
    assert final["planted/expected_l0"] / 2 <= final["val/l0"] <= 2 * final["planted/expected_l0"]
    assert final["planted/mean_max_cosine"] > 0.9
    assert final["val/dead_fraction"] < 0.1
    assert abs(final["planted/exclusive_fraction"] - final["planted/true_exclusive_fraction"]) < 0.1


@pytest.mark.slow  # 40 s
def test_a_short_synthetic_run_learns_and_resumes_exactly(tmp_path):
    options = ["log_every_n_steps=1", "checkpoint.every_n_steps=3", "eval.every_n_steps=0",
               "lr_schedule.decay=constant", "max_steps=6"]  # fmt: skip
    synthetic(tmp_path / "straight", *options)
    synthetic(tmp_path / "resumed", *options, "max_steps=3")
    result = synthetic(tmp_path / "resumed", *options)
    assert "resumed from" in result.stdout
    losses = [{r["step"]: r["loss"] for r in records(tmp_path / d) if "loss" in r}
              for d in ("straight", "resumed")]  # fmt: skip
    for step in (4, 5, 6):
        assert losses[0][step] == losses[1][step], step
    long = synthetic(tmp_path / "long", "max_steps=400", "eval.every_n_steps=0")
    assert "sources 2 | source dim 32 | dict size 256" in long.stdout
    assert records(tmp_path / "long")[-1]["val/explained_variance"] > 0.8


@pytest.fixture(scope="module")
def two_lms(tmp_path_factory):
    """llm/tiny pretrained 30 steps, and its instruction fine-tune (10 steps from it)."""
    root = tmp_path_factory.mktemp("lms")
    base = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/tiny",
                      f"output_dir={root / 'base'}", "max_steps=30", "eval.every_n_steps=0",
                      "metric_loggers=[]")  # fmt: skip
    assert base.returncode == 0, base.stderr
    tuned = run_freetx("run", "full_finetune_fsdp2", "--config", "llm/instruct_tiny",
                       f"output_dir={root / 'tuned'}", "max_steps=10", "model.max_seq_len=256",
                       f"checkpoint.initial_weights={root / 'base'}", "eval.every_n_steps=0",
                       "metric_loggers=[]")  # fmt: skip
    assert tuned.returncode == 0, tuned.stderr
    return root / "base", root / "tuned"


def diff_run(output_dir, lms, *overrides, nproc=2):
    base, tuned = lms
    sources = (f"activations.sources=[{{model: {base}, hooks: [layers.2]}}, "
               f"{{model: {tuned}, hooks: [layers.2]}}]")  # fmt: skip
    return run_freetx(
        "run", "--nproc-per-node", str(nproc), "crosscoder_fsdp2", "--config",
        "crosscoder/diff_tiny", f"output_dir={output_dir}", sources, JSONL, "max_steps=20",
        "eval.every_n_steps=0", "eval.rows=1024", *overrides,
    )  # fmt: skip


@pytest.mark.slow  # 80 s: two LMs trained first
def test_model_diffing_of_two_tiny_lms_through_the_cache(tmp_path, two_lms):
    cache = tmp_path / "activations"
    first = diff_run(tmp_path / "run", two_lms, "activations.mode=cache",
                     f"activations.cache={cache}")  # fmt: skip
    assert first.returncode == 0, first.stderr
    final = records(tmp_path / "run")[-1]
    for key in ("val/explained_variance", "val/l0", "val/dead_fraction",
                "val/ce_recovered/model_0", "val/ce_recovered/model_1"):  # fmt: skip
        assert key in final, key
    assert final["val/explained_variance"] > 0.3
    assert sorted(p.name for p in cache.iterdir()) == [
        "metadata.json", "shard_00000.safetensors", "shard_00001.safetensors",
    ]  # fmt: skip
    # a later run reuses the cache (1 process); one of other sources is refused
    again = diff_run(tmp_path / "again", two_lms, "activations.mode=cache",
                     f"activations.cache={cache}", "max_steps=2", nproc=1)  # fmt: skip
    assert again.returncode == 0, again.stderr
    other = diff_run(tmp_path / "other", two_lms, "activations.mode=cache",
                     f"activations.cache={cache}", "max_steps=2",
                     f"activations.sources=[{{model: {two_lms[0]}, hooks: [layers.1]}}, "
                     f"{{model: {two_lms[1]}, hooks: [layers.1]}}]", nproc=1)  # fmt: skip
    assert other.returncode == 1 and "was made with other settings" in flat(other.stderr)
    assert "sources differ" in flat(other.stderr)

    analyzed = run_freetx("crosscoder", "analyze", str(tmp_path / "run"))
    assert analyzed.returncode == 0, analyzed.stderr
    analysis = json.loads((tmp_path / "run" / "analysis" / "analysis.json").read_text())
    assert sum(analysis["relative_norm_histogram"]["counts"]) > 0
    assert (tmp_path / "run" / "analysis" / "relative_decoder_norm.png").read_bytes()[
        :4
    ] == b"\x89PNG"
    exported = run_freetx("crosscoder", "export", str(tmp_path / "run"), str(tmp_path / "export"))
    assert exported.returncode == 0, exported.stderr
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "export" / "crosscoder.safetensors"))
    assert list(weights["W_enc"].shape) == [2, 192, 768] and list(weights["W_dec"].shape) == [
        768,
        2,
        192,
    ]
    config = json.loads((tmp_path / "export" / "config.json").read_text())
    assert [s["hooks"] for s in config["sources"]] == [["layers.2"], ["layers.2"]]
    assert torch.isfinite(weights["W_dec"]).all()


@pytest.mark.slow  # needs the two LMs
def test_bad_input_is_one_paragraph(tmp_path, two_lms):
    base, _ = two_lms
    one = f"activations.sources=[{{model: {base}, hooks: [layers.22]}}]"
    widths = f"activations.sources=[{{model: {base}, hooks: [layers.2, layers.2.feed_forward.w1]}}]"
    cases = [
        ([one], "has no module 'layers.22'", 1),
        ([widths], "different widths", 1),
        (["batch_size=1001"], "cannot be split", 2),
    ]
    for overrides, message, nproc in cases:
        result = diff_run(tmp_path / "x", two_lms, *overrides, nproc=nproc)
        assert result.returncode == 1 and message in flat(result.stderr), result.stderr
        assert "Traceback" not in result.stderr
    assert "Modules with similar names: layers.2" in flat(diff_run(
        tmp_path / "y", two_lms, f"activations.sources=[{{model: {base}, hooks: [layers.22]}}]",
        nproc=1).stderr)  # fmt: skip


def test_an_hf_model_of_another_architecture_is_a_source(tmp_path):
    """GPT-2 (the seed's --model gpt2) through transformers: two blocks' outputs."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=300, n_embd=32, n_layer=2, n_head=2, n_positions=128
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    result = run_freetx(
        "run", "crosscoder_fsdp2", "--config", "crosscoder/lm_layers_tiny",
        f"output_dir={tmp_path / 'run'}", JSONL, "max_steps=4", "eval.rows=256",
        f"activations.sources=[{{model: {tmp_path / 'gpt2'}, hooks: [transformer.h.0, transformer.h.1]}}]",
        "model.dict_size=64", "eval.every_n_steps=0",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "sources 2 | source dim 32" in result.stdout
    assert "val/ce_recovered/model_0" in records(tmp_path / "run")[-1]


@pytest.mark.slow  # 12 s: a run on 1 process and one on 2
def test_validation_means_the_same_rows_at_any_world_size(tmp_path):
    """eval.rows counts over all ranks (each its share of the first rows of the validation
    sequences): the same weights (lr 0; the scales from every row) score the same on 1
    process and on 2, with an uneven split (301 rows). The seed's l1_coeff (ramped) and
    W_dec_norm are logged with the training figures."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    (tmp_path / "text.txt").write_text("".join(f"line {i} of a small text. " for i in range(400)))
    scores = {}
    for nproc in (1, 2):
        out = tmp_path / str(nproc)
        result = run_freetx(
            "run", "--nproc-per-node", str(nproc), "crosscoder_fsdp2", "--config",
            "crosscoder/lm_layers_tiny", f"output_dir={out}", JSONL, "max_steps=2",
            f"activations.sources=[{{model: {tmp_path / 'gpt2'}, hooks: [transformer.h.1]}}]",
            f"activations.text.source={tmp_path / 'text.txt'}", "activations.mode=cache",
            "activations.text.val_fraction=0.2",  # of 80 sequences: some, by their hash
            f"activations.cache={out / 'cache'}", "activations.normalize_rows=100000",
            "model.dict_size=64", "optimizer.lr=0", "eval.rows=301", "log_every_n_steps=1",
            "sparsity.warmup_fraction=1", "batch_size=64",
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        logged = records(out)
        scores[nproc] = {k: v for k, v in logged[-1].items() if k.startswith("val/")}
        train = [r for r in logged if "l1_coeff" in r]
        assert [r["l1_coeff"] for r in train] == pytest.approx([1.0, 2.0])  # 2.0, ramped
        assert all(r["W_dec_norm"] > 0 for r in train)
    assert scores[1].keys() == scores[2].keys() and "val/recon_loss" in scores[1]
    for key, value in scores[1].items():
        assert scores[2][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key  # float32 sums
