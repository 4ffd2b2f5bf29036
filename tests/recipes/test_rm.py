"""rm_fsdp2 through the CLI: a reward model's end-of-run HF export loads in transformers'
AutoModelForSequenceClassification with freetx's scores, and freetx reads it back as a
scorer (of an HF folder with a chat template too); a scorer starts from an HF causal LM
folder (its body read, its language head not, the score head new); the RewardModel reward
and `freetx eval` on a pairs file score as training did; validate refuses what the run
refuses; 2 processes resumed give 1 process's losses."""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.conftest import flat, run_freetx, run_freetx_here
from tests.hf_folders import make_folder

JSONL = "metric_loggers=[{_component_: freetx.loggers.JSONLLogger}]"
# a randomly initialized tiny scorer (seed 0) on the built-in pairs; a constant lr
RANDOM = ["model_dir=null", "dataset.num_builtin_examples=400", "eval.every_n_steps=0",
          "eval.max_batches=1", "log_every_n_steps=1", "checkpoint.every_n_steps=0",
          "batch_size=8", "eval.batch_size=8", "lr_schedule.warmup_steps=0",
          "lr_schedule.decay=constant", JSONL]  # fmt: skip


def metrics(output_dir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def rm(tmp_path, name, *overrides, nproc=1):
    out = tmp_path / name
    args = ["run"] + (["--nproc-per-node", str(nproc)] if nproc > 1 else [])
    result = run_freetx(*args, "rm_fsdp2", "--config", "llm/rm_tiny", f"output_dir={out}",
                        *RANDOM, *overrides)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out, result


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One 2-step rm_tiny run (lr 1e-2), exported at its end: (its output_dir, its result)."""
    return rm(tmp_path_factory.mktemp("trained"), "rm", "max_steps=2", "optimizer.lr=1e-2")


def test_the_hf_export_scores_as_freetx_in_transformers_and_reads_back(trained):
    from transformers import AutoModelForSequenceClassification

    from freetx.checkpoint import load_model
    from freetx.data import ByteTokenizer, PreferenceDataset, collate_pairs
    from freetx.models.scorer import pooled_scores

    out, result = trained
    assert (
        "scoring sequences" in flat(result.stdout) and "exported step_000002 as hf" in result.stdout
    )
    export = out / "export" / "hf"
    config = json.loads((export / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"]
    assert config["num_labels"] == 1 and config["pad_token_id"] == 258
    pairs = PreferenceDataset(source="builtin", tokenizer=ByteTokenizer(), seq_len=64,
                              split="validation", num_builtin_examples=400, cache=False)  # fmt: skip
    sequences = collate_pairs([pairs[i] for i in range(4)]).sequences(258)  # padded rows
    assert (sequences == 258).any()
    theirs = AutoModelForSequenceClassification.from_pretrained(str(export)).eval()
    ours, read_back = (load_model(str(p), torch.device("cpu")).eval() for p in (out, export))
    with torch.no_grad():
        want = pooled_scores(ours(sequences), sequences, 258)
        got = theirs(input_ids=sequences).logits[:, 0]
        again = pooled_scores(read_back(sequences), sequences, 258)
    assert (got - want).abs().max().item() <= 1e-5 and want.std() > 0
    assert type(read_back).__name__ == "SequenceScorer" and torch.equal(again, want)


def test_the_reward_model_reward_scores_a_completion_as_training_scored_its_row(tmp_path, trained):
    """freetx.objectives.RewardModel on rm_fsdp2's run: a prompt and a completion read as
    the pair's row was, the same score; a language model's run is refused by name."""
    from freetx.checkpoint import load_model
    from freetx.data import ByteTokenizer, PreferenceDataset, collate_pairs
    from freetx.data.preference import builtin_pairs
    from freetx.errors import ConfigError
    from freetx.models.scorer import pooled_scores
    from freetx.objectives import RewardModel

    out = trained[0]
    records = [r.fields for r in builtin_pairs(4, seed=3)]
    rows = tmp_path / "pairs.jsonl"
    rows.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs = PreferenceDataset(source=str(rows), tokenizer=ByteTokenizer(), seq_len=64,
                              split="train", val_fraction=0.0, cache=False)  # fmt: skip
    sequences = collate_pairs([pairs[i] for i in range(4)]).sequences(258)
    with torch.no_grad():
        want = pooled_scores(load_model(str(out), torch.device("cpu"))(sequences), sequences, 258)
    reward = RewardModel(str(out), tokenizer="bytes", batch_size=3)
    reward.place(torch.device("cpu"))
    with reward.gathered():
        got = reward([r["prompt"] for r in records for _ in (0, 1)],
                     [r[k] for r in records for k in ("chosen", "rejected")], None)  # fmt: skip
    assert torch.tensor(got).sub(want).abs().max().item() <= 1e-5
    lm = make_folder(tmp_path / "lm", "llama_head_dim")  # a language model's HF folder
    with pytest.raises(ConfigError, match="a reward model is a sequence scorer"):
        RewardModel(str(lm), tokenizer="bytes").place(torch.device("cpu"))
    # freetx eval on the pairs file: the accuracy and margin of the same scores
    pair_args = [f"pairs.source={rows}", f"pairs.validation_source={rows}", "pairs.seq_len=64"]
    evaluated = run_freetx("eval", str(out), *pair_args, f"output_dir={tmp_path / 'eval'}")
    assert evaluated.returncode == 0, evaluated.stdout[-2000:] + evaluated.stderr[-2000:]
    found = json.loads((tmp_path / "eval" / "eval.json").read_text())["pairs"]
    chosen, rejected = want[0::2], want[1::2]
    assert found["accuracy"] == pytest.approx((chosen > rejected).float().mean().item())
    assert found["margin"] == pytest.approx((chosen - rejected).mean().item(), abs=1e-5)
    assert found["max_reward"] == pytest.approx(want.max().item(), abs=1e-5)
    refused = run_freetx("eval", str(lm), *pair_args, f"output_dir={tmp_path / 'eval_lm'}",
                         "tokenizer={_component_: freetx.data.ByteTokenizer}")  # fmt: skip
    assert "pairs are scored by a reward model" in flat(refused.stdout + refused.stderr)
    too_long = run_freetx("eval", str(out), *pair_args[:2], f"output_dir={tmp_path / 'eval_long'}")
    assert "pairs.seq_len=512 is longer than the model's max_seq_len=128" in flat(
        too_long.stdout + too_long.stderr
    )
    # a completion past the model's positions is cut as a training row is, and scored
    with reward.gathered():
        (long_score,) = reward([records[0]["prompt"]], ["A" * 400], None)
    assert math.isfinite(long_score)


def test_a_scorer_starts_from_an_hf_causal_lm_folder_with_a_new_head(tmp_path):
    """The folder's body is read (transformers' classifier over the same body, given the
    scorer's head, scores alike), its lm_head is not, the head is drawn from the seed."""
    from transformers import AutoModelForSequenceClassification

    from freetx.checkpoint.loading import load_initial_weights
    from freetx.distributed.parameters import materialize
    from freetx.models.scorer import hf_scorer, pooled_scores

    folder = make_folder(tmp_path / "llama", "llama_head_dim")  # an untied lm_head
    with torch.device("meta"):
        model = hf_scorer(str(folder), pad_token_id=0)
    materialize(model, torch.device("cpu"), seed=0, init_weights=False)
    load_initial_weights(model, folder)
    head = model.score.weight.detach().clone()
    assert head.abs().sum() > 0  # drawn, not left as allocated
    theirs = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1,
                                                                pad_token_id=0).eval()  # fmt: skip
    theirs.score.weight.data.copy_(head)
    ids = torch.randint(1, 100, (3, 12))
    ids[1, 8:] = 0
    with torch.no_grad():
        want = theirs(input_ids=ids).logits[:, 0]
        got = pooled_scores(model.eval()(ids), ids, 0)
    assert (got - want).abs().max().item() <= 1e-5


