"""The decoder's layers: RMSNorm (torch's, or Gemma's 1 + weight), grouped-query
`Attention` (q/k norms, fused projections, sliding windows, soft-caps; through
`freetx.models.attention.attend`), the gated MLP (`FeedForward`, or an MoE layer's
experts: `freetx.models.moe`), and `DecoderBlock`, the unit that parallelism wraps (FSDP2,
activation checkpointing, `compile`); and the initialization every decoder-like model
here shares (`init_decoder_parameter`)."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from freetx.models.attention import AttentionMask, AttentionSpec, attend
from freetx.models.decoder.config import TransformerConfig
from freetx.models.decoder.latent_attention import LatentAttention
from freetx.models.decoder.rope import apply_rope
from freetx.models.kv_cache import LayerCache
from freetx.models.moe import MoEFeedForward, RouterKind
from freetx.models.paged_cache import PagedLayer
from freetx.models.protocol import SequenceShard


class PlusOneRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + weight), computed in float32 and cast back.
    The weight is stored as HF stores it (zeros: the identity), so exports are exact."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def rms_norm(cfg: TransformerConfig, dim: int) -> nn.Module:
    """The config's RMSNorm over `dim` features: torch's, or Gemma's (1 + weight)."""
    return PlusOneRMSNorm(dim, cfg.norm_eps) if cfg.norm_plus_one else nn.RMSNorm(dim, cfg.norm_eps)


