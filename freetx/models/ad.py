"""The Algorithm Distillation transformer: predicts a learning agent's next action.

One token per transition: embedding(state) + embedding(previous action) +
embedding(previous reward), then causal DecoderBlocks (RoPE, the same blocks
as the LM decoder), RMSNorm and a head over the actions. The action is
predicted at every position, so one window of `n_transit` transitions trains
`n_transit` predictions. Previous action / reward of a window's first token
are "none" (their own embedding rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from freetx.models.transformer import (
    DecoderBlock,
    TransformerConfig,
    init_decoder_parameter,
    refresh_rope_tables,
    rope_tables,
)


@dataclass
class ADConfig(TransformerConfig):
    """The decoder's fields (vocab_size unused) plus the environment's sizes.

    `max_seq_len` is the context, `n_transit` in the seed code.
    """

    num_states: int = 81
    num_actions: int = 5
    num_rewards: int = 2  # discrete rewards 0 .. num_rewards - 1


class ADTransformer(nn.Module):
    """Transitions in, next-action logits out: [B, T] x 3 -> [B, T, num_actions]."""

    block_types = (DecoderBlock,)
    config_class = ADConfig

    def __init__(self, cfg: ADConfig) -> None:
        super().__init__()
        self.config = cfg
        self.state_embedding = nn.Embedding(cfg.num_states, cfg.hidden_dim)
        self.action_embedding = nn.Embedding(cfg.num_actions + 1, cfg.hidden_dim)  # + none
        self.reward_embedding = nn.Embedding(cfg.num_rewards + 1, cfg.hidden_dim)  # + none
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.RMSNorm(cfg.hidden_dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden_dim, cfg.num_actions, bias=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def no_action(self) -> int:
        return self.config.num_actions

    @property
    def no_reward(self) -> int:
        return self.config.num_rewards

    def forward(
        self, states: torch.Tensor, prev_actions: torch.Tensor, prev_rewards: torch.Tensor
    ) -> torch.Tensor:
        seq_len = states.shape[1]
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = (
            self.state_embedding(states)
            + self.action_embedding(prev_actions)
            + self.reward_embedding(prev_rewards)
        )
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.head(self.norm(h))

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        init_decoder_parameter(
            self, name, tensor, generator, self.config.init_std, self.config.num_layers
        )

    def init_buffers(self) -> None:
        refresh_rope_tables(self, self.config)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        c = self.config
        return float(6 * self.num_parameters() + 12 * c.num_layers * c.hidden_dim * seq_len)


def ad_transformer(
    n_transit: int = 80,
    hidden_dim: int = 64,
    num_layers: int = 4,
    num_heads: int = 4,
    ffn_hidden_dim: int = 256,
    dropout: float = 0.1,
    attention_dropout: float = 0.0,
    num_states: int = 81,
    num_actions: int = 5,
    num_rewards: int = 2,
) -> ADTransformer:
    """An AD transformer; names as the seed knew them: n_transit (context), hidden_dim
    (tf_n_embd), num_layers (tf_n_layer), num_heads (tf_n_head)."""
    return ADTransformer(
        ADConfig(
            vocab_size=num_actions, hidden_dim=hidden_dim, num_layers=num_layers,
            num_heads=num_heads, ffn_hidden_dim=ffn_hidden_dim, max_seq_len=n_transit,
            rope_theta=10000.0, dropout=dropout, attention_dropout=attention_dropout,
            num_states=num_states, num_actions=num_actions, num_rewards=num_rewards,
        )
    )  # fmt: skip
