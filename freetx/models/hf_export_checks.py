"""Whether the decoder can be written as an HF family: `LlamaFamilyLayout.to_hf_config`
(transformer_hf.py) writes the family a model names (`hf_model_type`), and refuses unless
the decoder has that family's blocks (q/k norms, norm position), projections (fused or
apart), RoPE, biases and the fields its config.json holds (Gemma's norms and embedding
scale, soft-caps, windows, layers without RoPE); the refusal names the families it fits
instead, or says to convert to .safetensors or DCP. An export that passes computes what
transformers computes from the folder.
"""

from __future__ import annotations

import json
from typing import Any

from freetx.errors import CheckpointError
from freetx.models.attention import sliding_layers
from freetx.models.hf_families import FAMILIES, HELD_BY_SOME, Family


def _not_held(family: Family, c: dict[str, Any]) -> list[str]:
    """The decoder's fields (as `name=value`) an HF model of `family` cannot have."""
    found = [
        f"{name}={json.dumps(c.get(name, False))}"
        for name in ("norm_plus_one", "scale_embeddings")
        if c.get(name, False) != family.gemma
    ]
    found += [
        f"{name}={json.dumps(c[name])}"
        for name in HELD_BY_SOME
        if c.get(name) and name not in family.holds
    ]
    sliding = sliding_layers(c["num_layers"], c.get("sliding_window"), c.get("layer_types"))
    if family.window_on_every_layer and any(sliding) and not all(sliding):
        found.append(f"layer_types={json.dumps(c['layer_types'])}")
    return found


def biases_to_hf(family: Family, qkv_bias: bool, wo_bias: bool) -> dict[str, Any]:
    """config.json's `attention_bias` where the family has it, or an error where the
    decoder's biases do not fit the family."""
    model_type = family.model_type
    if family.biases == "all_or_none":
        if qkv_bias != wo_bias:
            blocks = _blocks(family)
            qkv_only = [
                t for t, f in FAMILIES.items() if f.biases == "qkv" and _blocks(f) == blocks
            ]
            fix = (
                f"Export it as {qkv_only[0]}."
                if qkv_only
                else "Convert it to .safetensors or DCP instead."
            )
            raise CheckpointError(
                f"an HF {model_type} model has biases on all of q, k, v, o or on none; this "
                f"one has qkv_bias={qkv_bias}, wo_bias={wo_bias}. {fix}"
            )
        return {"attention_bias": qkv_bias}
    if family.biases == "qkv_or_none":
        if wo_bias:
            raise CheckpointError(
                f"an HF {model_type} model has biases on q, k and v or none, never on o; this "
                "one has wo_bias=True. Convert it to .safetensors or DCP instead."
            )
        return {"attention_bias": qkv_bias}
    qkv = family.biases == "qkv"
    if (qkv_bias, wo_bias) != (qkv, False):
        has = "biases on q, k and v and none on o" if qkv else "no biases on its projections"
        fix = (
            "Export it as llama (model.hf_model_type=llama) instead."
            if qkv
            else "Convert it to .safetensors or DCP instead."
        )
        raise CheckpointError(
            f"an HF {model_type} model has {has}; this one has qkv_bias={qkv_bias}, "
            f"wo_bias={wo_bias}. {fix}"
        )
    return {}


def _blocks(family: Family) -> tuple[str | None, str]:
    return family.qk_norm, family.norm_position


def check_rope(family: Family, scaling: dict | None, partial: float) -> None:
    """A model exports as `family` only with a RoPE that family computes."""
    kind = (scaling or {}).get("rope_type", "default")
    phi = family.phi_rope
    kinds = ("default", "longrope") if phi else ("default", "llama3", "linear")
    kinds += ("yarn",) if family.yarn_rope else ()
    if kind not in kinds or (partial != 1.0 and not (phi or family.partial_rotary)):
        fix = (
            "Convert"
            if phi
            else "Export it as phi3 (model.hf_model_type=phi3) if its projections are fused, "
            "or convert"
        )
        raise CheckpointError(
            f"an HF {family.model_type} model has {', '.join(kinds)} RoPE"
            f"{'' if phi else ' on every dim of each head'}; this one has rope_type={kind}, "
            f"partial_rotary_factor={partial}. {fix} it to .safetensors or DCP."
        )


def check_projections(family: Family, fused: bool) -> None:
    """A model exports as `family` only with its projections (fused or not)."""
    if family.fused_projections != fused:
        fits = [t for t, f in FAMILIES.items() if f.fused_projections == fused]
        raise CheckpointError(
            f"an HF {family.model_type} model has fused_projections={not fused} (q/k/v and "
            f"gate/up {'in one Linear each' if not fused else 'apart'}); this one has "
            f"fused_projections={fused}. Export it as {' or '.join(fits)} "
            f"(model.hf_model_type={fits[0]}) if its other blocks fit, or convert it to "
            ".safetensors or DCP."
        )


def check_fields(family: Family, c: dict[str, Any]) -> None:
    """A model exports as `family` only if its config.json holds all it computes (Gemma's
    norms and embedding scale, soft-caps, windows, layers without RoPE)."""
    found = _not_held(family, c)
    if found:
        blocks = (c.get("qk_norm"), c.get("norm_position", "pre"))
        fits = [t for t, f in FAMILIES.items() if _blocks(f) == blocks and not _not_held(f, c)]
        fix = (
            f"Export it as {' or '.join(fits)} (model.hf_model_type={fits[0]}) instead."
            if fits
            else "Convert it to .safetensors or DCP instead."
        )
        raise CheckpointError(
            f"an HF {family.model_type} model cannot have {', '.join(found)}, which this one "
            f"has; an export would compute something else. {fix}"
        )


def check_blocks(
    model_type: str, qk_norm: str | None, norm_position: str, experts: bool = False
) -> Family:
    """The family a model exports as (`model_type`), if it has that family's blocks (q/k
    norms, norm position); the families it is pointed to instead have experts when it has
    (`experts`)."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise CheckpointError(
            f"hf_model_type={model_type!r} is not an HF architecture freetx writes; it writes "
            f"{', '.join(FAMILIES)}."
        )
    if _blocks(family) != (qk_norm, norm_position):
        fits = [
            t
            for t, f in FAMILIES.items()
            if _blocks(f) == (qk_norm, norm_position) and (f.experts is not None) == experts
        ]
        fix = (
            f"Export it as {' or '.join(fits)} (model.hf_model_type={fits[0]}) instead."
            if fits
            else "No HF architecture freetx writes has these blocks: convert it to "
            ".safetensors or DCP instead."
        )
        raise CheckpointError(
            f"an HF {model_type} model has qk_norm={family.qk_norm}, norm_position="
            f"{family.norm_position}; this one has qk_norm={qk_norm}, norm_position="
            f"{norm_position}. {fix}"
        )
    return family
