"""The HF families the decoder reads and writes natively, one record each (`Family`), in
one registry (`FAMILIES`, by config.json's `model_type`): what a family's folders hold
beyond the Llama fields, and the small functions (`read`, `write`) for what no field of
the record says. `freetx.models.transformer_hf` reads and writes config.json by looping
over a family's record; adding a Llama-like family is adding a record here (and, where
the decoder lacks something it computes, a field of `TransformerConfig`).

Every `read` hook takes config.json (and the decoder's fields read so far) and returns
more decoder fields, refusing what freetx cannot compute (`unsupported`); every `write`
hook takes the decoder's config and writes what the family's config.json says beyond
the Llama fields into it, refusing what the family cannot hold.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from freetx.errors import CheckpointError
from freetx.models.attention import sliding_layers

HF = dict[str, Any]  # a config.json
Fields = dict[str, Any]  # the decoder's config fields (TransformerConfig's)


def unsupported(field: str, value: Any, supported: str, fix: str = "") -> CheckpointError:
    """The error for a config.json field the decoder does not compute."""
    return CheckpointError(
        f"config.json sets {field}={json.dumps(value)}, which freetx's decoder does not "
        f"compute ({supported}); a model built without it would give other outputs than "
        f"transformers, so it is not built.{(' ' + fix) if fix else ''}"
    )


# -- sliding windows ----------------------------------------------------------------
def no_window(hf: HF, fields: Fields) -> Fields:
    """A family without windows: a window shorter than the sequences is refused."""
    window = hf.get("sliding_window")
    if window is not None and window < fields["max_seq_len"]:
        raise unsupported(
            "sliding_window",
            window,
            "full attention",
            f"It makes no difference on sequences of up to {window} tokens: build the "
            f"model with max_seq_len={window} (a key of the model section) to train on "
            "those.",
        )
    return {}


def every_layer_window(hf: HF, fields: Fields) -> Fields:
    """Mistral's and Phi-3's `sliding_window`, on every layer."""
    return {"sliding_window": hf.get("sliding_window")}


def every_layer_window_config(c: Fields, hf: HF) -> None:
    hf["sliding_window"] = c.get("sliding_window")


def qwen_window(hf: HF, fields: Fields) -> Fields:
    """A Qwen2/Qwen3 window (`use_sliding_window`): on the layers `layer_types` names (5.x),
    or (4.x) on those from `max_window_layers` on."""
    if not hf.get("use_sliding_window"):
        return {}
    first, layers = int(hf.get("max_window_layers", 28)), int(hf["num_hidden_layers"])
    derived = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {
        "sliding_window": int(hf.get("sliding_window") or 4096),
        "layer_types": list(hf.get("layer_types") or derived),
    }


def qwen_window_config(c: Fields, hf: HF) -> None:
    """A Qwen2/Qwen3 config.json's window fields: `layer_types`, and `max_window_layers`
    (the first sliding layer, for readers without layer_types)."""
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    if not any(sliding):
        hf.update(use_sliding_window=False, sliding_window=None)
        return
    hf.update(
        use_sliding_window=True,
        sliding_window=c["sliding_window"],
        max_window_layers=sliding.index(True),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
    )


# -- Phi-3 --------------------------------------------------------------------------
def phi3_longrope(hf: HF, params: dict[str, Any]) -> dict[str, Any]:
    """The numbers Phi-3's LongRoPE takes from outside its rope parameters, as transformers
    5.24 takes them: the top-level original_max_position_embeddings (Phi3Config's field,
    4096 when absent) wins over the rope parameters' own, and a missing `factor` is
    max_position_embeddings / original_max_position_embeddings (the folder's, whatever
    length freetx's tables get), which sets the attention factor."""
    original = int(hf.get("original_max_position_embeddings", 4096))
    factor = params.get("factor")
    if factor is None:
        factor = int(hf.get("max_position_embeddings", 4096)) / original
    return {"original_max_position_embeddings": original, "factor": float(factor)}


def phi3_config(c: Fields, hf: HF) -> None:
    """What a phi3 config.json says beyond the Llama fields, for the decoder's config `c`."""
    scaling = c.get("rope_scaling") or {}
    hf.update(
        # Phi3Config reads LongRoPE's original length from here (4096 when absent)
        original_max_position_embeddings=scaling.get(
            "original_max_position_embeddings", c["max_seq_len"]
        ),
        sliding_window=c.get("sliding_window"),  # on every layer
        # freetx's dropout acts on the embeddings and both residual branches alike
        resid_pdrop=c.get("dropout", 0.0),
        embd_pdrop=c.get("dropout", 0.0),
    )


# -- Gemma --------------------------------------------------------------------------
# what transformers assumes where a Gemma config.json leaves a field out
GEMMA2_DEFAULTS = dict(query_pre_attn_scalar=256, sliding_window=4096,
                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                       sliding_window_pattern=2, tie_word_embeddings=True)  # fmt: skip
GEMMA3_DEFAULTS = dict(GEMMA2_DEFAULTS, attn_logit_softcapping=None,
                       final_logit_softcapping=None, sliding_window_pattern=6)  # fmt: skip


def gemma_settings(hf: HF, defaults: HF) -> Fields:
    """The decoder's Gemma fields from a gemma2 / gemma3_text config.json (either layout):
    norms scaling by 1 + weight, scaled embeddings, the attention's scale and soft-caps,
    the sliding layers (`layer_types`, or transformers' default pattern: every 2nd layer
    full in Gemma 2, every 6th in Gemma 3)."""
    get = {**defaults, **hf}.get
    if hf.get("use_bidirectional_attention"):
        raise unsupported("use_bidirectional_attention", True, "causal attention")
    layers, pattern = int(hf["num_hidden_layers"]), int(get("sliding_window_pattern"))
    default_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    return {
        "norm_plus_one": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": get("query_pre_attn_scalar"),
        "attn_logit_softcap": get("attn_logit_softcapping"),
        "final_logit_softcap": get("final_logit_softcapping"),
        "sliding_window": get("sliding_window"),
        "layer_types": list(hf.get("layer_types") or default_types),
        "tie_embeddings": bool(get("tie_word_embeddings")),
    }


def gemma3_settings(hf: HF, fields: Fields) -> Fields:
    """Gemma 2's fields, and Gemma 3's RoPE of sliding layers
    (`rope_parameters.sliding_attention`, 5.x; `rope_local_base_freq`, 4.x)."""
    if {**GEMMA3_DEFAULTS, **hf}.get("attn_logit_softcapping") is not None:
        raise CheckpointError(
            f"config.json sets attn_logit_softcapping={hf['attn_logit_softcapping']} for a "
            "gemma3_text model, which transformers' Gemma 3 ignores (its attention is not "
            "soft-capped), so the folder does not say which model it is. Gemma 3 has none: "
            "set it to null in config.json for the model transformers computes."
        )
    params = hf.get("rope_parameters") or {}
    if "sliding_attention" in params:
        local, scaling = rope_settings(hf, "sliding_attention")
        if scaling is not None:
            raise unsupported(
                "rope_parameters.sliding_attention",
                params["sliding_attention"],
                "unscaled RoPE on sliding layers",
            )
    else:
        local = float(hf.get("rope_local_base_freq", 10000.0))
    return {**gemma_settings(hf, GEMMA3_DEFAULTS), "rope_local_theta": local}


def gemma_config(c: Fields, hf: HF) -> None:
    """Write the decoder's Gemma fields into a gemma2 / gemma3_text config.json (5.x)."""
    hf["hidden_activation"] = hf.pop("hidden_act")
    scalar = c.get("query_pre_attn_scalar") or hf["head_dim"]
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    hf.update(
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        attn_logit_softcapping=c.get("attn_logit_softcap"),
        final_logit_softcapping=c.get("final_logit_softcap"),
        sliding_window=c.get("sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
    )


def gemma3_config(c: Fields, hf: HF) -> None:
    """Gemma 2's fields, and the RoPE of sliding layers apart."""
    gemma_config(c, hf)
    local = c.get("rope_local_theta") or c["rope_theta"]
    hf["rope_parameters"] = {
        "full_attention": hf["rope_parameters"],
        "sliding_attention": {"rope_type": "default", "rope_theta": local},
    }
    hf["use_bidirectional_attention"] = False


# -- SmolLM3 ------------------------------------------------------------------------
def smollm3_settings(hf: HF, fields: Fields) -> Fields:
    """SmolLM3's layers without RoPE (`no_rope_layers`: 1 with, 0 without; by default every
    `no_rope_layer_interval`-th layer without) and its window (`use_sliding_window`, on the
    layers `layer_types` names; by default the layers without RoPE)."""
    layers = int(hf["num_hidden_layers"])
    interval = int(hf.get("no_rope_layer_interval") or 4)
    rope = hf.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(layers)]
    found: Fields = {"nope_layers": [i for i in range(layers) if not rope[i]]}
    if hf.get("use_sliding_window") and hf.get("sliding_window") is not None:
        derived = ["full_attention" if rope[i] else "sliding_attention" for i in range(layers)]
        found["sliding_window"] = int(hf["sliding_window"])
        found["layer_types"] = list(hf.get("layer_types") or derived)
    return found


def smollm3_config(c: Fields, hf: HF) -> None:
    """A smollm3 config.json's layers without RoPE and its window."""
    nope = set(c.get("nope_layers") or ())
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    hf.update(
        no_rope_layers=[0 if i in nope else 1 for i in range(c["num_layers"])],
        use_sliding_window=any(sliding),
        sliding_window=c.get("sliding_window"),
        layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
        mlp_bias=False,
    )


# -- mixtures of experts ------------------------------------------------------------
def mixtral_experts(hf: HF) -> Fields:
    return {"moe_ffn_hidden_dim": int(hf["intermediate_size"])}


def mixtral_experts_config(c: Fields) -> HF:
    return {
        "num_local_experts": c["num_experts"],
        "router_jitter_noise": 0.0,
        "intermediate_size": c["moe_ffn_hidden_dim"],
    }


def qwen3_moe_experts(hf: HF) -> Fields:
    return {
        "moe_ffn_hidden_dim": int(hf["moe_intermediate_size"]),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "decoder_sparse_step": int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [int(i) for i in hf.get("mlp_only_layers") or []],
    }


def qwen3_moe_experts_config(c: Fields) -> HF:
    # the Hub's Qwen3-MoE folders (transformers 4.x) say num_experts; 5.x writes and reads
    # num_local_experts (num_experts an alias): both, so either version reads the export
    return {
        "num_experts": c["num_experts"],
        "num_local_experts": c["num_experts"],
        "moe_intermediate_size": c["moe_ffn_hidden_dim"],
        "norm_topk_prob": c["norm_topk_prob"],
        "decoder_sparse_step": c["decoder_sparse_step"],
        "mlp_only_layers": list(c["mlp_only_layers"]),
    }


# -- DeepSeek-V3 (and GLM-4.5's router) -----------------------------------------------
# what DeepseekV3Config (transformers 5.24) assumes where a config.json leaves a field out
DEEPSEEK_V3_DEFAULTS = dict(n_group=8, topk_group=4, routed_scaling_factor=2.5,
                            n_shared_experts=1, first_k_dense_replace=3, norm_topk_prob=True,
                            rope_interleave=True, q_lora_rank=1536, kv_lora_rank=512,
                            qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)  # fmt: skip


# Glm4MoeConfig's defaults for the same fields (GLM-4.5 states them all)
GLM4_MOE_DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0, n_shared_experts=1,
                         first_k_dense_replace=1, norm_topk_prob=True)  # fmt: skip


