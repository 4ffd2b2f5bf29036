"""A Llama-style decoder: RoPE, RMSNorm, grouped-query attention, SwiGLU; with the
variants of Qwen3 (q/k RMSNorm per head) and OLMo 2 (q/k RMSNorm over the whole
projections, norms after attention and MLP instead of before).

Parameter names and the rotate-half RoPE convention follow HF Llama closely
enough that weights convert by renaming (see freetx.checkpoint.convert).
`DecoderBlock` is the unit that parallelism wraps (FSDP2 `fully_shard`,
activation checkpointing, `compile`); the model names it in `block_types`.

Models are built on the meta device, parallelized, then materialized and
initialized parameter by parameter (`init_parameter`), so a large model never
exists whole on one rank (the model protocol: `freetx/models/protocol.py`).
One builder, `decoder(preset=None, **fields)`, makes every shape: a preset of
`PRESETS` with any field changed, or any shape from its fields. The HF Llama
layout (names, config.json) lives beside it in `transformer_hf.py`.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from freetx.fields import refuse_meaningless
from freetx.models.attention import AttentionSpec, attend, sliding_layers
from freetx.models.protocol import build_config, builds
from freetx.models.transformer_hf import LLAMA_LAYOUT, hf_config_fields


@dataclass
class TransformerConfig:
    """The shape of a decoder. Names as Llama users know them."""

    vocab_size: int
    hidden_dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None  # None: same as num_heads (no grouping)
    ffn_hidden_dim: int | None = None  # None: SwiGLU's 8/3 * hidden, rounded to 256
    max_seq_len: int = 2048
    rope_theta: float = 500000.0
    # RoPE frequency scaling as HF names it: {"rope_type": "llama3", "factor": 8.0,
    # "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings":
    # 8192} (Llama 3.1-3.3) or {"rope_type": "linear", "factor": f}; None: plain RoPE
    rope_scaling: dict | None = None
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    dropout: float = 0.0
    attention_dropout: float = 0.0
    init_std: float = 0.02
    head_dim: int | None = None  # None: hidden_dim // num_heads
    qkv_bias: bool = False  # biases on the q, k, v projections (Qwen2)
    wo_bias: bool = False  # a bias on the attention output projection too (Llama's attention_bias)
    # RMSNorm on queries and keys before RoPE: "head" over each head's head_dim (Qwen3),
    # "projection" over the whole q and k projections (OLMo 2); None: none (Llama)
    qk_norm: Literal["head", "projection"] | None = None
    # "pre": x + attn(norm(x)), then + ffn(norm(x)) (Llama); "post": x + norm(attn(x)),
    # then + norm(ffn(x)) (OLMo 2); "sandwich": x + norm(attn(norm(x))), then
    # + norm(ffn(norm(x))) (Gemma 2, 3)
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    # Gemma's RMSNorm: x / rms(x) * (1 + weight), in float32 (the weight stored as HF does)
    norm_plus_one: bool = False
    activation: Literal["silu", "gelu_tanh"] = "silu"  # of the gated MLP (gelu_tanh: Gemma)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_dim) (Gemma)
    query_pre_attn_scalar: float | None = None  # scores scaled by 1/sqrt(it); None: head_dim
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap) (Gemma 2)
    # a query attends to its `sliding_window` latest tokens, itself included (Mistral, Gemma),
    # in the layers `layer_types` marks "sliding_attention" (None: every layer)
    sliding_window: int | None = None
    layer_types: list[str] | None = None  # per layer: "full_attention" or "sliding_attention"
    rope_local_theta: float | None = None  # RoPE base of sliding layers (Gemma 3); None: rope_theta
    hf_model_type: str = "llama"  # the HF architecture it exports as (transformer_hf.ARCHITECTURES)

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = 256 * math.ceil(int(8 * self.hidden_dim / 3) / 256)
        sizes = ("vocab_size", "hidden_dim", "num_layers", "num_heads", "num_kv_heads")
        for name in (*sizes, "ffn_hidden_dim", "max_seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if self.head_dim is None:
            if self.hidden_dim % self.num_heads:
                raise ValueError(
                    f"hidden_dim={self.hidden_dim} is not divisible by num_heads={self.num_heads}"
                )
            self.head_dim = self.hidden_dim // self.num_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        check_rope_scaling(self.rope_scaling)
        for name in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcap",
                     "final_logit_softcap"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (or null)")
        refuse_meaningless(self)

    def sliding_layers(self) -> list[bool]:
        """Per layer, whether it attends within `sliding_window`."""
        return sliding_layers(self.num_layers, self.sliding_window, self.layer_types)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Block layouts the decoder does not have (freetx.fields: checked by `freetx
        validate`, before a run, and when built), by key: why, and the fix."""
        found = {}
        if values.get("qk_norm") not in (None, "head", "projection"):
            found["qk_norm"] = (
                "the decoder normalizes queries and keys per head (head: Qwen3), over the "
                "whole projection (projection: OLMo 2) or not at all (null); set one of those."
            )
        if values.get("norm_position") not in ("pre", "post", "sandwich"):
            found["norm_position"] = (
                "a block's norms come before attention and MLP (pre: Llama, Qwen), after "
                "them (post: OLMo 2) or both (sandwich: Gemma); set pre, post or sandwich."
            )
        if values.get("activation", "silu") not in ("silu", "gelu_tanh"):
            found["activation"] = (
                "the gated MLP computes silu (Llama) or gelu_tanh (Gemma); set one of those."
            )
        types, layers = values.get("layer_types"), values.get("num_layers")
        if types is not None and (
            len(types) != (layers or len(types))  # unknown before an HF folder is read
            or not set(types) <= {"full_attention", "sliding_attention"}
        ):
            found["layer_types"] = (
                f"it names each of the num_layers={values.get('num_layers')} layers "
                "full_attention or sliding_attention; list one per layer, or set null "
                "(every layer slides when sliding_window is set)."
            )
        elif types and "sliding_attention" in types and values.get("sliding_window") is None:
            found["sliding_window"] = (
                "layer_types has sliding_attention layers but no window; set sliding_window "
                "to the tokens a query sees."
            )
        return found


ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
}


