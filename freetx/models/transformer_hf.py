"""The HF layouts of the decoder (`Transformer.hf_layout`): tensor names and config.json
for the Llama family as `transformers` writes it: Llama 2/3/3.1/3.2/3.3, Mistral,
Qwen2/Qwen2.5, Qwen3 (q/k norms per head), OLMo 2 (q/k norms over the projections,
post-norms), Phi-3/3.5/4 (fused qkv_proj and gate_up_proj, LongRoPE, partial rotary),
Gemma 2 and Gemma 3 text (norms before and after, `gemma_settings`; Gemma 3's multimodal
folders read as their text model, `text_model_config`), sliding windows of Mistral, Phi-3,
Qwen2/3 and Gemma on the layers config.json names, and the mixtures of experts Mixtral and
Qwen3-MoE.

A tensor of freetx can be the stack of several HF tensors: an MoE block keeps each
projection of all its experts in one tensor (`feed_forward.experts.w1` [E, F, H]), which
folders store one per expert (Mixtral: `block_sparse_moe.experts.{e}.w1.weight`,
Qwen3-MoE: `mlp.experts.{e}.gate_proj.weight`). Slice e along dim 0 is expert e's HF
tensor: `stack_index` says which slice an HF tensor is, `to_hf_names` lists a stacked
tensor's HF names in order; the checkpoint package stacks on read and unstacks on write
through these two alone.

freetx's decoder uses the rotate-half RoPE convention of HF's Llama, so weights
convert by renaming alone (no permutation of the q/k projections). config.json
is read in both layouts transformers has used: `rope_theta` and `rope_scaling`
at the top (4.x) and `rope_parameters: {rope_theta, rope_type, ...}` (5.x). A
field freetx cannot honour (another rope type, a window on a type whose transformers
class has none, biases on the MLP, another activation) is refused with its name: a model freetx builds
from a folder computes what transformers computes, or it is not built.

`freetx.models.transformer.hf_decoder(path, **fields)` builds the decoder a
folder's config.json describes (on the meta device, like any builder); its
weights come with `checkpoint.initial_weights=PATH`. The checkpoint package asks a model class
for its layout (`freetx.models.hf`); it knows no model itself.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from freetx.errors import CheckpointError
from freetx.models.attention import sliding_layers

# freetx name pattern -> HF name pattern ({i} is the layer index)
_NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("layers.{i}.attention.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
    ("layers.{i}.feed_forward.w13.weight", "model.layers.{i}.mlp.gate_up_proj.weight"),  # Phi-3
]
_ATTENTION = (("wq", "q_proj"), ("wk", "k_proj"), ("wv", "v_proj"), ("wo", "o_proj"))
for _ours, _theirs in (*_ATTENTION, ("wqkv", "qkv_proj")):
    for _kind in ("weight", "bias"):
        _NAMES.append(
            (
                f"layers.{{i}}.attention.{_ours}.{_kind}",
                f"model.layers.{{i}}.self_attn.{_theirs}.{_kind}",
            )
        )
# the block's norms, by where they are: HF's post_attention_layernorm is the norm before
# the MLP in a pre-norm block (Llama) and the norm after attention in a post-norm one (OLMo 2)
_NORM_NAMES = {
    "pre": [
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ],
    "post": [
        ("layers.{i}.post_attention_norm.weight",
         "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.post_ffn_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    ],
    "sandwich": [
        ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
        ("layers.{i}.post_attention_norm.weight",
         "model.layers.{i}.post_attention_layernorm.weight"),
        ("layers.{i}.pre_ffn_norm.weight", "model.layers.{i}.pre_feedforward_layernorm.weight"),
        ("layers.{i}.post_ffn_norm.weight", "model.layers.{i}.post_feedforward_layernorm.weight"),
    ],
}  # fmt: skip
# an MoE block (freetx.models.moe), by model type: its HF module, and each expert's HF
# names of w1 (gate), w3 (up) and w2 (down); the router is `<module>.gate.weight`
MOE_MODULES = {
    "mixtral": ("block_sparse_moe", {"w1": "w1", "w3": "w3", "w2": "w2"}),
    "qwen3_moe": ("mlp", {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}),
}
_ROUTER = r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$"
_EXPERT = (
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_NAMES = {hf: ours for _, names in MOE_MODULES.values() for ours, hf in names.items()}
_OURS_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|experts\.(w1|w2|w3))$")
# tensors some folders carry that are not weights (older Llama checkpoints)
IGNORED_HF_TENSORS = re.compile(r"^model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq$")
# multimodal model types read as their text decoder -> its model_type (Gemma 3 4B-27B:
# `Gemma3ForConditionalGeneration`, the text model's fields in `text_config`)
TEXT_MODEL_OF = {"gemma3": "gemma3_text"}
# a multimodal folder's tensors as transformers writes them (4.x names, which 5.x's
# save_pretrained writes too): the text model's under `language_model.`, renamed to a text
# folder's; the vision tower's and projector's skipped (not part of the text model)
_TEXT_MODEL_TENSOR = re.compile(r"^language_model\.(?=model\.|lm_head\.)")
OTHER_MODALITIES = re.compile(r"^(?:vision_tower|multi_modal_projector)\.")

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# the blocks of each model_type: (qk_norm, norm_position), as TransformerConfig names them
BLOCKS = {
    "llama": (None, "pre"),
    "mistral": (None, "pre"),
    "qwen2": (None, "pre"),
    "qwen3": ("head", "pre"),
    "olmo2": ("projection", "post"),
    "mixtral": (None, "pre"),
    "qwen3_moe": ("head", "pre"),
    "phi3": (None, "pre"),
    "gemma2": (None, "sandwich"),
    "gemma3_text": ("head", "sandwich"),
}
# model types whose q/k/v and gate/up projections are one Linear each (fused_projections)
FUSED_PROJECTIONS = ("phi3",)
# model types whose RoPE may be longrope and rotate part of each head (transformers' other
# decoders rotate every dim and ignore partial_rotary_factor)
PHI_ROPE = ("phi3",)
# Gemma's decoder: RMSNorm scaling by 1 + weight, embeddings times sqrt(hidden), the
# attention's scale, soft-capping and sliding windows in config.json (gemma_settings)
GEMMA_TYPES = ("gemma2", "gemma3_text")
# activations as config.json names them -> TransformerConfig's
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# the pad_token_id transformers 5.24's config classes assume where config.json has none (the
# others: None); every family here builds its embedding with padding_idx=pad_token_id
PAD_TOKEN_IDS = {"olmo2": 1, "phi3": 32000, "gemma2": 0, "gemma3_text": 0}
# model types whose `sliding_window` applies to every layer (they have no layer_types)
EVERY_LAYER_WINDOW = ("mistral", "phi3")
# model types whose config.json has no head_dim (derived from hidden_size / heads)
_DERIVED_HEAD_DIM = ("qwen2", "olmo2", "phi3")
# what transformers 5.24 (and 4.50) assumes where a gemma3 folder's text_config leaves a
# field out (Gemma3TextConfig's defaults: the Hub's 4B-27B configs list only a few fields)
_GEMMA3_TEXT_DEFAULTS = dict(
    model_type="gemma3_text", vocab_size=262208, hidden_size=2304, intermediate_size=9216,
    num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4, head_dim=256,
    hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
    rope_theta=1e6, rope_local_base_freq=1e4, pad_token_id=0, eos_token_id=1, bos_token_id=2,
)  # fmt: skip


def text_model_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The config.json of a folder's text decoder: a multimodal folder's `text_config` (with
    transformers' defaults for what it leaves out, the token ids set at the top); any other
    config.json as it is."""
    if hf.get("model_type") not in TEXT_MODEL_OF:
        return hf
    text = hf.get("text_config") or {}
    ids = {k: hf[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in hf}
    return {**_GEMMA3_TEXT_DEFAULTS, **text, **ids}


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [
    (_pattern(ours), theirs)
    for ours, theirs in dict.fromkeys(_NAMES + [n for ns in _NORM_NAMES.values() for n in ns])
]
_FROM_HF = {
    position: [(_pattern(theirs), ours) for ours, theirs in _NAMES + names]
    for position, names in _NORM_NAMES.items()
}


def _rename(name: str, table) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    return None


def _unsupported(field: str, value: Any, supported: str, fix: str = "") -> CheckpointError:
    return CheckpointError(
        f"config.json sets {field}={json.dumps(value)}, which freetx's decoder does not "
        f"compute ({supported}); a model built without it would give other outputs than "
        f"transformers, so it is not built.{(' ' + fix) if fix else ''}"
    )


def rope_settings(hf: dict[str, Any], layer_type: str | None = None) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either config.json layout; unsupported kinds refused.
    `layer_type`: the RoPE of those layers where `rope_parameters` has one per layer type
    (Gemma 3, 5.x); None: such a config is refused."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and any(isinstance(v, dict) for v in params.values()):
        if layer_type is None:
            raise _unsupported("rope_parameters", params, "one RoPE for every layer")
        hf, params = {}, params.get(layer_type)
    params = dict(params or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    kind = params.pop("rope_type", params.pop("type", "default"))
    params.pop("partial_rotary_factor", None)
    if kind == "default":
        return float(theta), None
    if hf.get("model_type") in PHI_ROPE and kind in ("su", "yarn", "longrope"):
        kind = "longrope"  # su and yarn: older names of Phi-3's LongRoPE, as Phi3Config reads them
        params.update(_phi3_longrope(hf, params))
    elif kind not in ("llama3", "linear"):
        raise _unsupported("rope_type", kind, "default, llama3, linear and (Phi-3) longrope RoPE")
    if kind == "llama3":
        params.setdefault(
            "original_max_position_embeddings", hf.get("max_position_embeddings", 8192)
        )
    return float(theta), {"rope_type": kind, **params}


def _phi3_longrope(hf: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
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


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The fraction of each head RoPE rotates: in the rope parameters (transformers 5) or at
    the top of config.json (Phi-4-mini's folders); 1.0 when neither has it."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


# what transformers assumes where a Gemma config.json leaves a field out
_GEMMA_DEFAULTS = {
    "gemma2": dict(query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0, sliding_window_pattern=2,
                   tie_word_embeddings=True),
    "gemma3_text": dict(query_pre_attn_scalar=256, sliding_window=4096,
                        attn_logit_softcapping=None, final_logit_softcapping=None,
                        sliding_window_pattern=6, tie_word_embeddings=True),
}  # fmt: skip


def gemma_settings(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The decoder's Gemma fields from a gemma2 / gemma3_text config.json (either layout):
    norms scaling by 1 + weight, scaled embeddings, the attention's scale and soft-caps,
    the sliding layers (`layer_types`, or transformers' default pattern: every 2nd layer
    full in Gemma 2, every 6th in Gemma 3) and Gemma 3's RoPE of sliding layers
    (`rope_parameters.sliding_attention`, 5.x; `rope_local_base_freq`, 4.x)."""
    get = {**_GEMMA_DEFAULTS[model_type], **hf}.get
    if hf.get("use_bidirectional_attention"):
        raise _unsupported("use_bidirectional_attention", True, "causal attention")
    if model_type == "gemma3_text" and get("attn_logit_softcapping") is not None:
        raise CheckpointError(
            f"config.json sets attn_logit_softcapping={get('attn_logit_softcapping')} for a "
            "gemma3_text model, which transformers' Gemma 3 ignores (its attention is not "
            "soft-capped), so the folder does not say which model it is. Gemma 3 has none: "
            "set it to null in config.json for the model transformers computes."
        )
    layers, pattern = int(hf["num_hidden_layers"]), int(get("sliding_window_pattern"))
    default_types = [
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
    ]
    fields = {
        "norm_plus_one": True,
        "scale_embeddings": True,
        "query_pre_attn_scalar": get("query_pre_attn_scalar"),
        "attn_logit_softcap": get("attn_logit_softcapping"),
        "final_logit_softcap": get("final_logit_softcapping"),
        "sliding_window": get("sliding_window"),
        "layer_types": list(hf.get("layer_types") or default_types),
        "tie_embeddings": bool(get("tie_word_embeddings")),
    }
    if model_type == "gemma3_text":
        params = hf.get("rope_parameters") or {}
        if "sliding_attention" in params:
            local, scaling = rope_settings(hf, "sliding_attention")
            if scaling is not None:
                raise _unsupported(
                    "rope_parameters.sliding_attention", params["sliding_attention"],
                    "unscaled RoPE on sliding layers",
                )  # fmt: skip
        else:
            local = float(hf.get("rope_local_base_freq", 10000.0))
        fields["rope_local_theta"] = local
    return fields


def _gemma_config(model_type: str, c: dict[str, Any], hf: dict[str, Any]) -> None:
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
    )  # fmt: skip
    if model_type == "gemma3_text":
        local = c.get("rope_local_theta") or c["rope_theta"]
        hf["rope_parameters"] = {
            "full_attention": hf["rope_parameters"],
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }
        hf["use_bidirectional_attention"] = False


# fields only some model types' config.json can hold -> those types
_HELD_BY = {
    "query_pre_attn_scalar": GEMMA_TYPES,
    "attn_logit_softcap": ("gemma2",),
    "final_logit_softcap": GEMMA_TYPES,
    "rope_local_theta": ("gemma3_text",),
    "sliding_window": ("mistral", "phi3", "qwen2", "qwen3", "qwen3_moe", *GEMMA_TYPES),
}


def _qwen_window(hf: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2/Qwen3 window (`use_sliding_window`): on the layers `layer_types` names (5.x),
    or (4.x) on those from `max_window_layers` on."""
    first, layers = int(hf.get("max_window_layers", 28)), int(hf["num_hidden_layers"])
    derived = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return {
        "sliding_window": int(hf.get("sliding_window") or 4096),
        "layer_types": list(hf.get("layer_types") or derived),
    }


def _qwen_window_config(c: dict[str, Any]) -> dict[str, Any]:
    """A Qwen2/Qwen3 config.json's window fields: `layer_types`, and `max_window_layers`
    (the first sliding layer, for readers without layer_types)."""
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    if not any(sliding):
        return {"use_sliding_window": False, "sliding_window": None}
    return {
        "use_sliding_window": True,
        "sliding_window": c["sliding_window"],
        "max_window_layers": sliding.index(True),
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


def _not_held(model_type: str, c: dict[str, Any]) -> list[str]:
    """The decoder's fields (as `name=value`) an HF `model_type` model cannot have."""
    gemma = model_type in GEMMA_TYPES
    found = [
        f"{name}={json.dumps(c.get(name, False))}"
        for name in ("norm_plus_one", "scale_embeddings")
        if c.get(name, False) != gemma
    ]
    found += [f"{name}={json.dumps(c[name])}" for name, types in _HELD_BY.items()
              if c.get(name) is not None and model_type not in types]  # fmt: skip
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    if model_type in EVERY_LAYER_WINDOW and any(sliding) and not all(sliding):
        found.append(f"layer_types={json.dumps(c['layer_types'])}")
    return found


class LlamaFamilyLayout:
    """How `freetx.models.transformer.Transformer` maps to HF Llama, Mistral, Qwen2, Qwen3,
    OLMo 2, Gemma 2 and Gemma 3 text folders (the same tensors; Qwen2 adds q/k/v biases,
    Qwen3, OLMo 2 and Gemma 3 q/k norms, OLMo 2 puts its block norms after attention and
    MLP, Gemma before and after).

    One layout per norm position, since HF's `post_attention_layernorm` names a different
    norm in each: `model_types` are the types it reads. Writing needs no such choice
    (freetx's names differ: a sandwich block's norm before the MLP is `pre_ffn_norm`, a
    pre-norm block's `ffn_norm`), so any layout writes every model type.
    """

    model_class = "freetx.models.transformer.Transformer"

    def __init__(self, norm_position: str) -> None:
        self.norm_position = norm_position
        self.model_types = tuple(t for t, (_, p) in BLOCKS.items() if p == norm_position)
        self.model_types += tuple(m for m, t in TEXT_MODEL_OF.items() if t in self.model_types)

    def to_hf_name(self, name: str) -> str:
        renamed = _rename(name, _TO_HF)
        if renamed is None:
            raise CheckpointError(
                f"tensor {name} has no HF Llama name; only the Llama-style decoder "
                f"({self.model_class}) converts to an HF folder."
            )
        return renamed

    def to_hf_names(self, name: str, rows: int, model_config: dict[str, Any]) -> list[str]:
        """The HF tensors freetx tensor `name` (of `rows` rows) is written as, in a model of
        `model_config`: its one HF name, or for a stacked tensor (an MoE block's experts)
        one per slice along dim 0, in order."""
        moe = _OURS_MOE.match(name)
        if moe is None:
            return [self.to_hf_name(name)]
        model_type = model_config.get("hf_model_type", "llama")
        if model_type not in MOE_MODULES:
            raise CheckpointError(
                f"tensor {name} belongs to a mixture of experts, which an HF {model_type} "
                f"model does not have; export it as {' or '.join(MOE_MODULES)}."
            )
        module, expert_names = MOE_MODULES[model_type]
        prefix = f"model.layers.{moe.group(1)}.{module}"
        if moe.group(3) is None:
            return [f"{prefix}.gate.weight"]
        return [f"{prefix}.experts.{e}.{expert_names[moe.group(3)]}.weight" for e in range(rows)]

    def stack_index(self, name: str) -> int | None:
        """Which slice along dim 0 of its freetx tensor (`from_hf_name`) HF tensor `name`
        is, for a tensor stacked from several (an MoE block's experts); None otherwise."""
        expert = re.match(_EXPERT, name)
        return None if expert is None else int(expert.group(2))

    def from_hf_name(self, name: str) -> str | None:
        """freetx's name of an HF tensor (of the stacked tensor it is a slice of, for an
        expert's); None for tensors that are not weights."""
        if IGNORED_HF_TENSORS.match(name) or OTHER_MODALITIES.match(name):
            return None
        name = _TEXT_MODEL_TENSOR.sub("", name)
        expert, router = re.match(_EXPERT, name), re.match(_ROUTER, name)
        if expert is not None:
            layer, _, projection = expert.groups()
            return f"layers.{layer}.feed_forward.experts.{_EXPERT_NAMES[projection]}"
        if router is not None:
            return f"layers.{router.group(1)}.feed_forward.gate.weight"
        renamed = _rename(name, _FROM_HF[self.norm_position])
        if renamed is None:
            raise CheckpointError(
                f"HF tensor {name} is not part of a {'/'.join(self.model_types)} model freetx "
                "can read."
            )
        return renamed

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]:
        """`config.json` of the model's HF architecture, with the decoder's shape."""
        c = model_config
        model_type = c.get("hf_model_type", "llama")
        qkv_bias, wo_bias = c.get("qkv_bias", False), c.get("wo_bias", False)
        check_blocks(
            model_type, c.get("qk_norm"), c.get("norm_position", "pre"), bool(c.get("num_experts"))
        )
        check_projections(model_type, c.get("fused_projections", False))
        partial = c.get("partial_rotary_factor", 1.0)
        check_rope(model_type, c.get("rope_scaling"), partial)
        check_fields(model_type, c)
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": c["vocab_size"],
            "hidden_size": c["hidden_dim"],
            "intermediate_size": c["ffn_hidden_dim"],
            "num_hidden_layers": c["num_layers"],
            "num_attention_heads": c["num_heads"],
            "num_key_value_heads": c["num_kv_heads"],
            "head_dim": c.get("head_dim") or c["hidden_dim"] // c["num_heads"],
            "max_position_embeddings": c["max_seq_len"],
            "rope_parameters": {
                "rope_theta": c["rope_theta"],
                "rope_type": "default",
                **(c.get("rope_scaling") or {}),
                **({"partial_rotary_factor": partial} if partial != 1.0 else {}),
            },
            "rms_norm_eps": c["norm_eps"],
            "tie_word_embeddings": c["tie_embeddings"],
            "hidden_act": {v: k for k, v in _ACTIVATIONS.items()}[c.get("activation", "silu")],
            "attention_dropout": c.get("attention_dropout", 0.0),
            "initializer_range": c.get("init_std", 0.02),
            "pad_token_id": c.get("pad_token_id"),  # the embedding's row without gradient
            "dtype": dtype,
        }
        if model_type == "qwen2":
            if wo_bias or not qkv_bias:
                raise CheckpointError(
                    "a qwen2 model has biases on q, k and v and none on o; this one has "
                    f"qkv_bias={qkv_bias}, wo_bias={wo_bias}. Export it as llama "
                    "(model.hf_model_type=llama) instead."
                )
            hf.update(_qwen_window_config(c))
        elif model_type == "phi3":
            hf.update(_phi3_config(c))
        else:
            if qkv_bias != wo_bias:
                raise CheckpointError(
                    f"an HF {model_type} model has biases on all of q, k, v, o or on none; this "
                    f"one has qkv_bias={qkv_bias}, wo_bias={wo_bias}. "
                    + ("Export it as qwen2." if BLOCKS[model_type] == BLOCKS["qwen2"]
                       else "Convert it to .safetensors or DCP instead.")
                )  # fmt: skip
            if model_type != "mixtral":  # Mixtral's attention has no biases
                hf["attention_bias"] = qkv_bias
            if model_type in ("mistral", "mixtral"):
                hf["sliding_window"] = c.get("sliding_window")
            elif model_type in GEMMA_TYPES:
                _gemma_config(model_type, c, hf)
            elif model_type in ("qwen3", "qwen3_moe"):
                hf.update(_qwen_window_config(c))
            elif model_type == "llama":
                hf["mlp_bias"] = False
        if model_type in _DERIVED_HEAD_DIM:
            if hf["head_dim"] * c["num_heads"] != c["hidden_dim"]:
                raise CheckpointError(
                    f"an HF {model_type} model has head_dim = hidden_size / heads; this one has "
                    f"head_dim={hf['head_dim']}, hidden_dim={c['hidden_dim']}, "
                    f"num_heads={c['num_heads']}. Convert it to .safetensors or DCP instead."
                )
            del hf["head_dim"]
        hf.update(_moe_to_hf(c, model_type))
        return hf

    def from_hf_config(self, hf: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
        """The decoder's config fields from an HF config.json (any of ARCHITECTURES);
        `max_seq_len` replaces max_position_embeddings (the RoPE tables' length)."""
        hf = text_model_config(hf)
        model_type = hf.get("model_type")
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            theta, scaling = rope_settings(
                hf, "full_attention" if model_type in GEMMA_TYPES else None
            )
            fields = {
                "vocab_size": int(hf["vocab_size"]),
                "hidden_dim": hidden,
                "num_layers": int(hf["num_hidden_layers"]),
                "num_heads": num_heads,
                "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
                "ffn_hidden_dim": int(hf["intermediate_size"]),
                "max_seq_len": int(max_seq_len or hf.get("max_position_embeddings", 2048)),
                "rope_theta": theta,
                "rope_scaling": scaling,
                "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
                "attention_dropout": float(hf.get("attention_dropout") or 0.0),
                "init_std": float(hf.get("initializer_range", 0.02)),
                "dropout": float(hf.get("resid_pdrop") or 0.0),  # Phi-3's; others have none
                "partial_rotary_factor": partial_rotary_factor(hf),
                "fused_projections": model_type in FUSED_PROJECTIONS,
                "head_dim": int(hf.get("head_dim") or hidden // num_heads),
                "hf_model_type": model_type,
                "pad_token_id": hf.get("pad_token_id", PAD_TOKEN_IDS.get(model_type)),
                "qk_norm": BLOCKS[model_type][0],
                "norm_position": BLOCKS[model_type][1],
                **_moe_from_hf(hf, model_type),
            }
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"config.json lacks the field {e} (or holds a wrong type); it is not a complete "
                f"transformers {model_type} config. Restore it from the model's original folder."
            ) from None
        # Gemma 2 and 3 name it hidden_activation (4.x: hidden_act too, which Gemma 2 ignored)
        key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
        if hf.get(key, "silu") not in _ACTIVATIONS:
            raise _unsupported(key, hf[key], f"gated MLPs with {', '.join(_ACTIVATIONS)}")
        fields["activation"] = _ACTIVATIONS[hf.get(key, "silu")]
        if hf.get("mlp_bias"):
            raise _unsupported("mlp_bias", True, "MLPs without biases")
        if fields["partial_rotary_factor"] != 1.0 and model_type not in PHI_ROPE:
            raise _unsupported(
                "partial_rotary_factor", fields["partial_rotary_factor"],
                f"RoPE on every dim of a {model_type} model's heads, as transformers computes it",
            )  # fmt: skip
        if model_type == "qwen2":
            fields.update(qkv_bias=True, wo_bias=False)
        else:
            bias = bool(hf.get("attention_bias", False))
            fields.update(qkv_bias=bias, wo_bias=bias)
        if model_type in ("qwen2", "qwen3", "qwen3_moe"):
            if hf.get("use_sliding_window"):
                fields.update(_qwen_window(hf))
        elif model_type in GEMMA_TYPES:
            fields.update(gemma_settings(hf, model_type))
        elif model_type in EVERY_LAYER_WINDOW:
            fields["sliding_window"] = hf.get("sliding_window")
        else:
            window = hf.get("sliding_window")
            if window is not None and window < fields["max_seq_len"]:
                raise _unsupported(
                    "sliding_window", window, "full attention",
                    f"It makes no difference on sequences of up to {window} tokens: build the "
                    f"model with max_seq_len={window} (a key of the model section) to train on "
                    "those.",
                )  # fmt: skip
        pad = fields["pad_token_id"]
        if pad is not None and not 0 <= pad < fields["vocab_size"]:
            given = "sets" if "pad_token_id" in hf else f"has none, and {model_type} assumes"
            raise CheckpointError(
                f"config.json {given} pad_token_id={pad}, outside vocab_size="
                f"{fields['vocab_size']}: the embedding has no such padding row (transformers "
                "cannot build this model either). Set pad_token_id in config.json to the "
                "tokenizer's pad id, or null for none."
            )
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"} and "layer_types" not in fields:
            raise _unsupported("layer_types", sorted(layer_types), "full attention in every layer")
        return fields


def _phi3_config(c: dict[str, Any]) -> dict[str, Any]:
    """What a phi3 config.json says beyond the Llama fields, for the decoder's config `c`."""
    if c.get("qkv_bias") or c.get("wo_bias"):
        raise CheckpointError(
            f"an HF phi3 model has no biases on its projections; this one has qkv_bias="
            f"{c.get('qkv_bias')}, wo_bias={c.get('wo_bias')}. Convert it to .safetensors or "
            "DCP instead."
        )
    scaling = c.get("rope_scaling") or {}
    return {
        # Phi3Config reads LongRoPE's original length from here (4096 when absent)
        "original_max_position_embeddings": scaling.get(
            "original_max_position_embeddings", c["max_seq_len"]
        ),
        "sliding_window": c.get("sliding_window"),  # on every layer
        # freetx's dropout acts on the embeddings and both residual branches alike
        "resid_pdrop": c.get("dropout", 0.0),
        "embd_pdrop": c.get("dropout", 0.0),
    }


def check_rope(model_type: str, scaling: dict | None, partial: float) -> None:
    """A model exports as `model_type` only with a RoPE that type computes."""
    kind = (scaling or {}).get("rope_type", "default")
    phi = model_type in PHI_ROPE
    kinds = ("default", "longrope") if phi else ("default", "llama3", "linear")
    if kind not in kinds or (partial != 1.0 and not phi):
        raise CheckpointError(
            f"an HF {model_type} model has {', '.join(kinds)} RoPE"
            f"{'' if phi else ' on every dim of each head'}; this one has rope_type={kind}, "
            f"partial_rotary_factor={partial}. "
            + ("Convert" if phi else "Export it as phi3 (model.hf_model_type=phi3) if its "
               "projections are fused, or convert")
            + " it to .safetensors or DCP."
        )  # fmt: skip


def check_projections(model_type: str, fused: bool) -> None:
    """A model exports as `model_type` only with that type's projections (fused or not)."""
    if (model_type in FUSED_PROJECTIONS) != fused:
        fits = [t for t in BLOCKS if (t in FUSED_PROJECTIONS) == fused]
        raise CheckpointError(
            f"an HF {model_type} model has fused_projections={not fused} (q/k/v and gate/up "
            f"{'in one Linear each' if not fused else 'apart'}); this one has fused_projections="
            f"{fused}. Export it as {' or '.join(fits)} (model.hf_model_type={fits[0]}) if its "
            "other blocks fit, or convert it to .safetensors or DCP."
        )


def _moe_from_hf(hf: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The decoder's MoE fields from a Mixtral or Qwen3-MoE config.json ({} for the others)."""
    if model_type not in MOE_MODULES:
        return {}
    if hf.get("router_jitter_noise"):
        raise _unsupported(
            "router_jitter_noise", hf["router_jitter_noise"], "routers without noise",
            "Set it to 0.0 to train without the noise.",
        )  # fmt: skip
    mixtral = model_type == "mixtral"
    return {
        "num_experts": int(hf.get("num_local_experts") or hf["num_experts"]),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "moe_ffn_hidden_dim": int(hf["intermediate_size" if mixtral else "moe_intermediate_size"]),
        "norm_topk_prob": mixtral or bool(hf.get("norm_topk_prob", False)),
        "expert_weights_fp32": mixtral,
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        "decoder_sparse_step": 1 if mixtral else int(hf.get("decoder_sparse_step") or 1),
        "mlp_only_layers": [] if mixtral else [int(i) for i in hf.get("mlp_only_layers") or []],
    }


def _moe_to_hf(c: dict[str, Any], model_type: str) -> dict[str, Any]:
    """config.json's MoE fields of `model_type` for a decoder's config `c`, or an error when
    its experts (or their absence) do not fit that model type."""
    experts = int(c.get("num_experts") or 0)
    if (model_type in MOE_MODULES) != bool(experts):
        kinds = " or ".join(MOE_MODULES) if experts else "a dense type (llama, qwen3, ...)"
        raise CheckpointError(
            f"an HF {model_type} model {'has' if model_type in MOE_MODULES else 'has no'} "
            f"experts; this one has num_experts={experts}. Export it as {kinds} "
            "(model.hf_model_type) instead."
        )
    if not experts:
        return {}
    mixtral = model_type == "mixtral"
    fixed = (
        {"norm_topk_prob": True, "expert_weights_fp32": True, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "qkv_bias": False, "wo_bias": False}
        if mixtral else {"expert_weights_fp32": False}
    )  # fmt: skip
    differing = {k: c.get(k) for k, v in fixed.items() if c.get(k) != v}
    if differing:
        raise CheckpointError(
            f"an HF {model_type} model has {json.dumps(fixed)}; this one has "
            f"{json.dumps(differing)}. Convert it to .safetensors or DCP instead."
        )
    common = {
        "num_experts_per_tok": c["experts_per_token"],
        "router_aux_loss_coef": c.get("router_aux_loss_coef", 0.0),
        "output_router_logits": False,
    }
    if mixtral:
        return {**common, "num_local_experts": experts, "router_jitter_noise": 0.0,
                "intermediate_size": c["moe_ffn_hidden_dim"]}  # fmt: skip
    # the Hub's Qwen3-MoE folders (transformers 4.x) say num_experts; 5.x writes and reads
    # num_local_experts (num_experts an alias): both, so either version reads the export
    return {**common, "num_experts": experts, "num_local_experts": experts,
            "moe_intermediate_size": c["moe_ffn_hidden_dim"],
            "norm_topk_prob": c["norm_topk_prob"],
            "decoder_sparse_step": c["decoder_sparse_step"],
            "mlp_only_layers": list(c["mlp_only_layers"])}  # fmt: skip


def check_fields(model_type: str, c: dict[str, Any]) -> None:
    """A model exports as `model_type` only if that type's config.json holds all it computes
    (Gemma's norms and embedding scale, soft-caps, windows)."""
    found = _not_held(model_type, c)
    if found:
        blocks = (c.get("qk_norm"), c.get("norm_position", "pre"))
        fits = [t for t in BLOCKS if BLOCKS[t] == blocks and not _not_held(t, c)]
        fix = (
            f"Export it as {' or '.join(fits)} (model.hf_model_type={fits[0]}) instead."
            if fits
            else "Convert it to .safetensors or DCP instead."
        )
        raise CheckpointError(
            f"an HF {model_type} model cannot have {', '.join(found)}, which this one has; "
            f"an export would compute something else. {fix}"
        )


def check_blocks(
    model_type: str, qk_norm: str | None, norm_position: str, experts: bool = False
) -> None:
    """A model exports as `model_type` only with that type's blocks (q/k norms, norm position);
    the types it is pointed to instead have experts when it has (`experts`)."""
    if model_type not in BLOCKS:
        raise CheckpointError(
            f"hf_model_type={model_type!r} is not an HF architecture freetx writes; it writes "
            f"{', '.join(BLOCKS)}."
        )
    if BLOCKS[model_type] != (qk_norm, norm_position):
        fits = [
            t
            for t, blocks in BLOCKS.items()
            if blocks == (qk_norm, norm_position) and (t in MOE_MODULES) == experts
        ]
        fix = (
            f"Export it as {' or '.join(fits)} (model.hf_model_type={fits[0]}) instead."
            if fits
            else "No HF architecture freetx writes has these blocks: convert it to "
            ".safetensors or DCP instead."
        )
        raise CheckpointError(
            f"an HF {model_type} model has qk_norm={BLOCKS[model_type][0]}, norm_position="
            f"{BLOCKS[model_type][1]}; this one has qk_norm={qk_norm}, norm_position="
            f"{norm_position}. {fix}"
        )


LLAMA_LAYOUT = LlamaFamilyLayout("pre")
OLMO2_LAYOUT = LlamaFamilyLayout("post")
GEMMA_LAYOUT = LlamaFamilyLayout("sandwich")
DECODER_LAYOUTS = (LLAMA_LAYOUT, OLMO2_LAYOUT, GEMMA_LAYOUT)


def read_hf_config(path: str | Path) -> dict[str, Any]:
    """A model folder's config.json as a dict, or a CheckpointError naming the problem."""
    file = Path(path).expanduser() / "config.json"
    if not file.is_file():
        raise CheckpointError(
            f"{Path(path)} has no config.json; point at a model folder as transformers' "
            "save_pretrained writes it (config.json + *.safetensors)."
        )
    try:
        hf = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(
            f"HF model config {file} is not valid JSON ({e}); restore it from the model's "
            "original folder."
        ) from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{file} is not a JSON object of model settings.")
    return hf


def hf_config_fields(path: str | Path, fields: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config fields for a model folder, with `fields` (e.g. max_seq_len,
    dropout) changed."""
    hf = text_model_config(read_hf_config(path))
    if hf.get("model_type") not in ARCHITECTURES:
        raise CheckpointError(
            f"{path}/config.json describes a '{hf.get('model_type')}' model; the decoder reads "
            f"{', '.join(ARCHITECTURES)}."
        )
    return {**LLAMA_LAYOUT.from_hf_config(hf, fields.get("max_seq_len")), **fields}
