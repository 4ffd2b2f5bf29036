"""Reward models: the Bradley-Terry loss and its metrics equal TRL's RewardTrainer formula
(with a margin and the centering term); each row's whole sequence is its inputs and its
last label; the score is read where transformers reads it (the last token that is not
padding); a scorer starts from a language model's weights with a new head (the language
head not read) and from a scorer's with its head; the HF layout is transformers'
sequence classifier."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from freetx.data.batch import IGNORE_INDEX, PreferenceBatch
from freetx.models.scorer import (
    SequenceScorer,
    hf_scorer,
    last_positions,
    pooled_scores,
    scorer,
)
from freetx.objectives.reward_model import BradleyTerryLoss


def trl(chosen, rejected, margin=None, center=None):
    """TRL's RewardTrainer.compute_loss and its accuracy and margin, as a loop."""
    losses = []
    for i, (c, r) in enumerate(zip(chosen, rejected)):
        m = 0.0 if margin is None else float(margin[i])
        loss = -math.log(1 / (1 + math.exp(-(c - r - m))))
        if center is not None:
            loss += center * (c + r) ** 2
        losses.append(loss)
    n = len(losses)
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / n
    return sum(losses) / n, accuracy, sum(c - r for c, r in zip(chosen, rejected)) / n


@pytest.mark.parametrize("margin, center", [(None, None), ([0.5, 0.0, 1.0, 0.2], 0.01)])
def test_the_loss_and_metrics_are_trls(margin, center):
    chosen, rejected = [0.3, -1.2, 2.0, 0.1], [0.5, -2.0, 0.5, 0.1]
    scores = torch.tensor([v for pair in zip(chosen, rejected) for v in pair])
    loss_fn = BradleyTerryLoss(center)
    loss, metrics = loss_fn(scores, None if margin is None else torch.tensor(margin))
    want, accuracy, mean_margin = trl(chosen, rejected, margin, center)
    assert loss.item() / 4 == pytest.approx(want, abs=1e-6)
    assert metrics["accuracy"].item() / 4 == pytest.approx(accuracy)
    assert metrics["margin"].item() / 4 == pytest.approx(mean_margin, abs=1e-6)
    assert metrics["rewards/chosen"].item() / 4 == pytest.approx(sum(chosen) / 4, abs=1e-6)


def test_pair_metrics_read_each_pairs_margin_from_the_batch_and_leave_repeats_out():
    """What rm_fsdp2's validation and `freetx eval` add up: the batch's margins (the data's
    `margin` column) in the loss, an evaluation shard's repeated pair left out."""
    from freetx.objectives.reward_model import PairMetrics

    class Ranks:  # one process: the sums are the totals
        def sum_and_max(self, sums, extremes, over):
            return sums, extremes

    chosen, rejected, margin = [0.3, -1.2, 2.0], [0.5, -2.0, 0.5], [0.5, 0.0, 1.0]
    rows = torch.zeros(6, 4, dtype=torch.long)
    batch = PreferenceBatch(rows, rows, margins=torch.tensor([m for m in margin for _ in "cr"]),
                            padding=torch.tensor([False, False, False, False, True, True]))  # fmt: skip
    metrics = PairMetrics(BradleyTerryLoss())
    metrics.add(torch.tensor([v for pair in zip(chosen, rejected) for v in pair]), batch)
    found = metrics.means(Ranks())
    want, accuracy, _ = trl(chosen[:2], rejected[:2], margin[:2])
    assert found["loss"] == pytest.approx(want, abs=1e-6) and found["accuracy"] == accuracy


def test_a_negative_centering_coefficient_is_refused():
    assert "center_rewards_coefficient" in BradleyTerryLoss.meaningless(
        {"center_rewards_coefficient": -0.1}
    )
    with pytest.raises(ValueError, match="center_rewards_coefficient"):
        BradleyTerryLoss(-0.1)


def test_a_rows_whole_sequence_is_its_inputs_and_last_label():
    # rows of 3 and 5 tokens (ids 1.. then the end token 9), as the data serves them
    input_ids = torch.tensor([[1, 2, 0, 0], [1, 2, 3, 4]])
    labels = torch.tensor([[IGNORE_INDEX, 9, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, 3, 4, 9]])
    batch = PreferenceBatch(input_ids, labels, real_tokens=torch.tensor([2, 4]))
    assert batch.sequences(pad_id=0).tolist() == [[1, 2, 9, 0, 0], [1, 2, 3, 4, 9]]


