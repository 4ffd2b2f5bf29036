"""The decoder's config: `TransformerConfig`, the shape of every decoder freetx builds
(Llama's fields, and the variants of Qwen, OLMo 2, Phi-3, Gemma and the mixtures of
experts), its checks when built (`__post_init__`) and the layouts it calls meaningless
(`meaningless`: checked by `freetx validate`, before a run, and when built)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from freetx.fields import refuse_meaningless
from freetx.models.attention import sliding_layers
from freetx.models.decoder.rope import check_rope_scaling


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
    # layers whose queries and keys get no RoPE (NoPE: SmolLM3's every 4th); []: none
    nope_layers: list[int] = field(default_factory=list)
    hf_model_type: str = "llama"  # the HF family it exports as (hf_families.FAMILIES)
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
    # how the router scores the experts (freetx.models.moe.route): "softmax" (Mixtral, Qwen);
    # "sigmoid" (DeepSeek-V3, GLM-4.5: groups ranked by the sum of their top-2 scores)
    router_scores: Literal["softmax", "sigmoid"] = "softmax"
    # a float32 buffer per MoE block (`e_score_correction_bias`, DeepSeek-V3's load
    # balancing) added to the scores to choose the experts, not to weigh them
    router_bias: bool = False
    # the router's matmul in float32 (DeepSeek, GLM-4.5: transformers keeps gate.weight in
    # float32); False: in the compute dtype, softmax in float32 (Mixtral, Qwen)
    router_fp32: bool = False
    # grouped top-k: the experts in `expert_groups` equal groups, a token's experts chosen
    # from its best `groups_per_token` groups (DeepSeek's n_group, topk_group); 1: no groups
    expert_groups: int = 1
    groups_per_token: int = 1
    routed_scaling_factor: float = 1.0  # the k router weights times this (DeepSeek's)
    # an MLP of this width beside the experts, that every token goes through (DeepSeek's
    # shared experts: moe_intermediate_size x n_shared_experts); 0: none
    shared_expert_ffn_dim: int = 0
    # multi-head latent attention (DeepSeek-V2/V3; freetx.models.decoder.latent_attention):
    # keys and values from a compressed latent of kv_lora_rank dims; None: grouped-query
    # attention. head_dim is then the RoPE part of each query/key head (qk_rope_head_dim)
    kv_lora_rank: int | None = None
    q_lora_rank: int | None = None  # queries through a rank-q_lora_rank bottleneck; None: wq
    qk_nope_head_dim: int = 0  # the part of each query/key head without RoPE (MLA)
    v_head_dim: int | None = None  # each value head's dims (MLA); None: head_dim
    rope_interleave: bool = False  # RoPE on interleaved pairs (x0, x1), (x2, x3) (DeepSeek)
    # the embedding row of this token id gets no gradient (and starts at zero), as
    # transformers' padding_idx = config.json's pad_token_id; None: every row trains
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads is None:
            self.num_kv_heads = self.num_heads
        if self.ffn_hidden_dim is None:
            self.ffn_hidden_dim = 256 * math.ceil(int(8 * self.hidden_dim / 3) / 256)
        refuse_meaningless(self)  # sizes first: what follows divides by them
        if self.head_dim is None:
            self.head_dim = self.hidden_dim // self.num_heads
        if self.head_dim < 2 or self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim < 2 or self.rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor={self.partial_rotary_factor} rotates {self.rotary_dim} of "
                f"head_dim={self.head_dim} dims; RoPE rotates pairs, so set a factor in (0, 1] "
                "that gives an even number of at least 2"
            )
        check_rope_scaling(self.rope_scaling, self.rotary_dim)
        for name in (
            "sliding_window",
            "query_pre_attn_scalar",
            "attn_logit_softcap",
            "final_logit_softcap",
        ):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive (or null)")
        if self.moe_ffn_hidden_dim is None:
            self.moe_ffn_hidden_dim = self.ffn_hidden_dim
        if self.v_head_dim is None:
            self.v_head_dim = self.head_dim

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
        found = _size_problems(values)
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
        nope, layers = values.get("nope_layers") or [], values.get("num_layers")
        if layers is not None and not all(isinstance(i, int) and 0 <= i < layers for i in nope):
            found["nope_layers"] = (
                f"it lists the layers without RoPE by index, 0 to num_layers - 1 = {layers - 1}; "
                "list those, or [] for RoPE in every layer."
            )
        if not 0 < values.get("partial_rotary_factor", 1.0) <= 1:
            found["partial_rotary_factor"] = (
                "it is the fraction of each head's dims RoPE rotates (Phi-4-mini: 0.75); set "
                "it in (0, 1]."
            )
        return {**found, **_moe_meaningless(values), **_latent_meaningless(values)}


SIZES = (
    "vocab_size",
    "hidden_dim",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "ffn_hidden_dim",
    "max_seq_len",
)


def _size_problems(values: dict[str, Any]) -> dict[str, str]:
    """The sizes of a decoder that no decoder has (0 or fewer, heads that do not split the
    width or group the kv heads), by key; a size not given yet (an HF folder's) is skipped."""
    found = {}
    for name in SIZES:
        value = values.get(name)
        if value is not None and value < 1:
            found[name] = f"{name} is a size: set it to 1 or more."
    hidden, heads, kv_heads = (values.get(k) for k in ("hidden_dim", "num_heads", "num_kv_heads"))
    if found or heads is None:
        return found
    if values.get("head_dim") is None and hidden is not None and hidden % heads:
        found["num_heads"] = (
            f"the heads split hidden_dim={hidden} evenly (head_dim = hidden_dim / num_heads); "
            "set a num_heads that divides it, or head_dim."
        )
    elif kv_heads is not None and heads % kv_heads:
        found["num_kv_heads"] = (
            f"each kv head serves a group of the num_heads={heads} query heads; set a "
            "num_kv_heads that divides num_heads."
        )
    return found


def _latent_meaningless(values: dict[str, Any]) -> dict[str, str]:
    """Multi-head latent attention's sizes that no attention has, by key (none set: {})."""
    found = {}
    for name, least in (
        ("kv_lora_rank", 1),
        ("q_lora_rank", 1),
        ("qk_nope_head_dim", 0),
        ("v_head_dim", 1),
    ):
        value = values.get(name)
        if value is not None and (not isinstance(value, int) or value < least):
            found[name] = f"{name} is a size: set it to {least} or more (or null)."
    return found


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
    groups, kept = values.get("expert_groups", 1), values.get("groups_per_token", 1)
    if not isinstance(groups, int) or groups < 1 or experts % groups:
        found["expert_groups"] = (
            f"the experts split into equal groups: set a count that divides num_experts="
            f"{experts} (1: no groups)."
        )
    elif not isinstance(kept, int) or not 1 <= kept <= groups:
        found["groups_per_token"] = (
            f"a token's experts come from its best 1 to expert_groups={groups} groups; set "
            "groups_per_token in that range."
        )
    elif kept < groups and values.get("router_scores") == "sigmoid" and experts // groups < 2:
        found["expert_groups"] = (
            "a group is ranked by the sum of its top-2 experts' scores (DeepSeek-V3), so each "
            f"needs 2 experts or more; set a count up to {experts // 2}."
        )
    elif isinstance(k, int) and k > kept * (experts // groups):
        found["groups_per_token"] = (
            f"its {kept} group(s) of {experts // groups} experts hold fewer than "
            f"experts_per_token={k}; keep more groups per token or route to fewer experts."
        )
    if values.get("router_scores", "softmax") not in ("softmax", "sigmoid"):
        found["router_scores"] = (
            "the router scores experts by softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3); "
            "set one of those."
        )
    if (values.get("router_aux_loss_coef") or 0) < 0:
        found["router_aux_loss_coef"] = (
            "a negative weight would reward unbalanced routing; set 0 (off) or more."
        )
    return found
