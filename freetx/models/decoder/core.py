"""The decoder's core: token embedding -> `DecoderBlock`s -> RMSNorm -> output head
(tied or not), its forward pass (with a KV cache, a packed batch's documents, a context
shard or a chunked loss where a capability gives them), its initialization and its
parameter and FLOP counts. `DecoderCore` is what every decoder model here builds on;
each parallel axis or input it can take is a capability, a subclass of it in this
package that a model lists among its bases (`freetx.models.transformer.Transformer` lists
them all; the Free Transformer none).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from freetx.models.attention import AttentionMask, document_positions
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.layers import (
    DecoderBlock,
    HeldElsewhere,
    init_decoder_parameter,
    rms_norm,
)
from freetx.models.decoder.rope import RotaryTables
from freetx.models.kv_cache import KVCache
from freetx.models.moe import (
    MoEFeedForward,
    Routing,
    combine_routings,
    expert_load_max,
    load_balancing_loss,
)
from freetx.models.protocol import LMOutput, OutputLayer, OutputLoss, SequenceShard, VocabSlice

# what LoRA targets are called (freetx's short names and HF's) -> module name suffixes
ADAPTER_TARGETS = {
    **{k: "attention.wq" for k in ("q", "q_proj")},
    **{k: "attention.wk" for k in ("k", "k_proj")},
    **{k: "attention.wv" for k in ("v", "v_proj")},
    **{k: "attention.wo" for k in ("o", "o_proj")},
    **{k: "feed_forward.w1" for k in ("gate", "gate_proj")},
    **{k: "feed_forward.w3" for k in ("up", "up_proj")},
    **{k: "feed_forward.w2" for k in ("down", "down_proj")},
    **{k: "attention.wqkv" for k in ("qkv", "qkv_proj")},  # fused (Phi-3)
    # multi-head latent attention (DeepSeek)
    "q_a_proj": "attention.wq_a",
    "q_b_proj": "attention.wq_b",
    "kv_a_proj_with_mqa": "attention.wkv_a",
    "kv_b_proj": "attention.wkv_b",
    **{k: "feed_forward.w13" for k in ("gate_up", "gate_up_proj")},
    **{k: "output" for k in ("output", "lm_head")},
}


@dataclass
class BlockInputs:
    """What every block of one forward reads besides the hidden states (`block_inputs`)."""

    tables: tuple[torch.Tensor, torch.Tensor]  # RoPE's cos, sin at the tokens' positions
    local: tuple[torch.Tensor, torch.Tensor]  # sliding layers' own (Gemma 3), else `tables`
    masks: list[AttentionMask | None]  # per layer
    cache: KVCache | None
    context: SequenceShard | None


class DecoderCore(nn.Module):
    """Token embedding -> DecoderBlocks -> RMSNorm -> output head (tied or not): a
    model (`Model`) that initializes itself, counts its parameters and FLOPs and hands
    its output layer to the loss (`ProjectsInChunks`). The capabilities of this package
    subclass it; a model lists the ones it has."""

    block_types: tuple[type[nn.Module], ...] = (DecoderBlock,)
    config_class = TransformerConfig
    adapter_targets = ADAPTER_TARGETS
    always_trained = ("tok_embeddings", "output")  # Spectrum trains these whatever it selects

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.vocab_slice: VocabSlice | None = None  # tp: the head's slice of the vocabulary
        self.tok_embeddings = nn.Embedding(
            cfg.vocab_size, cfg.hidden_dim, padding_idx=cfg.pad_token_id
        )
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(
            DecoderBlock(cfg, i, sliding) for i, sliding in enumerate(cfg.sliding_layers())
        )
        self.norm = rms_norm(cfg, cfg.hidden_dim)
        self.output = (
            None if cfg.tie_embeddings else nn.Linear(cfg.hidden_dim, cfg.vocab_size, bias=False)
        )
        self.rope = RotaryTables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: sliding layers' own RoPE base, unscaled
        self.local_rope = (
            None
            if cfg.rope_local_theta is None
            else RotaryTables(cfg.rotary_dim, cfg.max_seq_len, cfg.rope_local_theta)
        )

    def describe(self) -> str:
        return f"native freetx decoder for {self.config.hf_model_type}"

    # -- the forward pass -------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (times sqrt(hidden_dim) in their dtype, as HF's Gemma)."""
        h = self.tok_embeddings(input_ids)
        if self.config.scale_embeddings:
            h = h * torch.tensor(self.config.hidden_dim**0.5).to(h.dtype)
        return self.dropout(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The last block's output -> logits: the final norm, then `project` (every slice
        of the vocabulary, under tensor parallelism)."""
        logits = self.project(self.norm(h))
        return logits if self.vocab_slice is None else self.vocab_slice.gather(logits)

    def project(self, h: torch.Tensor) -> torch.Tensor:
        """Hidden states after the final norm -> logits (tied or not, soft-capped)."""
        if self.output is None:
            logits = F.linear(h, self.tok_embeddings.weight)
        else:
            logits = self.output(h)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def output_layer(self) -> OutputLayer:
        """`project` and the parameters it reads (`ProjectsInChunks`)."""
        module = self.tok_embeddings if self.output is None else self.output
        params = tuple(module.parameters())
        return OutputLayer(self.project, params, self.config.vocab_size, self.vocab_slice)

    def finish(self, h: torch.Tensor, output_loss: OutputLoss | None):
        """The last block's output -> logits, or what `output_loss` makes of the normed
        hidden states and the output layer (`ProjectsInChunks`)."""
        if output_loss is None:
            return self.head(h)
        return output_loss(self.norm(h), self.output_layer())

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: KVCache | None = None,
        documents: torch.Tensor | None = None,
        output_loss: OutputLoss | None = None,
        context: SequenceShard | None = None,
    ) -> torch.Tensor | LMOutput:
        """input_ids [B, T] -> logits [B, T, vocab_size]; a model with experts in training
        mode returns `LMOutput(logits, aux_loss, metrics)`: the routers' load-balancing loss
        times router_aux_loss_coef, and `aux_loss` and `expert_load_max` to log. With a
        `cache` (`new_cache`), input_ids are the tokens after the cached ones, the logits
        theirs, and the cache holds them after the call (`IncrementalDecoding`). `documents` [B, T] (a packed
        batch: each position's sample, -1 on padding; `PacksDocuments`): every document
        is computed as if alone, its positions from 0, its attention within itself.
        `output_loss`: return what it makes of the hidden states and the output layer in
        place of the logits (`ProjectsInChunks`: a loss that computes them in chunks).
        `context`: input_ids are this rank's part of sequences of T x context.size tokens
        (`ShardsContext`), `documents` the whole sequences'."""
        if (documents is not None or context is not None) and cache is not None:
            raise ValueError("a packed batch or a context shard is for training, not a KV cache")
        new = input_ids.shape[1]
        if cache is not None and self.rope.rereads(cache.lengths(), new):
            input_ids = torch.cat([cache.rewind(), input_ids], dim=1)
        inputs = self.block_inputs(input_ids, cache, documents, context)
        h, routing = self.run_blocks(self.embed(input_ids), range(len(self.layers)), inputs)
        if cache is not None:
            cache.advance(input_ids)
            return self.head(h[:, -new:])
        return self.with_router_loss(self.finish(h, output_loss), routing, context)

    def block_inputs(self, input_ids, cache, documents, context) -> BlockInputs:
        """What every block of a forward reads besides the hidden states: the RoPE tables
        at the tokens' positions (a KV cache's, a packed batch's documents', a context
        shard's in the whole sequence) and each layer's attention mask."""
        seq_len = input_ids.shape[1] * (1 if context is None else context.size)
        positions = lengths = None
        if cache is not None:
            positions = cache.positions(seq_len)
        elif documents is not None:
            positions, lengths = document_positions(documents)
        elif context is not None:  # positions 0 .. seq_len - 1 of the whole sequence
            positions = torch.arange(seq_len, device=input_ids.device).expand(len(input_ids), -1)
            lengths = torch.full_like(positions, seq_len)
        if context is not None:  # this rank's positions
            mine = context.indices(seq_len, input_ids.device)
            positions, lengths = positions[:, mine], lengths[:, mine]
        tables = self.rope(seq_len, positions, lengths)
        local = tables if self.local_rope is None else self.local_rope(seq_len, positions, lengths)
        masks = [None] * len(self.layers)
        # a model is given a context shard or documents only where it has the capability
        # (`ContextMasks`, `DocumentMasks`): the checks before a run refuse the others
        if context is not None:
            masks = self.context_masks(context, documents, seq_len)
        elif documents is not None:
            masks = self.attention_masks(documents)
        return BlockInputs(tables, local, masks, cache, context)

    def run_blocks(
        self, h: torch.Tensor, blocks: range, inputs: BlockInputs
    ) -> tuple[torch.Tensor, Routing | None]:
        """The hidden states through blocks `blocks`; their MoE routers' statistics
        summed (None without experts)."""
        sliding = self.config.sliding_layers()
        routings = []
        for i in blocks:
            rope = inputs.local if sliding[i] else inputs.tables
            layer = self.layers[i]
            if inputs.cache is None:
                h = layer(h, *rope, mask=inputs.masks[i], context=inputs.context)
            else:
                h = layer(h, *rope, cache=inputs.cache.layers[i])
            if isinstance(h, tuple):  # an MoE block: (h, Routing)
                h, routing = h
                routings.append(routing)
        return h, combine_routings(routings)

    def with_router_loss(self, out, routing: Routing | None, context: SequenceShard | None):
        """`out` (logits, or what an output loss made), with an MoE model's router loss
        in training mode (`LMOutput`): from the statistics of every block, summed over the
        ranks of a context shard."""
        if routing is None or not self.training:
            return out
        if context is not None:
            routing = Routing.unpacked(context.sum(routing.packed()))
        aux = load_balancing_loss(routing, self.config.num_experts)
        metrics = {"aux_loss": aux.detach(), "expert_load_max": expert_load_max(routing)}
        return LMOutput(out, self.config.router_aux_loss_coef * aux, metrics)

    def held_blocks(self) -> list[int]:
        """The indices of the blocks this model holds (all but a pipeline stage's others)."""
        return [i for i, layer in enumerate(self.layers) if not isinstance(layer, HeldElsewhere)]

    # -- initialization (after parallelize + to_empty) ----------------------
    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` in place (see `init_decoder_parameter`)."""
        init_decoder_parameter(
            self, name, tensor, generator, self.config.init_std, self.config.num_layers
        )

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the model's device (meta init leaves garbage), and
        zero the routers' stored biases (`MoEFeedForward`: a folder's replace them when
        read)."""
        for module in self.modules():
            if isinstance(module, MoEFeedForward) and module.kind.bias:
                module.get_buffer("e_score_correction_bias").zero_()
        self.rope.reset()
        if self.local_rope is not None:
            self.local_rope.reset()

    # -- accounting ------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameters; `active`: those one token computes with (of each block's experts,
        experts_per_token / num_experts)."""
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.tok_embeddings.weight.numel()
        if active:
            c = self.config
            experts = sum(
                p.numel() for n, p in self.named_parameters() if ".feed_forward.experts." in n
            )
            total -= experts - experts * c.experts_per_token // max(c.num_experts, 1)
        return total

    def num_active_parameters(self) -> int:
        return self.num_parameters(active=True)

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (non-embedding, active: an MoE token's experts
        only) + 12 L H d T for attention (latent attention: d the mean of its query/key
        and value dims)."""
        c = self.config
        dense = 6 * self.num_parameters(exclude_embeddings=True, active=True)
        d = c.head_dim
        if c.kv_lora_rank is not None:
            d = (c.qk_nope_head_dim + c.head_dim + c.v_head_dim) / 2
        attention = 12 * c.num_layers * c.num_heads * d * seq_len
        return float(dense + attention)