def deepseek_v3_experts(hf: HF, defaults: HF = DEEPSEEK_V3_DEFAULTS) -> Fields:
    """DeepSeek-V3's (and GLM-4.5's) MoE fields: sigmoid routing over n_group groups
    (topk_group kept), the weights normed (norm_topk_prob) and scaled
    (routed_scaling_factor), n_shared_experts experts' width of shared MLP, the first
    `first_k_dense_replace` layers dense; `defaults`: the config class's, for what
    config.json leaves out. No load-balancing loss (transformers computes none; the
    stored bias balances)."""
    get = {**defaults, **hf}.get
    width = int(hf["moe_intermediate_size"])
    return {
        "num_experts": int(hf.get("num_local_experts") or hf["n_routed_experts"]),
        "moe_ffn_hidden_dim": width,
        "norm_topk_prob": bool(get("norm_topk_prob")),
        "expert_groups": int(get("n_group") or 1),
        "groups_per_token": int(get("topk_group") or 1),
        "routed_scaling_factor": float(get("routed_scaling_factor")),
        "shared_expert_ffn_dim": width * int(get("n_shared_experts") or 0),
        "mlp_only_layers": list(range(int(get("first_k_dense_replace") or 0))),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef") or 0.0),
    }


def deepseek_v3_experts_config(c: Fields) -> HF:
    """config.json's MoE fields of a DeepSeek-V3 (or GLM-4.5) model for the decoder's
    config `c`; a shared width that is no whole number of experts, or dense layers that
    are not the first ones, are refused."""
    width, shared = c["moe_ffn_hidden_dim"], c.get("shared_expert_ffn_dim", 0)
    dense = sorted(c.get("mlp_only_layers") or [])
    if shared % width or dense != list(range(len(dense))) or c["decoder_sparse_step"] != 1:
        raise CheckpointError(
            f"an HF {c.get('hf_model_type')} model has shared experts of whole experts' width and its dense "
            f"layers first (first_k_dense_replace); this one has shared_expert_ffn_dim={shared} "
            f"(experts of {width}), mlp_only_layers={dense}, decoder_sparse_step="
            f"{c['decoder_sparse_step']}. Convert it to .safetensors or DCP instead."
        )
    return {
        "n_routed_experts": c["num_experts"],
        "moe_intermediate_size": width,
        "n_shared_experts": shared // width,
        "first_k_dense_replace": len(dense),
        "n_group": c["expert_groups"],
        "topk_group": c["groups_per_token"],
        "routed_scaling_factor": c["routed_scaling_factor"],
        "norm_topk_prob": c["norm_topk_prob"],
    }