class Attention(nn.Module):
    """Grouped-query attention through `freetx.models.attention.attend` (SDPA, or the
    kernel a sliding window or soft-capping needs on the device).

    With `qk_norm`, queries and keys are RMS-normalized before RoPE (`q_norm`,
    `k_norm`): per head ("head", Qwen3) or over the whole projection
    ("projection", OLMo 2). With `fused_projections` one Linear, `wqkv`, projects
    queries, keys and values ([q | k | v] rows, Phi-3's qkv_proj), split after the matmul. `causal=False` gives the bidirectional attention an encoder needs;
    `kv_input` takes keys and values from another stream than the queries
    (the Free Transformer's encoder and injection block). `sliding`: this layer attends
    within `cfg.sliding_window`; `rotary`: False where it applies no RoPE (`nope_layers`).
    """

    def __init__(self, cfg: TransformerConfig, sliding: bool = False, rotary: bool = True):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attention_dropout = cfg.attention_dropout
        self.rotary = rotary
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.sizes = (q_size, kv_size, kv_size)
        self.fused = cfg.fused_projections
        if self.fused:
            self.wqkv = nn.Linear(cfg.hidden_dim, q_size + 2 * kv_size, bias=cfg.qkv_bias)
        else:
            self.wq = nn.Linear(cfg.hidden_dim, q_size, bias=cfg.qkv_bias)
            self.wk = nn.Linear(cfg.hidden_dim, kv_size, bias=cfg.qkv_bias)
            self.wv = nn.Linear(cfg.hidden_dim, kv_size, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_dim, bias=cfg.wo_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            q_size = cfg.head_dim if per_head else cfg.num_heads * cfg.head_dim
            k_size = cfg.head_dim if per_head else cfg.num_kv_heads * cfg.head_dim
            self.q_norm = rms_norm(cfg, q_size)
            self.k_norm = rms_norm(cfg, k_size)
        scalar = cfg.query_pre_attn_scalar
        # a window as long as the longest sequence changes nothing (Phi-4-mini's 262144)
        binds = sliding and cfg.sliding_window < cfg.max_seq_len
        self.spec = AttentionSpec(
            window=cfg.sliding_window if binds else None,
            softcap=cfg.attn_logit_softcap,
            scale=None if scalar is None else scalar**-0.5,
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv_input: torch.Tensor | None = None,
        cache: LayerCache | PagedLayer | None = None,
        mask: AttentionMask | None = None,
        context: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`cache`: this layer's KV cache (dense or paged); the new keys and values join it, and the
        queries attend to every key cached (the real ones). `mask`: a training forward's
        mask for this layer (`document_mask`: queries attend within their document;
        `context_mask`: this rank's queries over the whole sequence). `context`: this
        rank's part of the sequence (`ShardsContext`): the keys and values of every
        part are gathered."""
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x, x if kv_input is None else kv_input)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        # by head_dim: under tensor parallelism this rank holds a slice of the heads
        q = q.view(batch, seq_len, -1, self.head_dim)
        k = k.view(batch, seq_len, -1, self.head_dim)
        v = v.view(batch, seq_len, -1, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.rotary:  # a NoPE layer (`nope_layers`) has no positions
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:  # this row's keys so far: a dense or a paged cache's
            if not causal:
                raise ValueError("a KV cache's keys are causal; bidirectional attention has none")
            out = cache.attend(q, k, v, self.spec)
            return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))
        if context is not None:  # the whole sequence's keys and values (Llama 3's scheme)
            k, v = context.gather(k, dim=2), context.gather(v, dim=2)
        dropout = self.attention_dropout if self.training else 0.0
        out = attend(q, k, v, self.spec, causal=causal, dropout=dropout, mask=mask)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))

    def project(self, x: torch.Tensor, kv_source: torch.Tensor):
        """Queries from `x`, keys and values from `kv_source`: [B, T, heads * head_dim] each."""
        if not self.fused:
            return self.wq(x), self.wk(kv_source), self.wv(kv_source)
        q, k, v = self.wqkv(x).split(self.sizes, dim=-1)
        if kv_source is not x:  # another stream's keys and values (the Free Transformer)
            _, k, v = self.wqkv(kv_source).split(self.sizes, dim=-1)
        return q, k, v


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GeGLU with `activation: gelu_tanh` (Gemma); with
    `fused_projections`, w2(act(g) * u) where [g | u] = w13 x (Phi-3's gate_up_proj, gate
    rows first). `ffn_hidden_dim`: another width than the config's (DeepSeek's shared
    experts)."""

    def __init__(self, cfg: TransformerConfig, ffn_hidden_dim: int | None = None):
        super().__init__()
        width = cfg.ffn_hidden_dim if ffn_hidden_dim is None else ffn_hidden_dim
        self.activation = ACTIVATIONS[cfg.activation]
        self.fused = cfg.fused_projections
        # registered w1, w2, w3 (w13, w2 fused): the parameters' order is the order the
        # gradient norm sums them in, so a change of it changes clipped runs in the last bit
        if self.fused:
            self.w13 = nn.Linear(cfg.hidden_dim, 2 * width, bias=False)
        else:
            self.w1 = nn.Linear(cfg.hidden_dim, width, bias=False)
        self.w2 = nn.Linear(width, cfg.hidden_dim, bias=False)
        if not self.fused:
            self.w3 = nn.Linear(cfg.hidden_dim, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.activation(gate) * up)


def feed_forward(cfg: TransformerConfig, layer: int) -> nn.Module:
    """Block `layer`'s MLP: a SwiGLU, or a mixture of SwiGLU experts on an MoE layer (with
    a SwiGLU of `shared_expert_ffn_dim` beside them where set: DeepSeek's shared experts)."""
    if not cfg.is_moe_layer(layer):
        return FeedForward(cfg)
    kind = RouterKind(
        cfg.router_scores,
        cfg.router_bias,
        cfg.expert_groups,
        cfg.groups_per_token,
        scaling=cfg.routed_scaling_factor,
        fp32=cfg.router_fp32,
    )
    shared = FeedForward(cfg, cfg.shared_expert_ffn_dim) if cfg.shared_expert_ffn_dim else None
    return MoEFeedForward(
        cfg.hidden_dim,
        cfg.moe_ffn_hidden_dim,
        cfg.num_experts,
        cfg.experts_per_token,
        cfg.norm_topk_prob,
        cfg.expert_weights_fp32,
        kind,
        shared,
    )


def _norm(cfg: TransformerConfig, *positions: str) -> nn.Module:
    """An RMSNorm where the config puts its norms, an identity (no parameters) elsewhere."""
    if cfg.norm_position not in positions:
        return nn.Identity()
    return rms_norm(cfg, cfg.hidden_dim)


class DecoderBlock(nn.Module):
    """x + attn(norm(x)), then + ffn(norm(x)) (pre-norm, `attention_norm`, `ffn_norm`); or
    x + norm(attn(x)), then + norm(ffn(x)) (post-norm, `post_attention_norm`,
    `post_ffn_norm`); or both (sandwich: `attention_norm`, `post_attention_norm`,
    `pre_ffn_norm`, `post_ffn_norm`; its norm before the MLP has its own name, as HF's
    has, so that every freetx name has one HF name). The unit of sharding. On an MoE layer
    (`feed_forward` a `MoEFeedForward`) it returns `(x, Routing)`: the router's statistics
    for the aux loss."""

    def __init__(self, cfg: TransformerConfig, layer: int = 0, sliding: bool = False):
        super().__init__()
        self.attention_norm = _norm(cfg, "pre", "sandwich")
        self.attention = (
            Attention(cfg, sliding, rotary=layer not in cfg.nope_layers)
            if cfg.kv_lora_rank is None
            else LatentAttention(cfg)
        )
        self.post_attention_norm = _norm(cfg, "post", "sandwich")
        self.ffn_norm = _norm(cfg, "pre")
        self.pre_ffn_norm = _norm(cfg, "sandwich")
        self.feed_forward = feed_forward(cfg, layer)
        self.post_ffn_norm = _norm(cfg, "post", "sandwich")
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: AttentionMask | None = None,
        context: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`kv`: the stream keys and values come from (default `x`), normalized like `x`;
        `cache`: the layer's KV cache (generation); `mask`: a training forward's mask for
        this layer (within each document of a packed batch, the router counting no
        padding; over the whole sequence under context parallelism, `context`)."""
        h = self.attention_norm(x)
        kv_input = None if kv is None else self.attention_norm(kv)
        attended = self.attention(
            h,
            cos,
            sin,
            causal=causal,
            kv_input=kv_input,
            cache=cache,
            mask=mask,
            context=context,
        )
        x = x + self.dropout(self.post_attention_norm(attended))
        h = self.pre_ffn_norm(self.ffn_norm(x))  # at most one of the two is a norm
        routing = None
        if isinstance(self.feed_forward, MoEFeedForward):
            valid = None if mask is None else mask.valid
            out, routing = self.feed_forward(h, valid)
        else:
            out = self.feed_forward(h)
        x = x + self.dropout(self.post_ffn_norm(out))
        return x if routing is None else (x, routing)


def init_normal(
    module: nn.Module, tensor: torch.Tensor, std: float, generator: torch.Generator
) -> None:
    """A weight ~ N(0, std); an embedding's padding row (`padding_idx`) at zero, as
    transformers initializes it."""
    tensor.normal_(0.0, std, generator=generator)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        tensor[module.padding_idx].zero_()


def init_decoder_parameter(
    model: nn.Module,
    name: str,
    tensor: torch.Tensor,
    generator: torch.Generator,
    std: float,
    num_layers: int,
) -> None:
    """The initialization every decoder-like model here uses, by the owning module's type.

    Linear and embedding weights ~ N(0, std); the projections that write into
    the residual stream (`attention.wo`, `feed_forward.w2`, `experts.w2`) are scaled by
    1/sqrt(2 * num_layers); norms start as the identity (weights of one, Gemma's at
    zero), biases at zero; an embedding's padding row (`pad_token_id`) at zero.
    """
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, nn.RMSNorm) or param_name == "bias":
        tensor.fill_(1.0 if isinstance(module, nn.RMSNorm) else 0.0)
    elif isinstance(module, PlusOneRMSNorm):
        tensor.zero_()
    elif module_name.endswith(("attention.wo", "feed_forward.w2", "shared_experts.w2")) or (
        name.endswith("experts.w2")
    ):
        tensor.normal_(0.0, std / math.sqrt(2 * num_layers), generator=generator)
    else:
        init_normal(module, tensor, std, generator)


# a block's norms of the residual stream (`DecoderBlock`; nn.Identity where unused)
NORM_NAMES = ("attention_norm", "post_attention_norm", "ffn_norm", "pre_ffn_norm", "post_ffn_norm")


class HeldElsewhere(nn.Module):
    """A block another pipeline stage holds (`PipelineStages.keep_blocks`): no parameters."""