def test_a_reward_model_of_an_hf_folder_with_a_chat_template_exports_its_scores(tmp_path):
    """llm/hf_tiny_rm's command: the folder's pad id set (its config.json has none: the
    run says so first), the pairs rendered with its chat template; the export scores
    their rows as freetx does, in transformers."""
    from transformers import AutoModelForSequenceClassification

    from freetx.checkpoint import load_model
    from freetx.data import HFTokenizer, PreferenceDataset, collate_pairs
    from freetx.data.corpus import builtin_documents
    from freetx.models.scorer import pooled_scores
    from tests.hf_folders import make_tokenizer

    folder = make_folder(tmp_path / "llama", "llama3_2")
    make_tokenizer(folder, builtin_documents()[:20])
    pairs = tmp_path / "pairs.jsonl"
    words = ["garden", "river", "window", "planet", "silver", "forest", "candle", "marble"]
    pairs.write_text("".join(json.dumps({"prompt": f"Reverse {w} ({i}).", "chosen": w[::-1],
                                         "rejected": w}) + "\n"
                             for i, w in enumerate(words * 4)))  # fmt: skip
    common = ["run", "rm_fsdp2", "--config", "llm/hf_tiny_rm", f"model_dir={folder}",
              f"dataset.source={pairs}", "max_steps=2", "eval.every_n_steps=0",
              "eval.max_batches=1", "log_every_n_steps=1", JSONL]  # fmt: skip
    refused = run_freetx(*common, f"output_dir={tmp_path / 'no_pad'}")
    assert "model.pad_token_id=None, and the tokenizer pads with 1" in flat(
        refused.stdout + refused.stderr
    )
    out = tmp_path / "rm"
    result = run_freetx(*common, f"output_dir={out}", "model.pad_token_id=1")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    data = PreferenceDataset(source=str(pairs), tokenizer=HFTokenizer(str(folder)), seq_len=64,
                             split="train", val_fraction=0.0, cache=False)  # fmt: skip
    sequences = collate_pairs([data[i] for i in range(3)]).sequences(1)
    theirs = AutoModelForSequenceClassification.from_pretrained(str(out / "export" / "hf"))
    with torch.no_grad():
        want = pooled_scores(load_model(str(out), torch.device("cpu"))(sequences), sequences, 1)
        got = theirs.eval()(input_ids=sequences).logits[:, 0]
    assert (got - want).abs().max().item() <= 1e-5
    # LoRA: the adapters and the score head exported for PEFT (SEQ_CLS, modules_to_save),
    # which scores over the folder's classifier as freetx over its base
    from peft import PeftModel

    from freetx.training.export import recorded_peft

    lora = tmp_path / "lora"
    result = run_freetx(*common, f"output_dir={lora}", "model.pad_token_id=1", "peft.method=lora",
                        "peft.rank=4", "optimizer.lr=1e-2", "checkpoint.final_export=auto")  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    adapter = json.loads((lora / "export" / "peft" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "SEQ_CLS" and adapter["modules_to_save"] == ["score"]
    base = AutoModelForSequenceClassification.from_pretrained(str(folder), num_labels=1,
                                                              pad_token_id=1)  # fmt: skip
    peft_model = PeftModel.from_pretrained(base, str(lora / "export" / "peft")).eval()
    ours = load_model(str(lora), torch.device("cpu"), 0, recorded_peft(str(lora))).eval()
    with torch.no_grad():
        want = pooled_scores(ours(sequences), sequences, 1)
        got = peft_model(input_ids=sequences).logits[:, 0]
    assert (got - want).abs().max().item() <= 1e-5 and ours.score.weight.abs().sum() > 0
    merged = run_freetx_here("checkpoint", "merge", str(lora), str(tmp_path / "merged"),
                        "--base", str(folder))  # fmt: skip
    assert "a merge onto it would drop it" in flat(merged.stdout + merged.stderr)


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["model._component_=freetx.models.transformer.decoder"], "trains a sequence scorer"),
        (["dataset.packed=true"], "one pair per two rows"),
        (["distributed.tp=2"], "whole on one rank"),
        (["loss.center_rewards_coefficient=-1"], "keeps the rewards near 0"),
        (["dataset._component_=freetx.data.UnpairedPreferenceDataset"], "trains on pairs"),
        (["qat.scheme=int4_weight"], "would quantize its score head"),
        (["eval.after_training=true", "eval.tasks=[x]"], "read a language model's logits"),
    ],
)
def test_validate_refuses_what_the_run_refuses(overrides, says):
    result = run_freetx_here("validate", "llm/rm_tiny", "model_dir=null", *overrides)
    assert result.returncode != 0
    assert says in flat(result.stdout + result.stderr)