def deepseek_v3_settings(hf: HF, fields: Fields) -> Fields:
    """Multi-head latent attention's shape (freetx.models.decoder.latent_attention): the
    q and kv ranks, the RoPE part of each head (head_dim = qk_rope_head_dim, as
    transformers sets it), the part without, the values' dims; RoPE on interleaved pairs.
    Every head has its own keys and values (num_key_value_heads plays no part)."""
    get = {**DEEPSEEK_V3_DEFAULTS, **hf}.get
    q_lora = get("q_lora_rank")
    return {
        **no_window(hf, fields),
        "kv_lora_rank": int(get("kv_lora_rank")),
        "q_lora_rank": None if q_lora is None else int(q_lora),
        "head_dim": int(get("qk_rope_head_dim")),
        "qk_nope_head_dim": int(get("qk_nope_head_dim")),
        "v_head_dim": int(get("v_head_dim")),
        "num_kv_heads": fields["num_heads"],
        "rope_interleave": bool(get("rope_interleave")),
    }


def deepseek_v3_config(c: Fields, hf: HF) -> None:
    """A deepseek_v3 config.json's attention fields; a decoder without multi-head latent
    attention is refused."""
    if c.get("kv_lora_rank") is None:
        raise CheckpointError(
            "an HF deepseek_v3 model has multi-head latent attention (kv_lora_rank); this one "
            "has grouped-query attention. Export it as llama or qwen3_moe (model.hf_model_type) "
            "if its other blocks fit, or convert it to .safetensors or DCP."
        )
    hf.update(
        kv_lora_rank=c["kv_lora_rank"],
        q_lora_rank=c.get("q_lora_rank"),
        qk_rope_head_dim=hf["head_dim"],
        qk_nope_head_dim=c.get("qk_nope_head_dim", 0),
        v_head_dim=c.get("v_head_dim") or hf["head_dim"],
        num_key_value_heads=c["num_heads"],
        rope_interleave=c.get("rope_interleave", False),
    )