def check_rope_scaling(scaling: dict | None) -> None:
    """A RoPE scaling freetx computes exactly, with every number it needs, or ValueError."""
    if scaling is None:
        return
    kind = scaling.get("rope_type")
    if kind not in ROPE_SCALING_KEYS:
        raise ValueError(
            f"rope_scaling rope_type {kind!r} is not supported; freetx computes "
            f"{', '.join(ROPE_SCALING_KEYS)} (or no scaling: rope_scaling=None)"
        )
    missing = [k for k in ROPE_SCALING_KEYS[kind] if k not in scaling]
    if missing:
        raise ValueError(f"rope_scaling of type {kind} lacks {', '.join(missing)}")


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None, device=None):
    """RoPE's inverse frequencies [head_dim / 2], with HF's frequency scaling applied.

    llama3: wavelengths longer than original_max / low_freq_factor are divided by
    `factor`, those shorter than original_max / high_freq_factor are kept, and the
    ones between are interpolated smoothly (as Llama 3.1's reference code does).
    linear: every frequency divided by `factor` (positions interpolated).
    """
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    original = float(scaling["original_max_position_embeddings"])
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    between = (wavelength >= original / high) & (wavelength <= original / low)
    interpolated = (1 - smooth) * scaled / factor + smooth * scaled
    return torch.where(between, interpolated, scaled)


def rope_tables(
    head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None, device=None
):
    """cos and sin tables [max_seq_len, head_dim] for rotate-half RoPE (HF Llama)."""
    inv_freq = rope_frequencies(head_dim, theta, scaling, device)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


