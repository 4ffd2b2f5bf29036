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

from typing import Any, Protocol

from freetx.errors import CheckpointError
from freetx.models.hf_generic import GENERIC_LAYOUT, HFGenericModel, transformers_causal_lm_types
from freetx.models.protocol import HFLayoutModel, build_config, builds, model_class
from freetx.models.transformer import Transformer, TransformerConfig
from freetx.models.transformer_hf import DECODER_LAYOUTS, read_hf_config
from freetx.models.transformer_hf import text_model_config as text_model_config  # for exports


class HFLayout(Protocol):
    model_class: str  # the freetx class, as a dotted path
    model_types: tuple[str, ...]  # the `model_type`s of config.json it reads

    def to_hf_name(self, name: str) -> str: ...

    def from_hf_name(self, name: str) -> str | None: ...  # None: not a weight (skipped)

    # A freetx tensor may be several HF tensors stacked along dim 0 (an MoE block's
    # experts): slice i is the HF tensor whose stack_index is i. Readers stack, writers
    # unstack; a tensor that is one HF tensor has stack_index None and one HF name.
    def stack_index(self, name: str) -> int | None: ...

    def to_hf_names(self, name: str, rows: int, model_config: dict[str, Any]) -> list[str]: ...

    def to_hf_config(self, model_config: dict[str, Any], dtype: str) -> dict[str, Any]: ...

    def from_hf_config(
        self, hf: dict[str, Any], max_seq_len: int | None = None
    ) -> dict[str, Any]: ...


# native layouts first; the generic path reads every other type transformers knows
NATIVE_LAYOUTS: tuple[HFLayout, ...] = DECODER_LAYOUTS
LAYOUTS: tuple[HFLayout, ...] = (*NATIVE_LAYOUTS, GENERIC_LAYOUT)
# the files of a tokenizer in an HF folder (an export copies them from its source folder)
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
    "chat_template.json", "tokenizer.model", "added_tokens.json", "vocab.json", "merges.txt",
)  # fmt: skip


def layout_of(dotted_class: str) -> HFLayout:
    """The HF layout of a model class, or an error naming the classes that have one."""
    cls = model_class(dotted_class)
    layout = cls.hf_layout if isinstance(cls, HFLayoutModel) else None
    if layout is None:
        have = ", ".join(dict.fromkeys(layout.model_class for layout in LAYOUTS))
        raise CheckpointError(
            f"{dotted_class} has no HF transformers layout, so it cannot become an HF folder "
            f"(models that have one: {have}). Convert it to .safetensors or DCP instead."
        )
    return layout


def layout_for_hf_config(hf: dict[str, Any]) -> HFLayout:
    """The layout that reads an HF config.json, by its `model_type`."""
    for layout in LAYOUTS:
        if hf.get("model_type") in layout.model_types:
            return layout
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


@builds(TransformerConfig)
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