# DeepseekV2Config's defaults (transformers 5.24)
DEEPSEEK_V2_DEFAULTS = dict(n_group=1, topk_group=1, routed_scaling_factor=1.0,
                            n_shared_experts=2, first_k_dense_replace=0, q_lora_rank=1536,
                            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                            v_head_dim=128)  # fmt: skip
DEEPSEEK_V2_TOPK = ("greedy", "group_limited_greedy")


def deepseek_v2_experts(hf: HF) -> Fields:
    """DeepSeek-V2's MoE fields: softmax routing, `topk_method` greedy (no groups) or
    group_limited_greedy (n_group groups ranked by their best score, topk_group kept),
    the weights never normed, times routed_scaling_factor; shared experts and dense
    layers first as DeepSeek-V3's."""
    method = hf.get("topk_method") or "greedy"
    if method not in DEEPSEEK_V2_TOPK:
        raise unsupported("topk_method", method, "greedy and group_limited_greedy routing")
    fields = deepseek_v3_experts(hf, DEEPSEEK_V2_DEFAULTS)
    if method == "greedy":
        fields.update(expert_groups=1, groups_per_token=1)
    return fields


def deepseek_v2_experts_config(c: Fields) -> HF:
    """config.json's MoE fields of a DeepSeek-V2 model (`deepseek_v3_experts_config`'s, and
    its top-k method)."""
    hf = deepseek_v3_experts_config(c)
    grouped = c["groups_per_token"] < c["expert_groups"]
    hf.update(topk_method=DEEPSEEK_V2_TOPK[grouped], norm_topk_prob=False)
    return hf


