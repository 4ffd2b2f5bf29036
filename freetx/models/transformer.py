"""A Llama-style decoder: RoPE, RMSNorm, grouped-query attention, SwiGLU; with the
variants of Qwen3 (q/k RMSNorm per head), OLMo 2 (q/k RMSNorm over the whole
projections, norms after attention and MLP instead of before) and Phi-3/Phi-4 (fused
q/k/v and gate/up projections, RoPE on part of each head, LongRoPE), and a mixture of
experts in the MLP (Mixtral, Qwen3-MoE: `num_experts`; freetx.models.moe).

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
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from freetx.errors import ConfigError
from freetx.fields import refuse_meaningless
from freetx.models.attention import (
    AttentionMask,
    AttentionSpec,
    attend,
    context_mask,
    document_mask,
    document_positions,
    sliding_layers,
)
from freetx.models.kv_cache import KVCache, LayerCache
from freetx.models.moe import (
    MoEFeedForward,
    Routing,
    combine_routings,
    empty_routing,
    expert_load_max,
    load_balancing_loss,
)
from freetx.models.protocol import (
    LMOutput,
    OutputLayer,
    OutputLoss,
    SequenceShard,
    VocabSlice,
    build_config,
    builds,
)
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
    # one q/k/v projection (attention.wqkv) and one gate/up projection (feed_forward.w13),
    # split after the matmul (Phi-3); False: wq, wk, wv and w1, w3 (Llama)
    fused_projections: bool = False
    # RoPE rotates the first int(head_dim * factor) dims of each head, the rest pass
    # through (Phi-4-mini: 0.75); 1.0: every dim
    partial_rotary_factor: float = 1.0
    hf_model_type: str = "llama"  # the HF architecture it exports as (transformer_hf.ARCHITECTURES)
    # a mixture of experts in the MLP (Mixtral, Qwen3-MoE; freetx.models.moe); 0: dense
    num_experts: int = 0
    experts_per_token: int = 2  # top-k: the experts each token is sent to
    moe_ffn_hidden_dim: int | None = None  # each expert's hidden size; None: ffn_hidden_dim
    norm_topk_prob: bool = True  # the k router weights divided by their sum (Mixtral: true)
    expert_weights_fp32: bool = True  # weigh expert outputs in float32 (Mixtral), else in the
    # compute dtype (Qwen3-MoE)
    router_aux_loss_coef: float = 0.0  # the load-balancing loss's weight per token in training
    decoder_sparse_step: int = 1  # layer i has experts when (i + 1) % step == 0 (Qwen3-MoE)
    mlp_only_layers: list[int] = field(default_factory=list)  # layers kept dense (Qwen3-MoE)
    # the embedding row of this token id gets no gradient (and starts at zero), as
    # transformers' padding_idx = config.json's pad_token_id; None: every row trains
    pad_token_id: int | None = None

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
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates {self.rotary_dim} of "
                f"head_dim={self.head_dim} dims; RoPE rotates pairs, so set a factor in (0, 1] "
                "that gives an even number of at least 2"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not divisible by num_kv_heads={self.num_kv_heads}"
            )
        check_rope_scaling(self.rope_scaling, self.rotary_dim)
        for name in ("sliding_window", "query_pre_attn_scalar", "attn_logit_softcap",
                     "final_logit_softcap"):  # fmt: skip
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (or null)")
        if self.moe_ffn_hidden_dim is None:
            self.moe_ffn_hidden_dim = self.ffn_hidden_dim
        refuse_meaningless(self)

    @property
    def rotary_dim(self) -> int:
        """The dims of each head RoPE rotates (the first ones), as transformers counts them."""
        return int(self.head_dim * self.partial_rotary_factor)

    def sliding_layers(self) -> list[bool]:
        """Per layer, whether it attends within `sliding_window`."""
        return sliding_layers(self.num_layers, self.sliding_window, self.layer_types)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` has experts (Qwen3-MoE's rule; every block for Mixtral)."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

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
        pad, vocab = values.get("pad_token_id"), values.get("vocab_size")
        if pad is not None and vocab is not None and not 0 <= pad < vocab:
            found["pad_token_id"] = (
                "it is the embedding row that gets no gradient (transformers' padding_idx); "
                f"set an id below vocab_size={vocab}, or null for none."
            )
        if not 0 < values.get("partial_rotary_factor", 1.0) <= 1:
            found["partial_rotary_factor"] = (
                "it is the fraction of each head's dims RoPE rotates (Phi-4-mini: 0.75); set "
                "it in (0, 1]."
            )
        return {**found, **_moe_meaningless(values)}


def _moe_meaningless(values: dict[str, Any]) -> dict[str, str]:
    """The MoE fields of a decoder with experts that no router could follow, by key."""
    experts = values.get("num_experts") or 0
    if not isinstance(experts, int) or experts < 0:
        return {"num_experts": "the experts of each MoE block: 0 (a dense MLP) or more."}
    if not experts:
        return {}
    found = {}
    k = values.get("experts_per_token", 2)
    if not isinstance(k, int) or not 1 <= k <= experts:
        found["experts_per_token"] = (
            f"each token is sent to 1 to num_experts={experts} experts; set experts_per_token "
            "in that range (Mixtral and Qwen3-MoE: 2 and 8)."
        )
    for name in ("moe_ffn_hidden_dim", "decoder_sparse_step"):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or value < 1):
            found[name] = f"{name} is a count: set it to 1 or more."
    if (values.get("router_aux_loss_coef") or 0) < 0:
        found["router_aux_loss_coef"] = (
            "a negative weight would reward unbalanced routing; set 0 (off) or more."
        )
    return found


ROPE_SCALING_KEYS = {
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "linear": ("factor",),
    # Phi-3/3.5-mini-128k, Phi-4-mini: per-frequency factors, short up to original_max_..., long
    # beyond; factor: the context's extension (max / original), which sets the cos/sin scale
    # unless attention_factor gives it
    "longrope": ("short_factor", "long_factor", "original_max_position_embeddings", "factor"),
}


def check_rope_scaling(scaling: dict | None, rotary_dim: int) -> None:
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
    for key in ("short_factor", "long_factor") if kind == "longrope" else ():
        if not isinstance(scaling[key], list) or len(scaling[key]) != rotary_dim // 2:
            raise ValueError(
                f"rope_scaling's {key} must be a list of {rotary_dim // 2} numbers (one per "
                f"frequency of the {rotary_dim} rotated dims), not {scaling[key]!r}"
            )


def rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict | None, device=None, long: bool = False
):
    """RoPE's inverse frequencies [rotary_dim / 2], with HF's frequency scaling applied.

    llama3: wavelengths longer than original_max / low_freq_factor are divided by
    `factor`, those shorter than original_max / high_freq_factor are kept, and the
    ones between are interpolated smoothly (as Llama 3.1's reference code does).
    linear: every frequency divided by `factor` (positions interpolated).
    longrope: frequency i divided by short_factor[i] (`long`: long_factor[i]).
    """
    exponents = (
        torch.arange(0, rotary_dim, 2, device=device, dtype=torch.int64).float() / rotary_dim
    )
    if scaling is not None and scaling["rope_type"] == "longrope":
        factors = scaling["long_factor" if long else "short_factor"]
        return 1.0 / (torch.tensor(factors, dtype=torch.float32, device=device) * theta**exponents)
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


def rope_attention_factor(scaling: dict | None) -> float:
    """What cos and sin are multiplied by: longrope's attention_factor, or as transformers
    derives it from `factor`, sqrt(1 + ln(factor) / ln(original_max_position_embeddings))
    (1 where factor <= 1); 1 for every other RoPE."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, original = float(scaling["factor"]), scaling["original_max_position_embeddings"]
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    rotary_dim: int,
    max_seq_len: int,
    theta: float,
    scaling: dict | None = None,
    device=None,
    long: bool = False,
):
    """cos and sin tables [max_seq_len, rotary_dim] for rotate-half RoPE (HF Llama), scaled
    by the attention factor (`rope_attention_factor`); `long`: longrope's long factors."""
    inv_freq = rope_frequencies(rotary_dim, theta, scaling, device, long)
    positions = torch.arange(max_seq_len, device=device, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    angles = torch.cat([freqs, freqs], dim=-1)
    scale = rope_attention_factor(scaling)
    return angles.cos() * scale, angles.sin() * scale


class RotaryTables(nn.Module):
    """RoPE's cos and sin tables as non-persistent buffers (never in a checkpoint).

    `tables(seq_len)` gives the first `seq_len` rows; `reset()` recomputes them
    on their device after a meta-device model is materialized. With longrope there are
    two pairs, and a sequence longer than original_max_position_embeddings takes the
    long one for all its positions, a shorter one the short one (as transformers picks
    them by the length of what it is given). With a KV cache, `tables(seq_len, positions)`
    gives the rows of `positions` [B, T] ([B, 1, T, rotary_dim]), longrope's pair picked
    per row by its largest position + 1 (transformers' `longrope_frequency_update` picks
    by the batch's largest: one prompt at a time, the same). A packed batch gives
    `lengths` [B, T] too, its documents' lengths: longrope's pair is picked per document,
    as transformers picks it for each document alone.
    """

    def __init__(
        self, rotary_dim: int, max_seq_len: int, theta: float, scaling: dict | None = None
    ) -> None:
        super().__init__()
        self.rotary_dim, self.max_seq_len, self.theta = rotary_dim, max_seq_len, theta
        self.scaling = scaling
        longrope = scaling is not None and scaling["rope_type"] == "longrope"
        self.long_after = scaling["original_max_position_embeddings"] if longrope else None
        self.kinds = {"": False, "long_": True} if longrope else {"": False}  # prefix -> long
        for prefix, long in self.kinds.items():
            cos, sin = rope_tables(rotary_dim, max_seq_len, theta, scaling, long=long)
            self.register_buffer(f"{prefix}cos", cos, persistent=False)
            self.register_buffer(f"{prefix}sin", sin, persistent=False)

    def forward(
        self,
        seq_len: int,
        positions: torch.Tensor | None = None,
        lengths: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if positions is not None:
            cos, sin = self.cos[positions][:, None], self.sin[positions][:, None]
            if self.long_after is None:
                return cos, sin
            if lengths is None:  # one sequence per row
                lengths = positions.amax(dim=1, keepdim=True) + 1
            long = (lengths > self.long_after)[:, None, :, None]
            long_cos, long_sin = (
                self.long_cos[positions][:, None],
                self.long_sin[positions][:, None],
            )
            return torch.where(long, long_cos, cos), torch.where(long, long_sin, sin)
        long = self.long_after is not None and seq_len > self.long_after
        cos, sin = (self.long_cos, self.long_sin) if long else (self.cos, self.sin)
        return cos[:seq_len], sin[:seq_len]

    def rereads(self, cached: torch.Tensor, new: int) -> bool:
        """Whether a KV cache whose rows hold `cached` [B] tokens each (padding aside) must
        be computed again now that `new` tokens follow: a row's keys were computed with the
        short tables and it grows past original_max_position_embeddings, where transformers'
        Phi-3 drops its cache once (`Phi3ForCausalLM.prepare_inputs_for_generation`). Every
        row is computed again, each with its own tables (the same for the rows that do not
        cross)."""
        if self.long_after is None:
            return False
        crossing = (cached > 0) & (cached <= self.long_after) & (cached + new > self.long_after)
        return bool(crossing.any())

    @torch.no_grad()
    def reset(self) -> None:
        for prefix, long in self.kinds.items():
            cos, sin = rope_tables(
                self.rotary_dim, self.max_seq_len, self.theta, self.scaling, self.cos.device, long
            )
            getattr(self, f"{prefix}cos").copy_(cos)
            getattr(self, f"{prefix}sin").copy_(sin)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [B, heads, T, head_dim]; cos/sin: [T, rotary_dim]: the first rotary_dim dims of
    each head rotated, the rest passed through (partial rotary)."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], dim=-1)
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
    ("projection", OLMo 2). With `fused_projections` one Linear, `wqkv`, projects
    queries, keys and values ([q | k | v] rows, Phi-3's qkv_proj), split after the matmul. `causal=False` gives the bidirectional attention an encoder needs;
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
            window=cfg.sliding_window if binds else None, softcap=cfg.attn_logit_softcap,
            scale=None if scalar is None else scalar**-0.5,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        causal: bool = True,
        kv_input: torch.Tensor | None = None,
        cache: LayerCache | None = None,
        mask: AttentionMask | None = None,
        context: SequenceShard | None = None,
    ) -> torch.Tensor:
        """`cache`: this layer's KV cache; the new keys and values join it, and the
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
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        dropout = self.attention_dropout if self.training else 0.0
        key_valid = None
        if cache is not None:
            k, v, key_valid = cache.extend(k, v)
        if context is not None:  # the whole sequence's keys and values (Llama 3's scheme)
            k, v = context.gather(k, dim=2), context.gather(v, dim=2)
        out = attend(
            q, k, v, self.spec, causal=causal, dropout=dropout, key_valid=key_valid, mask=mask
        )
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
    rows first)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.activation = ACTIVATIONS[cfg.activation]
        self.fused = cfg.fused_projections
        # registered w1, w2, w3 (w13, w2 fused): the parameters' order is the order the
        # gradient norm sums them in, so a change of it changes clipped runs in the last bit
        if self.fused:
            self.w13 = nn.Linear(cfg.hidden_dim, 2 * cfg.ffn_hidden_dim, bias=False)
        else:
            self.w1 = nn.Linear(cfg.hidden_dim, cfg.ffn_hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden_dim, cfg.hidden_dim, bias=False)
        if not self.fused:
            self.w3 = nn.Linear(cfg.hidden_dim, cfg.ffn_hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            gate, up = self.w13(x).chunk(2, dim=-1)
        else:
            gate, up = self.w1(x), self.w3(x)
        return self.w2(self.activation(gate) * up)


def feed_forward(cfg: TransformerConfig, layer: int) -> nn.Module:
    """Block `layer`'s MLP: a SwiGLU, or a mixture of SwiGLU experts on an MoE layer."""
    if not cfg.is_moe_layer(layer):
        return FeedForward(cfg)
    return MoEFeedForward(
        cfg.hidden_dim, cfg.moe_ffn_hidden_dim, cfg.num_experts, cfg.experts_per_token,
        cfg.norm_topk_prob, cfg.expert_weights_fp32,
    )  # fmt: skip


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
        self.attention = Attention(cfg, sliding)
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
            h, cos, sin, causal=causal, kv_input=kv_input, cache=cache, mask=mask,
            context=context,
        )  # fmt: skip
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
    elif module_name.endswith(("attention.wo", "feed_forward.w2")) or name.endswith("experts.w2"):
        tensor.normal_(0.0, std / math.sqrt(2 * num_layers), generator=generator)
    else:
        init_normal(module, tensor, std, generator)


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
    **{k: "feed_forward.w13" for k in ("gate_up", "gate_up_proj")},
    **{k: "output" for k in ("output", "lm_head")},
}


