"""Models: plain nn.Modules that name their block classes; parallelism comes from outside.

transformer.py        the Llama-style decoder (DecoderBlock, presets tiny ... llama3_8b)
free_transformer.py   the Free Transformer: the decoder + a per-token latent
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn


def build_model(model_class: str, config: dict[str, Any]) -> nn.Module:
    """A model from its class path and config fields (as a checkpoint's meta.json records)."""
    module_name, _, class_name = model_class.rpartition(".")
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(cls.config_class(**config))