def deepseek_v2_settings(hf: HF, fields: Fields) -> Fields:
    """DeepSeek-V2's multi-head latent attention, as DeepSeek-V3's (its defaults), RoPE
    always on interleaved pairs (transformers' complex rotation)."""
    settings = deepseek_v3_settings({**DEEPSEEK_V2_DEFAULTS, **hf}, fields)
    return {**settings, "rope_interleave": True}


def deepseek_v2_config(c: Fields, hf: HF) -> None:
    """A deepseek_v2 config.json's attention fields (DeepSeek-V3's without rope_interleave,
    which DeepSeek-V2 always has)."""
    if c.get("kv_lora_rank") is not None and not c.get("rope_interleave"):
        raise CheckpointError(
            "an HF deepseek_v2 model rotates interleaved pairs (rope_interleave=true); this "
            "one has rope_interleave=false. Export it as deepseek_v3, or convert it to "
            ".safetensors or DCP."
        )
    deepseek_v3_config(c, hf)
    del hf["rope_interleave"]


def glm4_moe_settings(hf: HF, fields: Fields) -> Fields:
    """GLM-4.5's attention: grouped-query, RoPE on part of each head; its q/k norms
    (`use_qk_norm`) are refused."""
    if hf.get("use_qk_norm"):
        raise unsupported("use_qk_norm", True, "GLM-4.5's attention without q/k norms")
    return no_window(hf, fields)


@dataclass(frozen=True)
class Experts:
    """A family's mixture of experts (freetx.models.moe): its HF module and each expert's
    HF names of w1 (gate), w3 (up) and w2 (down) (the router is `<module>.gate.weight`);
    the decoder fields its routing fixes (`fixed`); its config.json fields (`read`, and
    `write` for the decoder's config)."""

    module: str
    names: dict[str, str]
    fixed: Fields
    read: Callable[[HF], Fields]
    write: Callable[[Fields], HF]


@dataclass(frozen=True)
class Family:
    """One HF `model_type` the decoder reads and writes, and what sets it apart."""

    model_type: str
    architecture: str  # config.json's `architectures`
    # the blocks, as TransformerConfig names them: q/k norms and where the norms are
    qk_norm: Literal["head", "projection"] | None = None
    norm_position: Literal["pre", "post", "sandwich"] = "pre"
    fused_projections: bool = False  # one q/k/v and one gate/up Linear (Phi-3)
    # RoPE may be longrope and rotate part of each head (Phi-3; transformers' other
    # decoders rotate every dim and ignore partial_rotary_factor)
    phi_rope: bool = False
    # Gemma's decoder: RMSNorms scaling by 1 + weight, embeddings times sqrt(hidden), RoPE
    # per layer type in config.json (5.x)
    gemma: bool = False
    # the attention's biases: "all_or_none" (config.json's attention_bias, on q, k, v and
    # o alike), "qkv" (on q, k, v only: Qwen2), "qkv_or_none" (attention_bias on q, k, v,
    # never on o: GLM-4.5), "none" (Phi-3, Mixtral)
    biases: Literal["all_or_none", "qkv", "qkv_or_none", "none"] = "all_or_none"
    head_dim_derived: bool = False  # config.json has no head_dim: hidden_size / heads
    # the pad_token_id transformers 5.24's config class assumes where config.json has none;
    # every family builds its embedding with padding_idx=pad_token_id
    pad_token_id: int | None = None
    # decoder fields that only some families' config.json holds (`HELD_BY_SOME`): this one's
    holds: tuple[str, ...] = ()
    window_on_every_layer: bool = False  # `sliding_window` is every layer's (no layer_types)
    yarn_rope: bool = False  # reads and writes YaRN RoPE (rope_type yarn: DeepSeek's)
    partial_rotary: bool = False  # RoPE on part of each head (partial_rotary_factor: GLM-4.5)
    experts: Experts | None = None  # a mixture of experts in the MLP
    # the odd parts: the decoder fields read from config.json beyond the Llama ones (its
    # windows, say), and what config.json says beyond them, written for a decoder's config
    read: Callable[[HF, Fields], Fields] = no_window
    write: Callable[[Fields, HF], None] = lambda c, hf: None


