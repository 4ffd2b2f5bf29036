"""The Algorithm Distillation transformer: predicts a learning agent's next action.

One token per transition: embedding(state) + embedding(previous action) +
embedding(previous reward), then causal DecoderBlocks (RoPE, the same blocks
as the LM decoder), RMSNorm and a head over the actions. The action is
predicted at every position, so one window of `n_transit` transitions trains
`n_transit` predictions. Previous action / reward of a window's first token
are "none" (their own embedding rows). With a KV cache (`run_cache`), a forward
takes the transitions after the cached ones, so an in-context run costs one
token's forward a step. With `boundary_tokens` (compressed AD), a
`markers` input says which tokens are <compress> / </compress> markers: those are
their own learned embeddings (`freetx.data.darkroom.compressed_context` lays them out).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.estimate import DecoderActivations
from freetx.models.decoder.layers import DecoderBlock, init_decoder_parameter, rms_norm
from freetx.models.decoder.rope import RotaryTables
from freetx.models.kv_cache import KVCache
from freetx.models.protocol import build_config, builds


@dataclass
class ADConfig(TransformerConfig):
    """The decoder's fields (vocab_size unused) plus the environment's sizes.

    `max_seq_len` is the context, `n_transit` in the seed code.
    """

    num_states: int = 81
    num_actions: int = 5
    num_rewards: int = 2  # discrete rewards 0 .. num_rewards - 1
    # how a state enters: "index" (one embedding per cell) or "xy" (an embedding of its
    # row plus one of its column, cells numbered x * grid_size + y): the geometry is
    # shared by every cell, so a goal cell never rewarded in training is still a place
    # the model can go to (the seed feeds (x, y) coordinates through a Linear)
    state_encoding: Literal["index", "xy"] = "index"
    grid_size: int = 9  # for "xy"
    boundary_tokens: bool = False  # compressed AD's <compress> / </compress> embeddings

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """The decoder's checks, and its fields of a token model that AD's embeddings of
        transitions and action head do not have (freetx.fields), by key: why, and the fix."""
        found = TransformerConfig.meaningless(values)
        for name, default in (
            ("scale_embeddings", False),
            ("final_logit_softcap", None),
            ("rope_local_theta", None),
            ("pad_token_id", None),
        ):
            if values.get(name, default) != default:
                unset = "false" if default is False else "null"
                found[name] = f"AD's transformer does not compute it; set {name}={unset}."
        grid, states = values.get("grid_size", 9), values.get("num_states", 81)
        if values.get("state_encoding") == "xy" and grid**2 < states:
            side = math.isqrt(states - 1) + 1
            found["grid_size"] = (
                f"with state_encoding=xy a state is a cell of a grid_size x grid_size grid, and "
                f"{grid}x{grid} = {grid**2} cells hold fewer than model.num_states={states}; set "
                f"model.grid_size={side} (the Dark Room's env.grid_size), or model.num_states="
                f"{grid**2}."
            )
        return found


class ADTransformer(DecoderActivations, nn.Module):
    """Transitions in, next-action logits out: [B, T] x 3 -> [B, T, num_actions]."""

    block_types = (DecoderBlock,)
    config_class = ADConfig

    def __init__(self, cfg: ADConfig) -> None:
        super().__init__()
        self.config = cfg
        if cfg.state_encoding not in ("index", "xy"):
            raise ValueError(f"state_encoding must be index or xy, got {cfg.state_encoding!r}")
        if cfg.state_encoding == "xy":  # grid_size**2 >= num_states: ADConfig.meaningless
            self.row_embedding = nn.Embedding(cfg.grid_size, cfg.hidden_dim)
            self.column_embedding = nn.Embedding(cfg.grid_size, cfg.hidden_dim)
        else:
            self.state_embedding = nn.Embedding(cfg.num_states, cfg.hidden_dim)
        self.action_embedding = nn.Embedding(cfg.num_actions + 1, cfg.hidden_dim)  # + none
        self.reward_embedding = nn.Embedding(cfg.num_rewards + 1, cfg.hidden_dim)  # + none
        if cfg.boundary_tokens:  # rows: (a transition: unused), <compress>, </compress>
            self.boundary_embedding = nn.Embedding(3, cfg.hidden_dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            DecoderBlock(cfg, i, sliding) for i, sliding in enumerate(cfg.sliding_layers())
        )
        self.norm = rms_norm(cfg, cfg.hidden_dim)
        self.head = nn.Linear(cfg.hidden_dim, cfg.num_actions, bias=False)
        self.rope = RotaryTables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    @property
    def no_action(self) -> int:
        return self.config.num_actions

    @property
    def no_reward(self) -> int:
        return self.config.num_rewards

    def forward(
        self,
        states: torch.Tensor,
        prev_actions: torch.Tensor,
        prev_rewards: torch.Tensor,
        markers: torch.Tensor | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """[B, T] each -> [B, T, num_actions]; `markers` (boundary_tokens only): 0 at a
        transition, 1 at <compress>, 2 at </compress>. With a `cache` (`run_cache`), the
        inputs are the tokens after the cached ones, and the cache holds them after."""
        if (markers is not None) != self.config.boundary_tokens:
            raise ValueError(
                "markers are given if and only if the model has boundary_tokens "
                f"(boundary_tokens={self.config.boundary_tokens})"
            )
        new = states.shape[1]
        positions = None if cache is None else cache.positions(new)
        cos, sin = self.rope(new, positions)
        h = (
            self.embed_states(states)
            + self.action_embedding(prev_actions)
            + self.reward_embedding(prev_rewards)
        )
        if markers is not None:
            h = torch.where((markers > 0)[..., None], self.boundary_embedding(markers), h)
        h = self.dropout(h)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, cache=None if cache is None else cache.layers[i])
        if cache is not None:
            cache.advance(states)
        return self.head(self.norm(h))

    def run_cache(self, rows: int, device: torch.device) -> KVCache:
        """An empty KV cache for `rows` in-context runs of up to the context's tokens
        (`rewind()` empties it again, its buffers kept for the next context). Not named
        `new_cache`: an AD model is no language model to `DecodesIncrementally`'s users."""
        no_padding = torch.zeros(rows, dtype=torch.long, device=device)
        return KVCache(self.config.num_layers, self.config.max_seq_len, no_padding)

    def embed_states(self, states: torch.Tensor) -> torch.Tensor:
        if self.config.state_encoding == "xy":
            grid = self.config.grid_size
            return self.row_embedding(states // grid) + self.column_embedding(states % grid)
        return self.state_embedding(states)

    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        init_decoder_parameter(
            self, name, tensor, generator, self.config.init_std, self.config.num_layers
        )

    def init_buffers(self) -> None:
        self.rope.reset()

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int) -> float:
        c = self.config
        return float(6 * self.num_parameters() + 12 * c.num_layers * c.hidden_dim * seq_len)


# The defaults of the AD transformer (the decoder's fields where the seed had none)
DEFAULTS = dict(
    vocab_size=5,
    hidden_dim=64,
    num_layers=4,
    num_heads=4,
    ffn_hidden_dim=256,
    max_seq_len=80,
    rope_theta=10000.0,
    dropout=0.1,
)


@builds(ADConfig)
def ad_transformer(n_transit: int | None = None, **fields) -> ADTransformer:
    """An AD transformer: `ADConfig` fields over `DEFAULTS`, names as the seed knew them
    where they differ: n_transit (the context, `max_seq_len`), hidden_dim (tf_n_embd),
    num_layers (tf_n_layer), num_heads (tf_n_head)."""
    if n_transit is not None:
        fields["max_seq_len"] = n_transit
    fields.setdefault("vocab_size", fields.get("num_actions", DEFAULTS["vocab_size"]))
    return ADTransformer(build_config(ADConfig, {**DEFAULTS, **fields}))
