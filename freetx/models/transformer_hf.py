"""The HF layouts of the decoder (`Transformer.hf_layout`): tensor names and config.json
for the Llama family as `transformers` writes it: Llama 2/3/3.1/3.2/3.3, Mistral,
Qwen2/Qwen2.5, Qwen3 (q/k norms per head), OLMo 2 (q/k norms over the projections,
post-norms), Phi-3/3.5/4 (fused qkv_proj and gate_up_proj, LongRoPE, partial rotary),
Gemma 2 and Gemma 3 text (norms before and after; Gemma 3's multimodal folders read as
their text model, `text_model_config`), SmolLM3 (layers without RoPE), sliding windows
of Mistral, Phi-3, Qwen2/3 and Gemma on the layers config.json names, the mixtures of
experts Mixtral and Qwen3-MoE, and DeepSeek-V3 and V2 (multi-head latent attention, the router
bias, shared experts) and GLM-4.5. Each family is one record of
`freetx.models.hf_families.FAMILIES`; `to_hf_config` and `from_hf_config` loop over its
fields and call its hooks, and name no family.

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
for its layout (`freetx.models.hf`); it knows no model itself. Whether a decoder can be
written as the family it names (its blocks, projections, RoPE, biases, fields) is
freetx.models.hf_export_checks.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from freetx.errors import CheckpointError, ConfigError
from freetx.models.hf_export_checks import (
    biases_to_hf,
    check_blocks,
    check_fields,
    check_projections,
    check_rope,
)
from freetx.models.hf_families import FAMILIES, Family, rope_settings, unsupported

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
# multi-head latent attention's projections (DeepSeek; biases on wq_a and wkv_a)
_LATENT = (
    ("wq_a", "q_a_proj"),
    ("wq_b", "q_b_proj"),
    ("wkv_a", "kv_a_proj_with_mqa"),
    ("wkv_b", "kv_b_proj"),
)
_NAMES += [
    ("layers.{i}.attention.q_a_norm.weight", "model.layers.{i}.self_attn.q_a_layernorm.weight"),
    ("layers.{i}.attention.kv_a_norm.weight", "model.layers.{i}.self_attn.kv_a_layernorm.weight"),
    # DeepSeek's router bias (a float32 buffer) and shared experts
    ("layers.{i}.feed_forward.e_score_correction_bias",
     "model.layers.{i}.mlp.gate.e_score_correction_bias"),
    ("layers.{i}.feed_forward.shared_experts.w1.weight",
     "model.layers.{i}.mlp.shared_experts.gate_proj.weight"),
    ("layers.{i}.feed_forward.shared_experts.w3.weight",
     "model.layers.{i}.mlp.shared_experts.up_proj.weight"),
    ("layers.{i}.feed_forward.shared_experts.w2.weight",
     "model.layers.{i}.mlp.shared_experts.down_proj.weight"),
]  # fmt: skip
for _ours, _theirs in (*_ATTENTION, ("wqkv", "qkv_proj"), *_LATENT):
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
# an MoE block (freetx.models.moe), by model type: its HF module and expert names
EXPERTS = {t: family.experts for t, family in FAMILIES.items() if family.experts is not None}
_EXPERT_NAMES = {hf: ours for e in EXPERTS.values() for ours, hf in e.names.items()}
_MODULES = "|".join(dict.fromkeys(e.module for e in EXPERTS.values()))
_ROUTER = rf"^model\.layers\.(\d+)\.(?:{_MODULES})\.gate\.weight$"
_EXPERT = (
    rf"^model\.layers\.(\d+)\.(?:{_MODULES})\.experts\.(\d+)\."
    rf"({'|'.join(_EXPERT_NAMES)})\.weight$"
)
_OURS_MOE = re.compile(r"^layers\.(\d+)\.feed_forward\.(gate\.weight|experts\.(w1|w2|w3))$")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
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

# activations as config.json names them -> TransformerConfig's
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# what transformers 5.24 (and 4.50) assumes where a gemma3 folder's text_config leaves a
# field out (Gemma3TextConfig's defaults: the Hub's 4B-27B configs list only a few fields)
_GEMMA3_TEXT_DEFAULTS = dict(
    model_type="gemma3_text",
    vocab_size=262208,
    hidden_size=2304,
    intermediate_size=9216,
    num_hidden_layers=26,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=256,
    hidden_activation="gelu_pytorch_tanh",
    max_position_embeddings=131072,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    rope_local_base_freq=1e4,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)


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


def partial_rotary_factor(hf: dict[str, Any]) -> float:
    """The fraction of each head RoPE rotates: in the rope parameters (transformers 5) or at
    the top of config.json (Phi-4-mini's folders); 1.0 when neither has it."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    return float(params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0)


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

    def __init__(self, norm_position: str, num_layers: int | None = None) -> None:
        self.norm_position = norm_position
        self.model_types = tuple(t for t, f in FAMILIES.items() if f.norm_position == norm_position)
        self.model_types += tuple(m for m, t in TEXT_MODEL_OF.items() if t in self.model_types)
        # layers from this index on are not read (DeepSeek-V3's multi-token prediction)
        self.num_layers = num_layers

    def for_config(self, hf: dict[str, Any]) -> LlamaFamilyLayout:
        """The layout that reads the folder of config.json `hf`: this one, or for a folder
        with multi-token-prediction layers (`num_nextn_predict_layers`: DeepSeek-V3's
        `model.layers.61.*`, which transformers does not load either) one that skips every
        layer past num_hidden_layers."""
        hf = text_model_config(hf)
        if not hf.get("num_nextn_predict_layers"):
            return self
        return LlamaFamilyLayout(self.norm_position, int(hf["num_hidden_layers"]))

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
        if model_type not in EXPERTS:
            raise CheckpointError(
                f"tensor {name} belongs to a mixture of experts, which an HF {model_type} "
                f"model does not have; export it as {' or '.join(EXPERTS)}."
            )
        experts = EXPERTS[model_type]
        prefix = f"model.layers.{moe.group(1)}.{experts.module}"
        if moe.group(3) is None:
            return [f"{prefix}.gate.weight"]
        hf_name = experts.names[moe.group(3)]
        return [f"{prefix}.experts.{e}.{hf_name}.weight" for e in range(rows)]

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
        layer = _LAYER.match(name)
        if layer and self.num_layers is not None and int(layer.group(1)) >= self.num_layers:
            return None  # a multi-token-prediction layer (`for_config`)
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
        """`config.json` of the model's HF architecture (its family's record), with the
        decoder's shape."""
        c = model_config
        family = check_blocks(
            c.get("hf_model_type", "llama"),
            c.get("qk_norm"),
            c.get("norm_position", "pre"),
            bool(c.get("num_experts")),
        )
        check_projections(family, c.get("fused_projections", False))
        partial = c.get("partial_rotary_factor", 1.0)
        check_rope(family, c.get("rope_scaling"), partial)
        check_fields(family, c)
        hf: dict[str, Any] = {
            "architectures": [family.architecture],
            "model_type": family.model_type,
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
        hf.update(biases_to_hf(family, c.get("qkv_bias", False), c.get("wo_bias", False)))
        family.write(c, hf)
        if family.head_dim_derived:
            if hf["head_dim"] * c["num_heads"] != c["hidden_dim"]:
                raise CheckpointError(
                    f"an HF {family.model_type} model has head_dim = hidden_size / heads; this "
                    f"one has head_dim={hf['head_dim']}, hidden_dim={c['hidden_dim']}, "
                    f"num_heads={c['num_heads']}. Convert it to .safetensors or DCP instead."
                )
            del hf["head_dim"]
        hf.update(_moe_to_hf(c, family))
        return hf

    def from_hf_config(self, hf: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
        """The decoder's config fields from an HF config.json (any family of `FAMILIES`);
        `max_seq_len` replaces max_position_embeddings (the RoPE tables' length)."""
        hf = text_model_config(hf)
        family = FAMILIES[hf.get("model_type")]
        try:
            num_heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            theta, scaling = rope_settings(hf, "full_attention" if family.gemma else None)
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
                "fused_projections": family.fused_projections,
                "head_dim": int(hf.get("head_dim") or hidden // num_heads),
                "hf_model_type": family.model_type,
                "pad_token_id": hf.get("pad_token_id", family.pad_token_id),
                "qk_norm": family.qk_norm,
                "norm_position": family.norm_position,
                **_moe_from_hf(hf, family),
            }
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(
                f"config.json lacks the field {e} (or holds a wrong type); it is not a complete "
                f"transformers {family.model_type} config. Restore it from the model's "
                "original folder."
            ) from None
        # Gemma 2 and 3 name it hidden_activation (4.x: hidden_act too, which Gemma 2 ignored)
        key = "hidden_activation" if hf.get("hidden_activation") else "hidden_act"
        if hf.get(key, "silu") not in _ACTIVATIONS:
            raise unsupported(key, hf[key], f"gated MLPs with {', '.join(_ACTIVATIONS)}")
        fields["activation"] = _ACTIVATIONS[hf.get(key, "silu")]
        if hf.get("mlp_bias"):
            raise unsupported("mlp_bias", True, "MLPs without biases")
        partial = family.phi_rope or family.partial_rotary
        if fields["partial_rotary_factor"] != 1.0 and not partial:
            raise unsupported(
                "partial_rotary_factor",
                fields["partial_rotary_factor"],
                f"RoPE on every dim of a {family.model_type} model's heads, as transformers "
                "computes it",
            )
        bias = bool(hf.get("attention_bias", False))
        qkv_bias = bias and family.biases in ("all_or_none", "qkv_or_none")
        fields.update(
            qkv_bias=qkv_bias or family.biases == "qkv",
            wo_bias=bias and family.biases == "all_or_none",
        )
        fields.update(family.read(hf, fields))
        pad = fields["pad_token_id"]
        if pad is not None and not 0 <= pad < fields["vocab_size"]:
            given = "sets" if "pad_token_id" in hf else f"has none, and {family.model_type} assumes"
            raise CheckpointError(
                f"config.json {given} pad_token_id={pad}, outside vocab_size="
                f"{fields['vocab_size']}: the embedding has no such padding row (transformers "
                "cannot build this model either). Set pad_token_id in config.json to the "
                "tokenizer's pad id, or null for none."
            )
        layer_types = set(hf.get("layer_types") or ["full_attention"])
        if layer_types != {"full_attention"} and "layer_types" not in fields:
            raise unsupported("layer_types", sorted(layer_types), "full attention in every layer")
        return fields


def _moe_from_hf(hf: dict[str, Any], family: Family) -> dict[str, Any]:
    """The decoder's MoE fields from the config.json of a family with experts ({} for
    the others)."""
    if family.experts is None:
        return {}
    if hf.get("router_jitter_noise"):
        raise unsupported(
            "router_jitter_noise",
            hf["router_jitter_noise"],
            "routers without noise",
            "Set it to 0.0 to train without the noise.",
        )
    return {
        "num_experts": int(
            hf.get("num_local_experts") or hf.get("num_experts") or hf["n_routed_experts"]
        ),
        "experts_per_token": int(hf["num_experts_per_tok"]),
        "router_aux_loss_coef": float(hf.get("router_aux_loss_coef", 0.001)),
        **family.experts.read(hf),
        **family.experts.fixed,
    }


def _moe_to_hf(c: dict[str, Any], family: Family) -> dict[str, Any]:
    """config.json's MoE fields of `family` for a decoder's config `c`, or an error when
    its experts (or their absence) do not fit that family."""
    experts, model_type = int(c.get("num_experts") or 0), family.model_type
    if (family.experts is not None) != bool(experts):
        kinds = " or ".join(EXPERTS) if experts else "a dense type (llama, qwen3, ...)"
        raise CheckpointError(
            f"an HF {model_type} model {'has' if family.experts else 'has no'} experts; this "
            f"one has num_experts={experts}. Export it as {kinds} (model.hf_model_type) "
            "instead."
        )
    if not experts:
        return {}
    fixed = family.experts.fixed
    differing = {k: c.get(k) for k, v in fixed.items() if c.get(k) != v}
    if differing:
        raise CheckpointError(
            f"an HF {model_type} model has {json.dumps(fixed)}; this one has "
            f"{json.dumps(differing)}. Convert it to .safetensors or DCP instead."
        )
    return {
        "num_experts_per_tok": c["experts_per_token"],
        "router_aux_loss_coef": c.get("router_aux_loss_coef", 0.0),
        "output_router_logits": False,
        **family.experts.write(c),
    }


class ScorerLayout(LlamaFamilyLayout):
    """How `freetx.models.scorer.SequenceScorer` maps to HF `XForSequenceClassification`
    folders with num_labels 1 (the decoder's tensors, and the head `score.weight`); it
    reads the same model types, chosen for a folder whose `architectures` name a sequence
    classifier (`scores_sequences`)."""

    model_class = "freetx.models.scorer.SequenceScorer"
    HEAD = "score.weight"

    def for_config(self, hf: dict[str, Any]) -> ScorerLayout:
        hf = text_model_config(hf)
        if not hf.get("num_nextn_predict_layers"):
            return self
        return ScorerLayout(self.norm_position, int(hf["num_hidden_layers"]))

    def to_hf_name(self, name: str) -> str:
        return self.HEAD if name == self.HEAD else super().to_hf_name(name)

    def from_hf_name(self, name: str) -> str | None:
        return self.HEAD if name == self.HEAD else super().from_hf_name(name)

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]:
        """The decoder's config.json as its family's sequence classifier, one label: what
        transformers' AutoModelForSequenceClassification builds (its `pad_token_id` says
        where each sequence's score is read). A family transformers has no sequence
        classifier of is refused."""
        hf = super().to_hf_config(model_config, dtype)
        architecture = SEQUENCE_CLASSIFIERS.get(hf["model_type"]) or hf["architectures"][0].replace(
            "ForCausalLM", "ForSequenceClassification"
        )
        if hf["model_type"] in NO_SEQUENCE_CLASSIFIER:
            raise CheckpointError(
                f"transformers has no sequence classifier of model type {hf['model_type']}, so "
                "this reward model cannot become an HF folder it loads. Convert it to "
                ".safetensors or DCP instead."
            )
        hf.update(architectures=[architecture], num_labels=1, tie_word_embeddings=False)
        return hf

    def from_hf_config(self, hf: dict[str, Any], max_seq_len: int | None = None) -> dict[str, Any]:
        """The decoder's fields of a sequence classifier's config.json: one with more than
        one label is refused by name (a scorer has one)."""
        labels = len(hf.get("id2label") or {}) or int(hf.get("num_labels", 1))
        if labels != 1:
            raise CheckpointError(
                f"config.json describes a sequence classifier of {labels} labels; a reward "
                "model (freetx.models.scorer) scores with one. Use a folder with num_labels 1."
            )
        return super().from_hf_config(hf, max_seq_len)


# sequence classifiers whose name is not the causal LM's with ForSequenceClassification
SEQUENCE_CLASSIFIERS = {"gemma3_text": "Gemma3TextForSequenceClassification"}
NO_SEQUENCE_CLASSIFIER = ("glm4_moe",)  # transformers 5.24 has none


def scores_sequences(hf: dict[str, Any]) -> bool:
    """Whether a folder's config.json is a sequence classifier's (a reward model's)."""
    return any(str(a).endswith("ForSequenceClassification") for a in hf.get("architectures") or ())


LLAMA_LAYOUT = LlamaFamilyLayout("pre")
OLMO2_LAYOUT = LlamaFamilyLayout("post")
GEMMA_LAYOUT = LlamaFamilyLayout("sandwich")
DECODER_LAYOUTS = (LLAMA_LAYOUT, OLMO2_LAYOUT, GEMMA_LAYOUT)
# the scorer's, by norm position (the pre-norm one writes every model type)
SCORER_LAYOUTS = {
    layout.norm_position: ScorerLayout(layout.norm_position) for layout in DECODER_LAYOUTS
}
SCORER_LAYOUT = SCORER_LAYOUTS["pre"]


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
    check_hf_sizes(hf, file)
    return hf


# The largest size of each kind freetx reads from a config.json: far above any model's
# (vocabularies reach ~256k, widths ~16k, MLPs ~100k), far below what would make the
# parameters alone more than a machine's memory, so a typo is refused before allocating
HF_SIZE_LIMITS = {
    "vocab_size": 10**8,
    "hidden_size": 10**6,
    "intermediate_size": 10**7,
    "num_hidden_layers": 10**5,
    "num_attention_heads": 10**5,
    "num_key_value_heads": 10**5,
}


def check_hf_sizes(hf: dict[str, Any], file: Path) -> None:
    """Refuse a config.json size of 0 or less, or one past `HF_SIZE_LIMITS` (a typo such as
    vocab_size 10^12: the embedding alone would not fit in memory), naming the field,
    before anything is built: every reader of a folder's config.json calls it."""
    text = hf.get("text_config")
    for section in (hf, text if isinstance(text, dict) else {}):
        for key, limit in HF_SIZE_LIMITS.items():
            value = section.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not 0 < value <= limit:
                if value <= 0:
                    why = "a size of 0 or less"
                else:
                    why = (
                        f"past any model's (freetx reads at most {limit:,}: the parameters "
                        "alone would not fit in a machine's memory)"
                    )
                raise ConfigError(
                    f"{file} gives {key}={value}, {why}.",
                    fix=f"Fix {key} in config.json (the model's original folder has the "
                    "right value).",
                )


def hf_config_fields(path: str | Path, fields: dict[str, Any]) -> dict[str, Any]:
    """The decoder's config fields for a model folder, with `fields` (e.g. max_seq_len,
    dropout) changed."""
    hf = text_model_config(read_hf_config(path))
    if hf.get("model_type") not in FAMILIES:
        raise CheckpointError(
            f"{path}/config.json describes a '{hf.get('model_type')}' model; the decoder reads "
            f"{', '.join(FAMILIES)}."
        )
    return {**LLAMA_LAYOUT.from_hf_config(hf, fields.get("max_seq_len")), **fields}