# decoder fields (of their default values: None, False or empty) that only some families'
# config.json can hold; a family lists those it holds in `Family.holds`
HELD_BY_SOME = ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                "rope_local_theta", "sliding_window", "nope_layers", "kv_lora_rank",
                "q_lora_rank", "qk_nope_head_dim", "rope_interleave")  # fmt: skip


# the router of Mixtral and Qwen3-MoE (freetx.models.moe.RouterKind's defaults)
SOFTMAX_ROUTER = {"router_scores": "softmax", "router_bias": False, "router_fp32": False,
                  "expert_groups": 1, "groups_per_token": 1, "routed_scaling_factor": 1.0,
                  "shared_expert_ffn_dim": 0}  # fmt: skip
MIXTRAL_EXPERTS = Experts(
    "block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"},
    fixed={"norm_topk_prob": True, "expert_weights_fp32": True, "decoder_sparse_step": 1,
           "mlp_only_layers": [], **SOFTMAX_ROUTER},
    read=mixtral_experts, write=mixtral_experts_config,
)  # fmt: skip
QWEN3_MOE_EXPERTS = Experts(
    "mlp",
    {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    fixed={"expert_weights_fp32": False, **SOFTMAX_ROUTER},
    read=qwen3_moe_experts,
    write=qwen3_moe_experts_config,
)
# DeepSeek-V3: sigmoid scores, the stored bias, the router in float32, the weights applied
# in float32 (transformers' DeepseekV3Experts multiplies by its float32 weights)
DEEPSEEK_V3_EXPERTS = Experts(
    "mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"},
    fixed={"router_scores": "sigmoid", "router_bias": True, "router_fp32": True,
           "expert_weights_fp32": True, "decoder_sparse_step": 1},
    read=deepseek_v3_experts, write=deepseek_v3_experts_config,
)  # fmt: skip
# DeepSeek-V2: softmax scores, no bias, the router in float32, the weights in float32, never
# normed
DEEPSEEK_V2_EXPERTS = Experts(
    "mlp", DEEPSEEK_V3_EXPERTS.names,
    fixed={"router_scores": "softmax", "router_bias": False, "router_fp32": True,
           "expert_weights_fp32": True, "decoder_sparse_step": 1, "norm_topk_prob": False},
    read=deepseek_v2_experts, write=deepseek_v2_experts_config,
)  # fmt: skip
GLM4_MOE_EXPERTS = replace(
    DEEPSEEK_V3_EXPERTS, read=lambda hf: deepseek_v3_experts(hf, GLM4_MOE_DEFAULTS)
)

