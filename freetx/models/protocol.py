"""The model protocol: what freetx asks of a model, and how models are configured.

A freetx model is a plain `nn.Module`; parallelism, initialization and
checkpoints are applied from outside, through these members:

    config            a dataclass of the fields that rebuild the model
                      (`type(model)(config)`); checkpoints record it
    config_class      that dataclass (class attribute), for `build_model`
    block_types       the block classes (class attribute): the units FSDP2 shards,
                      activation checkpointing recomputes and `compile` compiles;
                      `()` shards and checkpoints the model as one unit
    init_parameter    fill one parameter's full (unsharded) tensor, by name
    init_buffers      (optional) recompute non-persistent buffers (RoPE tables) on
                      their device
    num_parameters    (optional) for the banner; default: every parameter counted
    flops_per_token   (optional) for MFU; default: 6 x parameters
    hf_layout         (optional, class attribute) how the model maps to an HF
                      transformers folder (`freetx.models.hf.HFLayout`), or None

A model with a latent code per position also follows `LatentModel`
(`prior_codes`, `posterior_codes`, `forward(..., z_index=codes)`), which is
what the `generate` recipe asks for; it never names a model class.

Models are built on the meta device, parallelized, then materialized and
initialized one parameter at a time (`freetx.distributed.init.materialize`),
so the initial weights depend only on the seed, never on the world size.

A model family has one builder, `family(preset=None, **fields)`: a named
preset's fields (the `PRESETS` table beside the model) with any field
changed, or any shape from its fields alone. `build_config` does that for
every family; `freetx validate` checks a config's keys against the family's
config fields (the builder's `config_class`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from freetx.errors import CheckpointError


@runtime_checkable
class Model(Protocol):
    """What freetx needs from a model (see the module docstring)."""

    config: Any
    config_class: ClassVar[type]
    block_types: ClassVar[tuple[type[nn.Module], ...]]

    def init_parameter(
        self, name: str, tensor: torch.Tensor, generator: torch.Generator
    ) -> None: ...


def num_parameters(model: nn.Module) -> int:
    """The model's own count (`num_parameters()`), else every parameter's elements."""
    own = getattr(model, "num_parameters", None)
    return own() if callable(own) else sum(p.numel() for p in model.parameters())


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: the model's own (`flops_per_token`), else 6 x parameters
    (forward + backward of every weight, attention left out)."""
    own = getattr(model, "flops_per_token", None)
    return float(own(seq_len)) if callable(own) else 6.0 * num_parameters(model)


@runtime_checkable
class LatentModel(Protocol):
    """A model whose forward takes a latent code per position (`z_index` [B, T]), like
    the Free Transformer. A sampler draws each position's code once and keeps it."""

    def prior_codes(self, count: int, length: int, generator: torch.Generator) -> torch.Tensor: ...

    def posterior_codes(
        self, input_ids: torch.Tensor, generator: torch.Generator
    ) -> torch.Tensor: ...


def build_config(
    config_class: type,
    fields: dict[str, Any],
    preset: str | None = None,
    presets: dict[str, dict[str, Any]] | None = None,
) -> Any:
    """A model config: the preset's fields, then `fields` over them.

    Raises ValueError (shown by `instantiate` as a config error naming the
    model node) for an unknown preset or field, with the valid names.
    """
    presets = presets or {}
    if preset is not None and preset not in presets:
        raise ValueError(f"unknown preset {preset!r}; the presets are: {', '.join(presets)}")
    names = [f.name for f in dataclasses.fields(config_class)]
    unknown = [k for k in fields if k not in names]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, names, n=1)
            hints.append(f"'{key}'" + (f" (did you mean '{close[0]}'?)" if close else ""))
        raise ValueError(
            f"{config_class.__name__} has no field {', '.join(hints)}; its fields: "
            f"{', '.join(names)}"
        )
    values = {**(presets[preset] if preset is not None else {}), **fields}
    return config_class(**values)


def builds(config_class: type):
    """Mark a family's builder with its config class, so that config keys can be checked
    against the config's fields before anything is built (`freetx validate`)."""

    def mark(builder):
        builder.config_class = config_class
        return builder

    return mark


def model_class(dotted: str) -> type:
    """A model class from its dotted path (as a checkpoint's meta.json records it)."""
    module_name, _, class_name = dotted.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError):
        raise CheckpointError(
            f"the checkpoint names the model class {dotted}, which cannot be imported."
        ) from None


def build_model(dotted_class: str, config: dict[str, Any]) -> nn.Module:
    """A model from its class path and config fields (as a checkpoint's meta.json records)."""
    cls = model_class(dotted_class)
    return cls(cls.config_class(**config))
