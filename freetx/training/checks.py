"""Checks that a model, its tokenizer and its data fit together, before training."""

from __future__ import annotations

from freetx.errors import ConfigError


def check_model_and_data(model_config, tokenizer, seq_len: int) -> None:
    """The tokenizer's ids fit the embedding; sequences fit the positional tables."""
    if tokenizer.vocab_size > model_config.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's embedding has "
            f"{model_config.vocab_size} rows, so some token ids have no embedding.",
            fix=f"Set model.vocab_size={tokenizer.vocab_size} (or larger), or use the tokenizer "
            "the model was made for.",
        )
    if seq_len > model_config.max_seq_len:
        raise ConfigError(
            f"dataset.seq_len={seq_len} is longer than the model's max_seq_len="
            f"{model_config.max_seq_len}.",
            fix=f"Lower dataset.seq_len, or set model.max_seq_len={seq_len}.",
        )
