"""HF layouts: how a freetx model's tensors and config map to a transformers folder.

A model class that has an HF form names its layout in `hf_layout` (the
decoder: `transformer_hf.LLAMA_LAYOUT`, which writes every model type the decoder
has); a folder is read by the layout of its `model_type` (`LAYOUTS`: the decoder's
two, pre-norm and post-norm). The checkpoint package converts through these two
look-ups and knows no model class itself.
"""

from __future__ import annotations

from typing import Any, Protocol

from freetx.errors import CheckpointError
from freetx.models.protocol import HFLayoutModel, model_class
from freetx.models.transformer_hf import DECODER_LAYOUTS


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


LAYOUTS: tuple[HFLayout, ...] = DECODER_LAYOUTS
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
    known = ", ".join(t for layout in LAYOUTS for t in layout.model_types)
    raise CheckpointError(
        f"config.json describes a '{hf.get('model_type')}' model; freetx reads these model "
        f"types: {known}."
    )
