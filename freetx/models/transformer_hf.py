"""The HF Llama layout of the decoder (`Transformer.hf_layout`): tensor names and
config.json fields.

freetx's decoder uses the rotate-half RoPE convention of HF's Llama, so its
weights convert by renaming alone (no permutation of the q/k projections). The
checkpoint package asks a model class for its layout (`freetx.models.hf`); it
knows no model itself.
"""

from __future__ import annotations

import re
from typing import Any

from freetx.errors import CheckpointError

# freetx name pattern -> HF name pattern ({i} is the layer index)
_NAMES = [
    ("tok_embeddings.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("output.weight", "lm_head.weight"),
    ("layers.{i}.attention_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.attention.wq.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("layers.{i}.attention.wk.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("layers.{i}.attention.wv.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("layers.{i}.attention.wo.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.feed_forward.w1.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "model.layers.{i}.mlp.down_proj.weight"),
]


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


_TO_HF = [(_pattern(ours), theirs) for ours, theirs in _NAMES]
_FROM_HF = [(_pattern(theirs), ours) for ours, theirs in _NAMES]


def _rename(name: str, table) -> str | None:
    for pattern, target in table:
        match = pattern.match(name)
        if match:
            return target.replace("{i}", match.group(1)) if match.groups() else target
    return None


class LlamaLayout:
    """How `freetx.models.transformer.Transformer` maps to an HF `LlamaForCausalLM` folder."""

    model_class = "freetx.models.transformer.Transformer"
    model_types = ("llama",)

    def to_hf_name(self, name: str) -> str:
        renamed = _rename(name, _TO_HF)
        if renamed is None:
            raise CheckpointError(
                f"tensor {name} has no HF Llama name; only the Llama-style decoder "
                f"({self.model_class}) converts to an HF folder."
            )
        return renamed

    def from_hf_name(self, name: str) -> str:
        renamed = _rename(name, _FROM_HF)
        if renamed is None:
            raise CheckpointError(f"HF tensor {name} is not part of a Llama model freetx can read.")
        return renamed

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]:
        """`config.json` of a LlamaForCausalLM with the decoder's shape."""
        c = model_config
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": c["vocab_size"],
            "hidden_size": c["hidden_dim"],
            "intermediate_size": c["ffn_hidden_dim"],
            "num_hidden_layers": c["num_layers"],
            "num_attention_heads": c["num_heads"],
            "num_key_value_heads": c["num_kv_heads"],
            "head_dim": c["hidden_dim"] // c["num_heads"],
            "max_position_embeddings": c["max_seq_len"],
            "rope_theta": c["rope_theta"],
            "rms_norm_eps": c["norm_eps"],
            "tie_word_embeddings": c["tie_embeddings"],
            "hidden_act": "silu",
            "attention_bias": False,
            "mlp_bias": False,
            "attention_dropout": c.get("attention_dropout", 0.0),
            "initializer_range": c.get("init_std", 0.02),
            "torch_dtype": dtype,
        }

    def from_hf_config(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The decoder's config fields from an HF Llama config.json."""
        try:
            return {
                "vocab_size": hf["vocab_size"],
                "hidden_dim": hf["hidden_size"],
                "num_layers": hf["num_hidden_layers"],
                "num_heads": hf["num_attention_heads"],
                "num_kv_heads": hf.get("num_key_value_heads", hf["num_attention_heads"]),
                "ffn_hidden_dim": hf["intermediate_size"],
                "max_seq_len": hf.get("max_position_embeddings", 2048),
                "rope_theta": hf.get("rope_theta", 10000.0),
                "norm_eps": hf.get("rms_norm_eps", 1e-5),
                "tie_embeddings": hf.get("tie_word_embeddings", False),
                "attention_dropout": hf.get("attention_dropout", 0.0),
                "init_std": hf.get("initializer_range", 0.02),
                "dropout": 0.0,
            }
        except (KeyError, TypeError) as e:
            raise CheckpointError(
                f"config.json lacks the Llama field {e} (or holds a wrong type); it is not a "
                "complete transformers config. Restore it from the model's original folder."
            ) from None


LLAMA_LAYOUT = LlamaLayout()
