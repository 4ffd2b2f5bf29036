"""A sequence scorer: the decoder with a scalar head read at each sequence's last token
that is not padding, the layout of transformers' `XForSequenceClassification` with
`num_labels` 1 (the head `score`, a Linear without bias). A reward model is one: trained
on preference pairs (`rm_fsdp2`), it scores a prompt and its completion.

    model = scorer(preset="tiny", vocab_size=259, pad_token_id=258)
    model = hf_scorer(path)            # an HF causal LM folder (a new head) or a scorer's
    rewards = pooled_scores(model(input_ids), input_ids, pad_id)   # [B]

The score is read where transformers reads it: at the rightmost position whose token is
not `pad_token_id` (so a tokenizer whose pad token is its EOS scores the token before a
final EOS, in freetx and in transformers alike); a model without a pad id scores batches
of one at their last position, as transformers does.

Its weights start from a language model's (a run, a DCP or HF causal LM folder), the
head then drawn from the seed (`NEW_HEAD`: read when the weights have one, a scorer's),
the language model's output layer left unread (`LANGUAGE_HEAD`).
"""

from __future__ import annotations

import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.models.decoder.config import TransformerConfig
from freetx.models.protocol import LMOutput, OutputLayer, build_config, builds
from freetx.models.transformer import PRESETS, Transformer
from freetx.models.transformer_hf import SCORER_LAYOUT, hf_config_fields


class SequenceScorer(Transformer):
    """The decoder (`Transformer`) with `score` [1, hidden] in place of its output layer."""

    hf_layout = SCORER_LAYOUT
    always_trained = ("tok_embeddings", "score")
    head_width = 1  # a score per position, not logits (`freetx estimate`)
    NEW_HEAD = ("score.weight",)  # drawn from the seed when the weights have none
    LANGUAGE_HEAD = ("output.weight",)  # a language model's head, not read

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__(cfg)
        self.output = None  # no language head: `project` is the score's
        self.score = nn.Linear(cfg.hidden_dim, 1, bias=False)

    def describe(self) -> str:
        return f"native freetx decoder for {self.config.hf_model_type}, scoring sequences"

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm -> a score per position [..., 1]."""
        return self.score(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.project(self.norm(h))

    def output_layer(self) -> OutputLayer:
        return OutputLayer(self.project, (self.score.weight,), 1, None)


def pooled_scores(output, input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """[B] each sequence's score from a scorer's forward `output` ([B, T, 1] scores, or an
    MoE model's `LMOutput` of them), at its last token that is not padding."""
    scores = (output.logits if isinstance(output, LMOutput) else output)[..., 0]
    return scores.gather(1, last_positions(input_ids, pad_id)[:, None].to(scores.device))[:, 0]


def last_positions(input_ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """[B] each row's rightmost position whose token is not `pad_id` (transformers' rule);
    the last position when there is no pad id."""
    width = input_ids.shape[1]
    if pad_id is None:
        return torch.full((input_ids.shape[0],), width - 1, device=input_ids.device)
    positions = torch.arange(width, device=input_ids.device)
    return (positions * (input_ids != pad_id)).argmax(dim=1)


@builds(TransformerConfig, PRESETS)
def scorer(preset: str | None = None, **fields) -> SequenceScorer:
    """A sequence scorer of a preset's shape (`freetx.models.transformer.PRESETS`) with any
    `TransformerConfig` field changed (`pad_token_id`: the tokenizer's pad id), or any
    shape from its fields."""
    return SequenceScorer(build_config(TransformerConfig, fields, preset, PRESETS))


@builds(TransformerConfig)
def hf_scorer(path: str, **fields) -> SequenceScorer:
    """The sequence scorer of an HF folder's decoder (a causal LM's, whose head is then
    new, or a sequence classifier's with num_labels 1), any field changed."""
    return SequenceScorer(build_config(TransformerConfig, hf_config_fields(path, fields)))


def check_pad_id(model: SequenceScorer, tokenizer) -> int:
    """The pad id at which the scorer stops reading a sequence: the model's (config.json's
    pad_token_id), which must be the tokenizer's, with which the data is padded."""
    pad = model.config.pad_token_id
    if pad != tokenizer.pad_id:
        raise ConfigError(
            f"model.pad_token_id={pad}, and the tokenizer pads with {tokenizer.pad_id}: a "
            "reward model reads each sequence's score at its last token that is not the "
            "model's pad token (as transformers does), so the two must be the same.",
            fix=f"Set model.pad_token_id={tokenizer.pad_id}.",
        )
    return pad
