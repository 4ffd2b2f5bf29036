"""Adapters out of a checkpoint: a PEFT adapter folder, or a base with its adapters merged.

    freetx checkpoint convert CKPT adapter --to peft        # adapter_model.safetensors + config
    freetx checkpoint merge CKPT --base MODEL_DIR merged     # an HF folder, adapters merged in

A LoRA checkpoint holds `<module>.lora_a.weight`, `<module>.lora_b.weight` and
(DoRA) `<module>.lora_magnitude` (`freetx.models.peft.lora.PEFT_NAMES`, with
PEFT's names for them); the caller passes the run's settings (`LoRASettings`:
rank, alpha, dropout, use_dora). PEFT names a module by its HF path
(`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), which the
model's HF layout gives. Merging streams: each base tensor is read, merged
with its adapter if it has one (`merge_weight`, as training merges), and
written, one at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from freetx.checkpoint.dcp_folder import FROZEN_FROM, MODEL_PREFIX
from freetx.checkpoint.formats import TensorSource
from freetx.errors import CheckpointError
from freetx.models.hf import layout_of
from freetx.models.peft.lora import PEFT_NAMES, lora_delta, merge_weight


@dataclass(frozen=True)
class LoRASettings:
    """The LoRA settings a run trained its adapters with (its `peft:` section's values)."""

    alpha: float  # the update is scaled by alpha / rank
    rank: int = 0  # 0: read from the adapters' shapes
    dropout: float = 0.0
    use_dora: bool = False


def refuse_adapters(source: TensorSource, wanted: str) -> None:
    """Refuse a LoRA checkpoint where a whole model is `wanted` (an HF folder, a model to
    sample from), saying what works: merge it, or export the adapters for PEFT."""
    if not any(name.endswith("." + s) for name in source.infos for s in PEFT_NAMES):
        return
    base = source.meta.get(FROZEN_FROM)
    what = (
        f"adapter-only: it holds a LoRA run's adapters, not the weights of its base ({base})"
        if base
        else "a LoRA checkpoint: it holds unmerged adapters (*.lora_a.weight)"
    )
    raise CheckpointError(
        f"{source.path} is {what}, so it cannot be {wanted}. For a whole model, merge the "
        f"adapters into the base first: freetx checkpoint merge {source.path} --base "
        f"{base or 'BASE'} MERGED, then use MERGED; for the adapters alone (PEFT's format), "
        f"freetx checkpoint convert {source.path} ADAPTER_DIR --to peft."
    )


def adapter_tensors(source: TensorSource) -> dict[str, dict[str, str]]:
    """module name -> {adapter parameter: checkpoint key}, for every adapted module."""
    found: dict[str, dict[str, str]] = {}
    for key in source.infos:
        if not key.startswith(MODEL_PREFIX):
            continue
        name = key[len(MODEL_PREFIX) :]
        for suffix in PEFT_NAMES:
            if name.endswith("." + suffix):
                found.setdefault(name[: -len(suffix) - 1], {})[suffix] = key
    if not found:
        raise CheckpointError(
            f"{source.path} holds no LoRA adapters (no *.lora_a.weight tensors): it is not a "
            "checkpoint of a run with peft.method=lora. Convert it to safetensors or hf instead."
        )
    return found


def require_settings(source: TensorSource, lora: LoRASettings | None) -> LoRASettings:
    """The run's LoRA settings, or an error when the caller found none recorded."""
    if lora is None:
        raise CheckpointError(
            f"{source.path} does not record its LoRA settings (meta.json's config has no "
            "peft section with method lora); use a checkpoint freetx saved."
        )
    return lora


def write_peft(
    source: TensorSource, out: Path, base_path: str | None, lora: LoRASettings | None
) -> int:
    """adapter_model.safetensors + adapter_config.json, as PEFT's save_pretrained writes."""
    from freetx.checkpoint.formats import SafetensorsStreamWriter

    modules = adapter_tensors(source)
    lora = require_settings(source, lora)
    layout = layout_of(source.meta.get("model_class", "?"))
    names: dict[str, str] = {}  # checkpoint key -> PEFT key
    hf_modules = []
    for module, parts in modules.items():
        hf_module = layout.to_hf_name(f"{module}.weight").removesuffix(".weight")
        hf_modules.append(hf_module.rsplit(".", 1)[-1])
        for suffix, key in parts.items():
            names[key] = f"base_model.model.{hf_module}.{PEFT_NAMES[suffix]}"
    ranks = {source.infos[k].shape[0] for k in names if k.endswith("lora_a.weight")}
    out.mkdir(parents=True, exist_ok=True)
    infos = {names[k]: source.infos[k] for k in sorted(names, key=names.get)}
    writer = SafetensorsStreamWriter(out / "adapter_model.safetensors", infos, {"format": "pt"})
    for key in sorted(names, key=names.get):
        writer.write(names[key], source.get(key))
    writer.close()
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": ranks.pop() if len(ranks) == 1 else lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(set(hf_modules)),
        "use_dora": lora.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(i.nbytes for i in infos.values())


class MergedSource(TensorSource):
    """A base model's tensors with a checkpoint's adapters merged in, one at a time."""

    kind = "merged"

    def __init__(
        self, base: TensorSource, adapters: TensorSource, lora: LoRASettings | None
    ) -> None:
        super().__init__(base.path)
        self.base, self.adapters = base, adapters
        self.modules = adapter_tensors(adapters)
        self.alpha = float(require_settings(adapters, lora).alpha)
        self.infos = {n: i for n, i in base.infos.items() if n.startswith(MODEL_PREFIX)}
        self.meta = {
            "model_class": base.meta.get("model_class") or adapters.meta.get("model_class")
        }
        self._config = base.model_config or adapters.model_config
        missing = [m for m in self.modules if f"{MODEL_PREFIX}{m}.weight" not in self.infos]
        if missing:
            raise CheckpointError(
                f"the adapters are for module {missing[0]}, which the base {base.path} does "
                "not have; merge onto the base the adapters were trained on."
            )
        for module, parts in self.modules.items():
            weight = self.infos[f"{MODEL_PREFIX}{module}.weight"].shape
            a = adapters.infos[parts["lora_a.weight"]].shape
            b = adapters.infos[parts["lora_b.weight"]].shape
            if (b[0], a[1]) != tuple(weight):
                raise CheckpointError(
                    f"the adapter of {module} is for a [{b[0]}, {a[1]}] weight but the base "
                    f"{base.path} has {list(weight)}: it is a base of another shape. Merge "
                    "onto the base the adapters were trained on."
                )

    @property
    def model_config(self) -> dict[str, Any] | None:
        return self._config

    def get(self, name: str) -> torch.Tensor:
        tensor = self.base.get(name)
        module = name[len(MODEL_PREFIX) :].removesuffix(".weight")
        parts = self.modules.get(module) if name.endswith(".weight") else None
        if parts is None:
            return tensor
        a = self.adapters.get(parts["lora_a.weight"]).float()
        b = self.adapters.get(parts["lora_b.weight"]).float()
        delta = lora_delta(a, b, self.alpha / a.shape[0])
        magnitude = (
            self.adapters.get(parts["lora_magnitude"]) if "lora_magnitude" in parts else None
        )
        return merge_weight(tensor, delta, magnitude).to(tensor.dtype)