def test_the_score_is_read_at_the_last_token_that_is_not_padding():
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 0, 6, 7, 8], [0, 0, 5, 6, 7]])
    assert last_positions(ids, 0).tolist() == [2, 4, 4]  # right, none, left padding
    assert last_positions(ids, None).tolist() == [4, 4, 4]
    scores = torch.arange(15.0).view(3, 5, 1)
    assert pooled_scores(scores, ids, 0).tolist() == [2.0, 9.0, 14.0]


def test_the_scorer_has_a_score_head_and_no_language_head():
    with torch.device("meta"):
        model = scorer("tiny", vocab_size=259, pad_token_id=258)
    names = {n for n, _ in model.named_parameters()}
    assert "score.weight" in names and "output.weight" not in names
    assert tuple(model.score.weight.shape) == (1, 192)
    assert isinstance(model, SequenceScorer)


def test_the_hf_layout_is_transformers_sequence_classifier():
    from freetx.models.transformer_hf import SCORER_LAYOUT

    model = scorer("tiny", vocab_size=259, pad_token_id=258, hf_model_type="qwen3", qk_norm="head")
    hf = SCORER_LAYOUT.to_hf_config(dataclasses.asdict(model.config), "float32")
    assert hf["architectures"] == ["Qwen3ForSequenceClassification"]
    assert hf["num_labels"] == 1 and hf["pad_token_id"] == 258
    assert SCORER_LAYOUT.to_hf_name("score.weight") == "score.weight"
    assert SCORER_LAYOUT.from_hf_name("score.weight") == "score.weight"
    assert SCORER_LAYOUT.from_hf_name("model.norm.weight") == "norm.weight"


def test_folders_a_scorer_cannot_read_are_refused_by_name():
    from freetx.errors import CheckpointError
    from freetx.models.hf import layout_for_hf_config
    from freetx.models.transformer_hf import SCORER_LAYOUT

    generic = {"model_type": "gpt2", "architectures": ["GPT2ForSequenceClassification"]}
    with pytest.raises(CheckpointError, match="native decoders only"):
        layout_for_hf_config(generic)
    llama = {"model_type": "llama", "architectures": ["LlamaForSequenceClassification"]}
    assert layout_for_hf_config(llama) is SCORER_LAYOUT
    with pytest.raises(CheckpointError, match="2 labels"):
        SCORER_LAYOUT.from_hf_config({**llama, "id2label": {"0": "a", "1": "b"}})


def test_gemma3_text_exports_as_its_text_classifier(tmp_path):
    from freetx.models.transformer_hf import SCORER_LAYOUT
    from tests.hf_folders import make_folder

    folder = make_folder(tmp_path / "gemma", "gemma3_text")
    with torch.device("meta"):  # a gemma3_text folder's decoder, as a scorer
        model = hf_scorer(str(folder))
    hf = SCORER_LAYOUT.to_hf_config(dataclasses.asdict(model.config), "float32")
    assert hf["architectures"] == ["Gemma3TextForSequenceClassification"]


def test_a_scorer_is_refused_where_a_language_models_logits_are_read():
    from freetx.errors import ConfigError
    from freetx.models.protocol import refuse_scorer
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        model, language_model = scorer("tiny", vocab_size=259), decoder("tiny", vocab_size=259)
    refuse_scorer(language_model, "the judge")  # a language model passes
    with pytest.raises(ConfigError, match="one score per sequence"):
        refuse_scorer(model, "the judge")


def test_the_estimate_counts_a_score_per_position_not_a_vocabulary():
    from freetx.models.memory import TrainingShape
    from freetx.models.transformer import decoder

    with torch.device("meta"):
        big = dict(vocab_size=128256, pad_token_id=0)
        lm, rm = decoder("tiny", **big), scorer("tiny", **big)
    shape = TrainingShape(tokens=4096, seq_len=512, compute_bytes=2, blocks=4)
    assert rm.head_width == 1 and lm.head_width == 128256
    # the language model's loss holds a chunk of 128k logits per token; the scorer's one
    assert rm.activation_bytes(shape).loss < lm.activation_bytes(shape).loss / 1000


def test_lora_leaves_the_score_head_to_train_whole():
    """all-linear adapts every Linear but the head, which trains whole beside the
    adapters; naming the head as a target is refused."""
    from freetx.errors import ConfigError
    from freetx.models.peft import apply_lora, resolve_targets

    with torch.device("meta"):
        model = scorer("tiny", vocab_size=259, pad_token_id=258)
    assert "score" not in resolve_targets(model, ["all-linear"])["all-linear"]
    with pytest.raises(ConfigError, match="trains whole beside the adapters"):
        resolve_targets(model, ["q", "score"])
    apply_lora(model, ["q", "v"], rank=4, alpha=8)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "score.weight" in trained and "tok_embeddings.weight" not in trained