# -- the families, in the order an error lists them ---------------------------------
FAMILIES: dict[str, Family] = {family.model_type: family for family in (
    Family("llama", "LlamaForCausalLM", write=lambda c, hf: hf.update(mlp_bias=False)),
    Family("mistral", "MistralForCausalLM", holds=("sliding_window",),
           window_on_every_layer=True, read=every_layer_window, write=every_layer_window_config),
    Family("qwen2", "Qwen2ForCausalLM", biases="qkv", head_dim_derived=True,
           holds=("sliding_window",), read=qwen_window, write=qwen_window_config),
    Family("qwen3", "Qwen3ForCausalLM", qk_norm="head", holds=("sliding_window",),
           read=qwen_window, write=qwen_window_config),
    Family("olmo2", "Olmo2ForCausalLM", qk_norm="projection", norm_position="post",
           head_dim_derived=True, pad_token_id=1),
    Family("mixtral", "MixtralForCausalLM", biases="none", experts=MIXTRAL_EXPERTS,
           write=every_layer_window_config),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", qk_norm="head", experts=QWEN3_MOE_EXPERTS,
           holds=("sliding_window",), read=qwen_window, write=qwen_window_config),
    Family("phi3", "Phi3ForCausalLM", fused_projections=True, phi_rope=True, biases="none",
           head_dim_derived=True, pad_token_id=32000, holds=("sliding_window",),
           window_on_every_layer=True, read=every_layer_window, write=phi3_config),
    Family("gemma2", "Gemma2ForCausalLM", norm_position="sandwich", gemma=True, pad_token_id=0,
           holds=("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap",
                  "sliding_window"),
           read=lambda hf, fields: gemma_settings(hf, GEMMA2_DEFAULTS), write=gemma_config),
    Family("gemma3_text", "Gemma3ForCausalLM", qk_norm="head", norm_position="sandwich",
           gemma=True, pad_token_id=0,
           holds=("query_pre_attn_scalar", "final_logit_softcap", "rope_local_theta",
                  "sliding_window"),
           read=gemma3_settings, write=gemma3_config),
    # DeepSeek-V3 (and its fine-tunes: Kimi K2, Moonlight): multi-head latent attention,
    # sigmoid-routed experts with a stored bias and grouped top-k, shared experts, dense
    # layers first; its multi-token-prediction layer (past num_hidden_layers) is not read
    Family("deepseek_v3", "DeepseekV3ForCausalLM", experts=DEEPSEEK_V3_EXPERTS, yarn_rope=True,
           holds=("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "rope_interleave"),
           read=deepseek_v3_settings, write=deepseek_v3_config),
    # DeepSeek-V2, V2-Lite, V2.5: the same attention (RoPE always interleaved), softmax
    # routing (greedy or group-limited), shared experts, dense layers first
    Family("deepseek_v2", "DeepseekV2ForCausalLM", experts=DEEPSEEK_V2_EXPERTS, yarn_rope=True,
           holds=("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "rope_interleave"),
           read=deepseek_v2_settings, write=deepseek_v2_config),
    # GLM-4.5 / 4.6: DeepSeek-V3's router and shared experts, grouped-query attention with
    # RoPE on part of each head, q/k/v biases (attention_bias); its MTP layer not read
    Family("glm4_moe", "Glm4MoeForCausalLM", experts=GLM4_MOE_EXPERTS, biases="qkv_or_none",
           partial_rotary=True, read=glm4_moe_settings,
           write=lambda c, hf: hf.update(use_qk_norm=False)),
    # SmolLM3: Llama's blocks, every 4th layer without RoPE (NoPE)
    Family("smollm3", "SmolLM3ForCausalLM", pad_token_id=128004,
           holds=("sliding_window", "nope_layers"), read=smollm3_settings,
           write=smollm3_config),
)}  # fmt: skip


def rope_settings(hf: HF, layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config.json layout; unsupported kinds refused.
    `layer_type`: the RoPE of those layers where `rope_parameters` has one per layer type
    (Gemma 3, 5.x); None: such a config is refused."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        if layer_type is None:
            raise unsupported("rope_parameters", params, "one RoPE for every layer")
        hf, params = {}, params.get(layer_type)
    params = dict(params or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("partial_rotary_factor", None)
    if kind == "default":
        return float(theta), None
    family = FAMILIES.get(hf.get("model_type"))
    if family is not None and family.phi_rope and kind in ("su", "yarn", "longrope"):
        kind = "longrope"  # su and yarn: older names of Phi-3's LongRoPE, as Phi3Config reads them
        params.update(phi3_longrope(hf, params))
    elif kind not in ("llama3", "linear") and not (kind == "yarn" and family and family.yarn_rope):
        raise unsupported(
            "rope_type", kind, "default, llama3, linear, (Phi-3) longrope and (DeepSeek) yarn RoPE"
        )
    if kind == "yarn":  # transformers: a missing factor is max / original positions
        params.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
        if params.get("factor") is None:
            params["factor"] = (
                hf["max_position_embeddings"] / params["original_max_position_embeddings"]
            )
    if kind == "llama3":
        params.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 8192)
        )
    return float(theta), {"rope_type": kind, **params}