# a block's norms of the residual stream (`DecoderBlock`; nn.Identity where unused)
NORM_NAMES = ("attention_norm", "post_attention_norm", "ffn_norm", "pre_ffn_norm", "post_ffn_norm")


class HeldElsewhere(nn.Module):
    """A block another pipeline stage holds (`Transformer.keep_blocks`): no parameters."""


# the parameter counts `keep_blocks` keeps of the whole model: num_parameters' arguments
COUNT_KINDS = tuple(
    (("exclude_embeddings", e), ("active", a)) for e in (False, True) for a in (False, True)
)


@dataclass
class BlockInputs:
    """What every block of one forward reads besides the hidden states (`block_inputs`)."""

    tables: tuple[torch.Tensor, torch.Tensor]  # RoPE's cos, sin at the tokens' positions
    local: tuple[torch.Tensor, torch.Tensor]  # sliding layers' own (Gemma 3), else `tables`
    masks: list[AttentionMask | None]  # per layer
    cache: KVCache | None
    context: SequenceShard | None


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
        self.whole_counts: dict | None = None  # a pipeline stage's: the whole model's counts
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

    def slice_vocabulary(self, vocab: VocabSlice) -> None:
        """`SlicesLayers`: the head makes `vocab`'s slice of the logits."""
        self.vocab_slice = vocab

    def finish(self, h: torch.Tensor, output_loss: OutputLoss | None):
        """The last block's output -> logits, or what `output_loss` makes of the normed
        hidden states and the output layer (`ProjectsInChunks`)."""
        if output_loss is None:
            return self.head(h)
        return output_loss(self.norm(h), self.output_layer())

    def new_cache(self, left_padding: torch.Tensor, max_len: int) -> KVCache:
        """An empty KV cache (`DecodesIncrementally`) for len(left_padding) rows of up to
        `max_len` tokens, row b starting with left_padding[b] padding tokens."""
        c = self.config
        if max_len > c.max_seq_len:
            raise ConfigError(
                f"generating up to {max_len} tokens (the longest prompt and max_new_tokens) "
                f"goes past the model's max_seq_len={c.max_seq_len}, the positions it has "
                "RoPE tables for. Lower max_new_tokens or shorten the prompts."
            )
        dtype = self.tok_embeddings.weight.dtype
        return KVCache(c.num_layers, c.num_kv_heads, c.head_dim, max_len, left_padding, dtype)

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
        theirs, and the cache holds them after the call. `documents` [B, T] (a packed
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

    def forward_stage(
        self,
        x: torch.Tensor,
        routing: torch.Tensor | None = None,
        *,
        blocks: range,
        documents: torch.Tensor | None = None,
        output_loss: OutputLoss | None = None,
        context: SequenceShard | None = None,
    ):
        """One pipeline stage (`SplitsIntoStages`): blocks `blocks` (this model holds them:
        `keep_blocks`) from `x`, the input ids at the first stage and the hidden states
        [B, T, hidden] after; `routing`: an MoE model's router statistics of the blocks
        before (`Routing.packed`). Returns the hidden states (and the statistics so far,
        for an MoE model) to the next stage; the last stage returns what `forward` would
        (through `output_loss`, with the router loss from every stage's statistics)."""
        first, last = blocks.start == 0, blocks.stop == self.config.num_layers
        inputs = self.block_inputs(x, None, documents, context)
        so_far = None if routing is None else Routing.unpacked(routing)
        h, routing_here = self.run_blocks(self.embed(x) if first else x, blocks, inputs)
        combined = combine_routings([r for r in (so_far, routing_here) if r is not None])
        if not last:
            moe = self.config.num_experts > 0
            return (h, empty_routing(self.config.num_experts, h) if combined is None
                    else combined.packed()) if moe else h  # fmt: skip
        return self.with_router_loss(self.finish(h, output_loss), combined, context)

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

    def tensor_parallel_plan(self, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
        """Each block's attention sliced by heads and its MLP by hidden units, the
        embedding and an untied head by vocabulary (`SlicesLayers`); a tied embedding
        stays whole on every tp rank (the head reads it), and so do an MoE block's router
        and experts (each tp rank routes the same whole tokens). `sequence_parallel`: the
        residual stream between them, and its norms, sliced by sequence (gathered before
        attention and the MLP, summed and scattered after). Refuses what it cannot
        slice."""
        c = self.config
        why = None
        if c.num_heads % tp or c.num_kv_heads % tp:
            why = (f"tp={tp} does not divide the model's {c.num_heads} attention heads and "
                   f"{c.num_kv_heads} key/value heads", "Pick a tp that divides both")  # fmt: skip
        elif c.ffn_hidden_dim % tp:
            why = (f"tp={tp} does not divide the MLP's {c.ffn_hidden_dim} hidden units",
                   "Pick a tp that divides it")  # fmt: skip
        elif c.fused_projections or c.qk_norm == "projection":
            kind = ("fused q/k/v and gate/up projections (Phi-3)" if c.fused_projections
                    else "q/k norms over whole projections (OLMo 2)")  # fmt: skip
            why = (f"freetx does not slice {kind} over tensor-parallel ranks yet",
                   "Set distributed.tp=1 (fsdp alone shards it)")  # fmt: skip
        if why is not None:
            raise ConfigError(f"distributed.tp: {why[0]}.", fix=f"{why[1]}, or set tp=1.")
        sp = "_sequence" if sequence_parallel else ""
        plan = {}
        for i in self.held_blocks():
            block = f"layers.{i}"
            for name in ("wq", "wk", "wv"):
                plan[f"{block}.attention.{name}"] = "colwise"
            plan[f"{block}.attention.wo"] = "rowwise" + sp
            if c.qk_norm == "head":  # one weight for every head: its gradient summed over tp
                plan[f"{block}.attention.q_norm"] = "heads_norm"
                plan[f"{block}.attention.k_norm"] = "heads_norm"
            if not c.is_moe_layer(i):  # experts stay whole on every tp rank (its input is)
                plan[f"{block}.feed_forward.w1"] = "colwise"
                plan[f"{block}.feed_forward.w3"] = "colwise"
                plan[f"{block}.feed_forward.w2"] = "rowwise" + sp
            if sequence_parallel:
                plan[f"{block}.attention"] = "gather_sequence"
                moe = c.is_moe_layer(i)
                plan[f"{block}.feed_forward"] = "gather_experts" if moe else "gather_sequence"
                for norm in NORM_NAMES:
                    if not isinstance(getattr(self.layers[i], norm), nn.Identity):
                        plan[f"{block}.{norm}"] = "sequence_norm"
        if self.tok_embeddings is not None:
            if not c.tie_embeddings:
                plan["tok_embeddings"] = "embedding" + sp
            elif sequence_parallel:
                plan["tok_embeddings"] = "split_sequence"
        if sequence_parallel and self.norm is not None:
            plan["norm"] = "gather_sequence"  # the loss reads every token
        if not c.tie_embeddings and self.output is not None:
            plan["output"] = "output"
        return plan

    def keep_blocks(self, blocks: list[int], first: bool, last: bool) -> None:
        """Pipeline parallelism (`SplitsIntoStages`): keep blocks `blocks` (this rank's
        stages'; every other one becomes a `HeldElsewhere`, so the kept ones keep their
        names), the embedding if this rank holds the first stage, the final norm and the
        head if it holds the last. The whole model's parameter counts are kept for the
        banner and MFU. Refuses a tied embedding the first and last stage would share."""
        c = self.config
        if c.tie_embeddings and not (first and last):
            raise ConfigError(
                "distributed.pp: this model ties its head to its embedding (tie_embeddings), "
                "and pipeline parallelism puts the embedding on the first stage and the head "
                "on the last.",
                fix="Set model.tie_embeddings=false (a separate head, initialized like the "
                "embedding), or set distributed.pp=1.",
            )
        self.whole_counts = {key: self.num_parameters(**dict(key)) for key in COUNT_KINDS}
        for i in range(len(self.layers)):
            if i not in blocks:
                self.layers[i] = HeldElsewhere()
        if not first:
            self.tok_embeddings = None
        if not last:
            self.norm = self.output = None

    def held_elsewhere(self, name: str) -> bool:
        """Whether the whole model's tensor `name` is another pipeline stage's (a file or
        checkpoint holds it, this stage does not: `keep_blocks`)."""
        if self.whole_counts is None:  # not split
            return False
        head, _, rest = name.partition(".")
        if head == "layers":
            return isinstance(self.layers[int(rest.split(".")[0])], HeldElsewhere)
        return head in ("tok_embeddings", "norm", "output") and getattr(self, head) is None

    def held_blocks(self) -> list[int]:
        """The indices of the blocks this model holds (all but a pipeline stage's others)."""
        return [i for i, layer in enumerate(self.layers) if not isinstance(layer, HeldElsewhere)]

    def attention_masks(self, documents: torch.Tensor) -> list[AttentionMask]:
        """Per layer, its mask for a packed batch's `documents` [B, T]: built once per kind
        of layer (full, sliding) and forward (`PacksDocuments`)."""
        return self._masks(lambda spec, dropout: document_mask(documents, spec, dropout))

    def context_masks(
        self, context: SequenceShard, documents: torch.Tensor | None, length: int
    ) -> list[AttentionMask]:
        """Per layer, the mask of this rank's queries (`context.indices(length)`) over the
        whole sequence's keys, within `documents` [B, length] where the batch is packed:
        built once per kind of layer and forward (`ShardsContext`)."""
        mine = context.indices(length, self.rope.cos.device)  # the model's device
        return self._masks(
            lambda spec, dropout: context_mask(mine, length, spec, documents, dropout)
        )

    def _masks(self, build) -> list[AttentionMask]:
        """Per layer, `build(spec, dropout)`, once per kind of layer."""
        built: dict[AttentionSpec, AttentionMask] = {}
        masks = []
        for layer in self.layers:
            if isinstance(layer, HeldElsewhere):  # another pipeline stage's block
                masks.append(None)
                continue
            attention = layer.attention
            dropout = attention.attention_dropout if self.training else 0.0
            if attention.spec not in built:
                built[attention.spec] = build(attention.spec, dropout)
            masks.append(built[attention.spec])
        return masks

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
    def num_parameters(self, exclude_embeddings: bool = False, active: bool = False) -> int:
        """Parameters (the whole model's, also where a pipeline stage holds part of it);
        `active`: those one token computes with (of each block's experts,
        experts_per_token / num_experts)."""
        key = (("exclude_embeddings", exclude_embeddings), ("active", active))
        if self.whole_counts is not None:
            return self.whole_counts[key]
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
        only) + 12 L H d T for attention."""
        c = self.config
        dense = 6 * self.num_parameters(exclude_embeddings=True, active=True)
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
    Qwen2/2.5, Qwen3, OLMo 2, Phi-3/3.5/4, Gemma 2, Gemma 3 text, Mixtral, Qwen3-MoE), with any `TransformerConfig` field changed (e.g. max_seq_len, dropout).
    Its weights: `checkpoint.initial_weights=<the same folder>`."""
    return Transformer(build_config(TransformerConfig, hf_config_fields(path, fields)))