class RotaryTables(nn.Module):
    """RoPE's cos and sin tables as non-persistent buffers (never in a checkpoint).

    `tables(seq_len)` gives the first `seq_len` rows; `reset()` recomputes them
    on their device after a meta-device model is materialized.
    """

    def __init__(
        self, head_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.scaling = scaling
        cos, sin = rope_tables(head_dim, max_seq_len, theta, scaling)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len], self.sin[:seq_len]

    @torch.no_grad()
    def reset(self) -> None:
        cos, sin = rope_tables(
            self.head_dim, self.max_seq_len, self.theta, self.scaling, self.cos.device
        )
        self.cos.copy_(cos)
        self.sin.copy_(sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, head_dim]."""
    return (x * cos + rotate_half(x) * sin).to(x.dtype)


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
    ("projection", OLMo 2). `causal=False` gives the bidirectional attention an encoder needs;
    `kv_input` takes keys and values from another stream than the queries
    (the Free Transformer's encoder and injection block). `sliding`: this layer attends
    within `cfg.sliding_window`.
    """

    def __init__(self, cfg: TransformerConfig, sliding: bool = False):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.attention_dropout = cfg.attention_dropout
        self.wq = nn.Linear(cfg.hidden_dim, cfg.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.hidden_dim, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.hidden_dim, cfg.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_dim, bias=cfg.wo_bias)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm is not None:
            per_head = cfg.qk_norm == "head"
            q_size = cfg.head_dim if per_head else cfg.num_heads * cfg.head_dim
            k_size = cfg.head_dim if per_head else cfg.num_kv_heads * cfg.head_dim
            self.q_norm = rms_norm(cfg, q_size)
            self.k_norm = rms_norm(cfg, k_size)
        scalar = cfg.query_pre_attn_scalar
        self.spec = AttentionSpec(
            window=cfg.sliding_window if sliding else None, softcap=cfg.attn_logit_softcap,
            scale=None if scalar is None else scalar**-0.5,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, seq_len, _ = x.shape
        kv_source = x if kv_input is None else kv_input
        q, k, v = self.wq(x), self.wk(kv_source), self.wv(kv_source)
        if self.qk_norm == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(batch, seq_len, self.num_heads, self.head_dim)
        k = k.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        v = v.view(batch, seq_len, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout = self.attention_dropout if self.training else 0.0
        out = attend(q, k, v, self.spec, causal=causal, dropout=dropout)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


ACTIVATIONS = {"silu": F.silu, "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); GeGLU with `activation: gelu_tanh` (Gemma)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.activation = ACTIVATIONS[cfg.activation]
        self.w1 = nn.Linear(cfg.hidden_dim, cfg.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_dim, cfg.hidden_dim, bias=False)
        self.w3 = nn.Linear(cfg.hidden_dim, cfg.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.activation(self.w1(x)) * self.w3(x))


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
    has, so that every freetx name has one HF name). The unit of sharding."""

    def __init__(self, cfg: TransformerConfig, sliding: bool = False):
        super().__init__()
        self.attention_norm = _norm(cfg, "pre", "sandwich")
        self.attention = Attention(cfg, sliding)
        self.post_attention_norm = _norm(cfg, "post", "sandwich")
        self.ffn_norm = _norm(cfg, "pre")
        self.pre_ffn_norm = _norm(cfg, "sandwich")
        self.feed_forward = FeedForward(cfg)
        self.post_ffn_norm = _norm(cfg, "post", "sandwich")
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`kv`: the stream keys and values come from (default `x`), normalized like `x`."""
        h = self.attention_norm(x)
        kv_input = None if kv is None else self.attention_norm(kv)
        attended = self.attention(h, cos, sin, causal=causal, kv_input=kv_input)
        x = x + self.dropout(self.post_attention_norm(attended))
        h = self.pre_ffn_norm(self.ffn_norm(x))  # at most one of the two is a norm
        return x + self.dropout(self.post_ffn_norm(self.feed_forward(h)))


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
    the residual stream (`attention.wo`, `feed_forward.w2`) are scaled by
    1/sqrt(2 * num_layers); norms start as the identity (weights of one, Gemma's at
    zero), biases at zero.
    """
    module_name, _, param_name = name.rpartition(".")
    module = model.get_submodule(module_name)
    if isinstance(module, nn.RMSNorm) or param_name == "bias":
        tensor.fill_(1.0 if isinstance(module, nn.RMSNorm) else 0.0)
    elif isinstance(module, PlusOneRMSNorm):
        tensor.zero_()
    elif module_name.endswith(("attention.wo", "feed_forward.w2")):
        tensor.normal_(0.0, std / math.sqrt(2 * num_layers), generator=generator)
    else:
        tensor.normal_(0.0, std, generator=generator)


# what LoRA targets are called (freetx's short names and HF's) -> module name suffixes
ADAPTER_TARGETS = {
    **{k: "attention.wq" for k in ("q", "q_proj")},
    **{k: "attention.wk" for k in ("k", "k_proj")},
    **{k: "attention.wv" for k in ("v", "v_proj")},
    **{k: "attention.wo" for k in ("o", "o_proj")},
    **{k: "feed_forward.w1" for k in ("gate", "gate_proj")},
    **{k: "feed_forward.w3" for k in ("up", "up_proj")},
    **{k: "feed_forward.w2" for k in ("down", "down_proj")},
    **{k: "output" for k in ("output", "lm_head")},
}


class Transformer(nn.Module):
    """Token embedding -> DecoderBlocks -> RMSNorm -> output head (tied or not)."""

    block_types: tuple[type[nn.Module], ...] = (DecoderBlock,)
    config_class = TransformerConfig
    hf_layout = LLAMA_LAYOUT
    adapter_targets = ADAPTER_TARGETS
    always_trained = ("tok_embeddings", "output")  # Spectrum trains these whatever it selects

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_dim)
        self.dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(DecoderBlock(cfg, sliding) for sliding in cfg.sliding_layers())
        self.norm = rms_norm(cfg, cfg.hidden_dim)
        self.output = (
            None if cfg.tie_embeddings else nn.Linear(cfg.hidden_dim, cfg.vocab_size, bias=False)
        )
        self.rope = RotaryTables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
        # Gemma 3: sliding layers' own RoPE base, unscaled
        self.local_rope = (
            None
            if cfg.rope_local_theta is None
            else RotaryTables(cfg.head_dim, cfg.max_seq_len, cfg.rope_local_theta)
        )

    # -- the forward pass -------------------------------------------------
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings (times sqrt(hidden_dim) in their dtype, as HF's Gemma)."""
        h = self.tok_embeddings(input_ids)
        if self.config.scale_embeddings:
            h = h * torch.tensor(self.config.hidden_dim**0.5).to(h.dtype)
        return self.dropout(h)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        if self.output is None:
            logits = F.linear(h, self.tok_embeddings.weight)
        else:
            logits = self.output(h)
        cap = self.config.final_logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, vocab_size]."""
        seq_len = input_ids.shape[1]
        tables = self.rope(seq_len)
        local = tables if self.local_rope is None else self.local_rope(seq_len)
        h = self.embed(input_ids)
        for layer, sliding in zip(self.layers, self.config.sliding_layers()):
            h = layer(h, *(local if sliding else tables))
        return self.head(h)

    # -- initialization (after parallelize + to_empty) ----------------------
    def init_parameter(self, name: str, tensor: torch.Tensor, generator: torch.Generator) -> None:
        """Fill the full (unsharded) tensor of parameter `name` in place (see `init_decoder_parameter`)."""
        init_decoder_parameter(
            self, name, tensor, generator, self.config.init_std, self.config.num_layers
        )

    def init_buffers(self) -> None:
        """Recompute the RoPE tables on the model's device (meta init leaves garbage)."""
        self.rope.reset()
        if self.local_rope is not None:
            self.local_rope.reset()

    # -- accounting ------------------------------------------------------
    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        total = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            total -= self.tok_embeddings.weight.numel()
        return total

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 N (non-embedding) + 12 L H d T for attention."""
        c = self.config
        dense = 6 * self.num_parameters(exclude_embeddings=True)
        attention = 12 * c.num_layers * c.num_heads * c.head_dim * seq_len
        return float(dense + attention)


# The shapes users know, as the fields they fix; `decoder(preset, **fields)` changes any.
PRESETS: dict[str, dict] = {
    # ~1.6M parameters with the byte vocabulary: CPU tests and the demo
    "tiny": dict(vocab_size=259, hidden_dim=192, num_layers=4, num_heads=6, num_kv_heads=2,
                 ffn_hidden_dim=512, max_seq_len=256, rope_theta=10000.0, tie_embeddings=True),
    # ~52M parameters: a real model that still trains on one GPU or a patient CPU
    "small": dict(vocab_size=259, hidden_dim=640, num_layers=10, num_heads=10, num_kv_heads=5,
                  ffn_hidden_dim=2048, max_seq_len=1024, rope_theta=10000.0,
                  tie_embeddings=True),
    # Llama 3.2 1B: 16 layers, 2048 hidden, 32 heads / 8 KV, tied embeddings
    "llama3_1b": dict(vocab_size=128256, hidden_dim=2048, num_layers=16, num_heads=32,
                      num_kv_heads=8, ffn_hidden_dim=8192, max_seq_len=8192,
                      rope_theta=500000.0, tie_embeddings=True),
    # Llama 3.1 8B: 32 layers, 4096 hidden, 32 heads / 8 KV, untied head
    "llama3_8b": dict(vocab_size=128256, hidden_dim=4096, num_layers=32, num_heads=32,
                      num_kv_heads=8, ffn_hidden_dim=14336, max_seq_len=8192,
                      rope_theta=500000.0, tie_embeddings=False),
}  # fmt: skip


@builds(TransformerConfig, PRESETS)
def decoder(preset: str | None = None, **fields) -> Transformer:
    """A decoder: a preset's shape (tiny, small, llama3_1b, llama3_8b) with any
    `TransformerConfig` field changed, or any shape from its fields alone."""
    return Transformer(build_config(TransformerConfig, fields, preset, PRESETS))


@builds(TransformerConfig)
def hf_decoder(path: str, **fields) -> Transformer:
    """The decoder an HF model folder's config.json describes (Llama 2/3/3.1/3.2, Mistral,
    Qwen2/2.5, Qwen3, OLMo 2, Gemma 2, Gemma 3 text), with any `TransformerConfig` field changed (e.g. max_seq_len, dropout).
    Its weights: `checkpoint.initial_weights=<the same folder>`."""
    return Transformer(build_config(TransformerConfig, hf_config_fields(path, fields)))
