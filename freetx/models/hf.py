"""HF layouts: how a freetx model's tensors and config map to a transformers folder.

A model class that has an HF form names its layout in `hf_layout` (the
decoder: `transformer_hf.LLAMA_LAYOUT`, which writes every model type the decoder
has); a folder is read by the layout of its `model_type` (`LAYOUTS`: the decoder's
two, pre-norm and post-norm; then the generic transformers path's, which reads any
other causal LM transformers knows). The checkpoint package converts through these two
look-ups and knows no model class itself.

`hf_model(path, **fields)` builds the model of a folder by the same choice: freetx's
own model where a native layout reads its `model_type`, else the generic path
(`freetx.models.hf_generic`). A multimodal folder read natively (Gemma 3's `gemma3`) is
read as its text model; `text_model_config` gives that model's config.json, which an
export writes.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from torch import nn

from freetx.errors import CheckpointError
from freetx.models.decoder.config import TransformerConfig
from freetx.models.hf_generic import (
    GENERIC_LAYOUT,
    HFGenericConfig,
    HFGenericModel,
    transformers_causal_lm_types,
)
from freetx.models.protocol import HFLayoutModel, build_config, builds, model_class
from freetx.models.transformer import Transformer
from freetx.models.transformer_hf import (
    DECODER_LAYOUTS,
    SCORER_LAYOUTS,
    read_hf_config,
    scores_sequences,
    text_model_config,
)


def model_folder_problem(path: str) -> str | None:
    """What is wrong with `path` as a model to start from (an HF folder, a run's output_dir,
    a DCP folder or a .safetensors file): it is a file of another kind; with the fix. None
    when it may be one (one that does not exist is `check_read_paths`'s to refuse). Checked
    before anything reads it, so that its tokenizer is not blamed."""
    location = Path(path).expanduser()
    if location.is_file() and location.suffix != ".safetensors":
        return (
            "it is a file, not a folder (nor a .safetensors file); point it at an HF model "
            "folder (config.json, *.safetensors, tokenizer files), a run's output_dir or a "
            "DCP folder, e.g. the folder this file is in."
        )
    return None


def model_dir_problems(values: dict) -> dict[str, str]:
    """A config's `model_dir` that cannot be a model (`model_folder_problem`), or not the HF
    folder its `model` or `tokenizer` node reads it as (`hf_folder_problem`), by key: a
    fine-tuning schema's `meaningless`, so that it is said first, not as its tokenizer's
    problem."""
    folder = values.get("model_dir")
    if not isinstance(folder, str) or not folder:
        return {}
    problem = model_folder_problem(folder) or hf_folder_problem(folder, values)
    return {"model_dir": problem} if problem else {}


def hf_folder_problem(folder: str, values: dict) -> str | None:
    """What keeps `folder` from being the HF folder a config's `model` or `tokenizer` node
    reads as its `path` (`path: ${model_dir}`): a file (a .safetensors file, which only
    checkpoint.initial_weights reads), or, for the model, a folder without config.json;
    with the fix. None when no node reads it so, or it may be one."""
    location = Path(folder).expanduser()
    readers = [
        f"{key}.path"
        for key in ("model", "tokenizer")
        if isinstance(values.get(key), dict) and values[key].get("path") == folder
    ]
    if location.is_file() and readers:
        what = f"{' and '.join(readers)} read it as an HF model folder, and it is a file"
    elif location.is_dir() and "model.path" in readers and not (location / "config.json").is_file():
        what = "model.path reads it as an HF model folder, and it holds no config.json"
    else:
        return None
    return (
        f"{what}; point model_dir at an HF model folder (config.json, *.safetensors, "
        "tokenizer files), as transformers' save_pretrained writes it."
    )


def ending_ids(eos_id: int, folders: Sequence[str | Path | None]) -> list[int]:
    """The ids a generation ends at: the tokenizer's EOS, then the end tokens of the first
    of `folders` that is an HF folder (`end_token_ids`; None: no folder)."""
    found = next((ids for f in folders if f is not None and (ids := end_token_ids(f))), [])
    return [eos_id, *(i for i in found if i != eos_id)]


def end_token_ids(folder: str | Path) -> list[int]:
    """The ids that end a text by an HF folder's config.json and generation_config.json
    (`eos_token_id`: one id or a list); [] for a path that is no HF folder."""
    location = Path(folder).expanduser()
    if not (location / "config.json").is_file():
        return []
    found = [text_model_config(read_hf_config(location)).get("eos_token_id")]
    generation = location / "generation_config.json"
    if generation.is_file():
        try:
            found.append(json.loads(generation.read_text(encoding="utf-8")).get("eos_token_id"))
        except (ValueError, UnicodeDecodeError, AttributeError):
            pass  # not the model's to judge here: the config.json ids stand
    ids: list[int] = []
    for value in found:
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, int) and not isinstance(token, bool) and token not in ids:
                ids.append(token)
    return ids


class HFLayout(Protocol):
    model_class: str  # the freetx class, as a dotted path
    model_types: tuple[str, ...]  # the `model_type`s of config.json it reads

    def to_hf_name(self, name: str) -> str: ...

    def from_hf_name(self, name: str) -> str | None: ...  # None: not a weight (skipped)

    # A freetx tensor may be several HF tensors stacked along dim 0 (an MoE block's
    # experts): slice i is the HF tensor whose stack_index is i; (i, p): part p of slice
    # i, the parts of a slice joined along its first dim in order (an expert's gate and up
    # projections, held as one). Readers stack, writers unstack; a tensor that is one HF
    # tensor has stack_index None and one HF name.
    def stack_index(self, name: str) -> int | tuple[int, int] | None: ...

    def to_hf_names(self, name: str, rows: int, model_config: dict[str, Any]) -> list[str]: ...

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]: ...

    def from_hf_config(
        self, hf: dict[str, Any], max_seq_len: int | None = None
    ) -> dict[str, Any]: ...

    # the layout that reads the folder of config.json `hf` (itself, or one bound to what
    # the folder holds: the generic path's rules, the layers a native folder skips)
    def for_config(self, hf: dict[str, Any]) -> HFLayout: ...


# native layouts first; the generic path reads every other type transformers knows
NATIVE_LAYOUTS: tuple[HFLayout, ...] = DECODER_LAYOUTS
LAYOUTS: tuple[HFLayout, ...] = (*NATIVE_LAYOUTS, GENERIC_LAYOUT)
# the files of a tokenizer in an HF folder (an export copies them from its source folder)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)


def layout_of(dotted_class: str, model_config: dict[str, Any] | None = None) -> HFLayout:
    """The HF layout of a model class, or an error naming the classes that have one; with
    the model's config, the layout that names its stored tensors (the generic path's, bound
    to its model type's conversion rules)."""
    cls = model_class(dotted_class)
    layout = cls.hf_layout if isinstance(cls, HFLayoutModel) else None
    if layout is None:
        have = ", ".join(dict.fromkeys(layout.model_class for layout in LAYOUTS))
        raise CheckpointError(
            f"{dotted_class} has no HF transformers layout, so it cannot become an HF folder "
            f"(models that have one: {have}). Convert it to .safetensors or DCP instead."
        )
    if layout is GENERIC_LAYOUT and model_config is not None:
        return GENERIC_LAYOUT.for_config(model_config["hf_config"])
    return layout


def layout_for_hf_config(hf: dict[str, Any]) -> HFLayout:
    """The layout that reads an HF config.json, by its `model_type`. A quantized folder
    (`quantization_config`: GPTQ, AWQ, bitsandbytes, FP8, ...) is refused by name: its
    tensors are packed integers and scales, not the weights either path computes with."""
    quantized = hf.get("quantization_config")
    if quantized:
        method = quantized.get("quant_method", "?") if isinstance(quantized, dict) else "?"
        raise CheckpointError(
            f"config.json has quantization_config (quant_method={method}): the folder holds "
            "quantized tensors, which freetx does not read or train. Use the model's "
            "unquantized folder (bf16 or fp32 weights); for QLoRA freetx quantizes the base "
            "itself: peft.quantize_base=nf4."
        )
    for layout in LAYOUTS:
        if hf.get("model_type") in layout.model_types:
            if scores_sequences(hf) and layout not in NATIVE_LAYOUTS:
                native = ", ".join(t for n in NATIVE_LAYOUTS for t in n.model_types)
                raise CheckpointError(
                    f"config.json describes a {hf['architectures'][0]}: a sequence classifier "
                    f"of model type '{hf.get('model_type')}', which freetx scores with its "
                    f"native decoders only ({native}). Use a reward model of one of those types."
                )
            if scores_sequences(hf):  # a reward model's folder
                layout = SCORER_LAYOUTS[layout.norm_position]
            return layout.for_config(hf)
    native = ", ".join(t for layout in NATIVE_LAYOUTS for t in layout.model_types)
    if not transformers_causal_lm_types():
        raise CheckpointError(
            f"config.json describes a '{hf.get('model_type')}' model; freetx reads {native} "
            "natively, and any other causal LM through transformers (the generic path), "
            "which is not installed. Install it with pip install 'freetx[hf]'."
        )
    raise CheckpointError(
        f"config.json describes a '{hf.get('model_type')}' model, which is neither a type "
        f"freetx reads natively ({native}) nor a causal LM transformers knows; check the "
        "folder's config.json, or update transformers."
    )


def hf_model_config(fields: dict[str, Any]) -> tuple[type, str]:
    """The config class `hf_model`'s keys are checked against (`freetx validate`, the
    checks before a run): by the folder's `model_type` alone (config.json is read, nothing
    built); the decoder's where a native layout reads it or the folder cannot be read
    (building names that problem)."""
    path = fields.get("path")
    try:
        model_type = read_hf_config(path).get("model_type") if isinstance(path, str) else None
    except CheckpointError:
        return TransformerConfig, ""
    if model_type is None or any(model_type in layout.model_types for layout in NATIVE_LAYOUTS):
        return TransformerConfig, ""
    return HFGenericConfig, (
        f"{path} holds a '{model_type}' model, which freetx builds through the generic "
        "transformers path with the shape its config.json gives (to change the shape, edit "
        "a copy of the folder's config.json)"
    )


@builds(TransformerConfig, config_for=hf_model_config)
def hf_model(path: str, **fields) -> Transformer | HFGenericModel:
    """The model of an HF folder: freetx's own where a native layout reads its
    `model_type` (with any config field changed, as `hf_decoder`), else transformers'
    modules through the generic path (`max_seq_len` only). Its weights:
    `checkpoint.initial_weights=<the same folder>`."""
    hf = read_hf_config(path)
    layout = layout_for_hf_config(hf)
    cls = model_class(layout.model_class)
    read = layout.from_hf_config(hf, fields.get("max_seq_len"))
    return cls(build_config(cls.config_class, {**read, **fields}))


def own_module_name(model: nn.Module, name: str) -> str:
    """The module of `model` that `name` means: `name` itself when the model has such a
    module; else, for a model with an HF layout, the module holding exactly the tensors
    HF calls `name.*` (`model.layers.13` -> `layers.13`, `model.layers.13.mlp` ->
    `layers.13.feed_forward` in freetx's decoder), so that a hook written as transformers
    names a module reads the same activations when freetx computes the model natively.
    Unchanged when nothing matches (the caller's error then lists the modules)."""
    modules = dict(model.named_modules())
    layout = model.hf_layout if isinstance(model, HFLayoutModel) else None
    if name in modules or layout is None:
        return name
    config = dataclasses.asdict(model.config)
    hf_names = {
        own: set(layout.to_hf_names(own, param.shape[0] if param.dim() else 1, config))
        for own, param in model.named_parameters()
    }
    wanted = {h for names in hf_names.values() for h in names if h.startswith(name + ".")}
    for module_name, module in modules.items():
        prefix = f"{module_name}." if module_name else ""
        held = [hf_names[prefix + own] for own, _ in module.named_parameters()]
        if wanted and set().union(*held) == wanted:
            return module_name
    return name