def test_a_pad_id_other_than_the_tokenizers_is_refused_before_training(tmp_path):
    out = tmp_path / "pad"
    result = run_freetx("run", "rm_fsdp2", "--config", "llm/rm_tiny", f"output_dir={out}",
                        *RANDOM, "max_steps=1", "model.pad_token_id=0")  # fmt: skip
    assert result.returncode != 0
    assert "model.pad_token_id=0, and the tokenizer pads with 258" in flat(
        result.stdout + result.stderr
    )
    assert not list(out.glob("checkpoints/step_*"))


@pytest.mark.slow  # 3 runs each: 4 steps on 1 process; 2 on 2 processes, resumed to 4
@pytest.mark.parametrize("peft", ["none", "lora"])
def test_two_processes_resumed_repeat_one_process(tmp_path, peft):
    """LoRA's checkpoints hold the adapters and the score head; its resume reads the base
    from the initial weights (here the seed's) and them from the checkpoint."""
    adapters = [f"peft.method={peft}", "peft.rank=4"] if peft == "lora" else []
    one = metrics(rm(tmp_path, "one", "max_steps=4", "gradient_accumulation_steps=2", *adapters)[0])
    two = ["checkpoint.every_n_steps=2", *adapters]
    rm(tmp_path, "two", "max_steps=2", *two, nproc=2)
    resumed = metrics(rm(tmp_path, "two", "max_steps=4", *two, nproc=2)[0])
    assert set(resumed) >= {1, 2, 3, 4} and one[4]["loss"] < one[1]["loss"] + 0.5
    for step in (1, 2, 3, 4):
        for key in ("loss", "accuracy", "margin", "grad_norm"):
            # fp32 sums in another order (2 ranks vs 1 rank accumulating): grad_norm ~10
            want = one[step][key]
            assert abs(resumed[step][key] - want) <= 1e-5 * (1 + abs(want)), (step, key)
    if peft == "lora":  # the LoRA run as GRPO's reward: its adapters over its base, unmerged
        from freetx.checkpoint import load_model
        from freetx.data.preference import builtin_pairs
        from freetx.models.scorer import pooled_scores
        from freetx.objectives import RewardModel
        from freetx.training.export import recorded_peft

        reward = RewardModel(str(tmp_path / "two"), tokenizer="bytes")
        reward.place(torch.device("cpu"))
        records = [r.fields for r in builtin_pairs(3, seed=5)]
        with reward.gathered():
            got = reward([r["prompt"] for r in records], [r["chosen"] for r in records], None)
        rows = [reward.tokens(r["prompt"], r["chosen"]) for r in records]
        width = max(map(len, rows))
        ids = torch.tensor([row + [258] * (width - len(row)) for row in rows])
        model = load_model(str(tmp_path / "two"), torch.device("cpu"),
                           adapters=recorded_peft(tmp_path / "two"))  # fmt: skip
        with torch.no_grad():
            want = pooled_scores(model(ids), ids, 258)
        torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)
        assert want.std() > 0
        # the trained adapters were read (LoRA's B starts at 0)
        trained = [p for n, p in reward.model.named_parameters() if n.endswith("lora_b.weight")]
        assert trained and all(p.abs().sum() > 0 for p in trained)
