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

Adapters on MoE experts (`freetx.models.peft.experts`: `<experts>.lora_<parameter>.lora_a`
[E, r, cols] and `.lora_b` [E, rows, r], as the grouped tensor is stored) export as PEFT's
`target_parameters` (its `ParamWrapper`, PEFT 0.21): under transformers' module of the
experts (`model.layers.1.mlp.experts`), one wrapper per parameter nested in the order
the module registers them, the first innermost (`...experts.base_layer.lora_A.weight`:
gate_up_proj's, `...experts.lora_A.weight`: down_proj's), with lora_A [r*E, in] (expert
e's rows e*r..e*r+r-1) and lora_B [out, r*E] (expert e's columns e, E+e, 2E+e, ...):
`expert_peft_factors`. Expert e's update is alpha/r B_e A_e, as freetx's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from freetx.checkpoint.dcp_folder import FROZEN_FROM, MODEL_PREFIX
from freetx.checkpoint.formats import TensorInfo, TensorSource
from freetx.errors import CheckpointError
from freetx.models.hf import HFLayout, layout_of
from freetx.models.peft.experts import (
    EXPERT_ADAPTER_KEY,
    EXPERT_PARAMETERS,
    adapted_by,
    expert_delta,
    part_of,
    updated_part,
)
from freetx.models.peft.lora import PEFT_NAMES, lora_delta, merge_weight

if TYPE_CHECKING:
    from freetx.models.hf_generic import ConvertedNames


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
    linear = any(name.endswith("." + s) for name in source.infos for s in PEFT_NAMES)
    if not linear and not expert_adapter_tensors(source):
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


def expert_adapter_tensors(source: TensorSource) -> dict[tuple[str, str], dict[str, str]]:
    """(experts module, transformers parameter) -> {lora_a, lora_b: checkpoint key}, for
    every adapted grouped expert tensor (`freetx.models.peft.experts`)."""
    found: dict[tuple[str, str], dict[str, str]] = {}
    for key in source.infos:
        match = EXPERT_ADAPTER_KEY.match(key[len(MODEL_PREFIX) :])
        if key.startswith(MODEL_PREFIX) and match:
            found.setdefault((match[1], match[2]), {})[match[3]] = key
    return found


def adapter_tensors(source: TensorSource) -> dict[str, dict[str, str]]:
    """module name -> {adapter parameter: checkpoint key}, for every adapted Linear module
    (an error when the checkpoint has no adapters, of Linear modules or experts)."""
    found: dict[str, dict[str, str]] = {}
    for key in source.infos:
        if not key.startswith(MODEL_PREFIX):
            continue
        name = key[len(MODEL_PREFIX) :]
        for suffix in PEFT_NAMES:
            if name.endswith("." + suffix):
                found.setdefault(name[: -len(suffix) - 1], {})[suffix] = key
    if not found and not expert_adapter_tensors(source):
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
    hf_config = layout.to_hf_config(source.model_config, "float32")
    hf_type = hf_config.get("model_type", "")
    moved = peft_moves_onto_experts(hf_type, sorted(set(hf_modules)))
    if moved:
        raise CheckpointError(
            f"PEFT reads the target_modules {', '.join(moved)} of a {hf_type} adapter as "
            "transformers 4's names of an MoE block's experts and moves them onto the fused "
            "experts when it loads the adapter, so these adapters (on the dense layers' or "
            "shared experts' Linear modules) would not load as trained. Merge instead "
            "(freetx checkpoint merge CKPT --base MODEL DST) for a folder with the update "
            "applied, or train without adapters on those modules "
            "(peft.target_modules=[q_proj, k_proj, v_proj, o_proj, experts])."
        )
    ranks = {source.infos[k].shape[0] for k in names if k.endswith("lora_a.weight")}
    # a sequence classifier (a reward model): its head trained whole beside the adapters,
    # PEFT's modules_to_save, stored under the module's own name
    head = hf_config.get("num_labels") == 1 and MODEL_PREFIX + "score.weight" in source.infos
    if head:
        names[MODEL_PREFIX + "score.weight"] = "base_model.model." + layout.to_hf_name(
            "score.weight"
        )
    experts = expert_peft_tensors(source, layout)
    ranks |= experts.ranks
    out.mkdir(parents=True, exist_ok=True)
    infos = {names[k]: source.infos[k] for k in names} | experts.infos
    writer = SafetensorsStreamWriter(
        out / "adapter_model.safetensors", dict(sorted(infos.items())), {"format": "pt"}
    )
    by_peft = {peft: key for key, peft in names.items()}
    for name in sorted(infos):  # one adapter tensor at a time
        tensor = source.get(by_peft[name]) if name in by_peft else experts.tensors[name]()
        writer.write(name, tensor)
    writer.close()
    config = {
        "peft_type": "LORA",
        "task_type": "SEQ_CLS" if head else "CAUSAL_LM",
        "base_model_name_or_path": base_path,
        "r": ranks.pop() if len(ranks) == 1 else lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(set(hf_modules)),
        "target_parameters": experts.targets or None,
        "use_dora": lora.use_dora,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": ["score"] if head else None,
        "use_rslora": False,
        "layers_to_transform": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return sum(i.nbytes for i in infos.values())


def peft_moves_onto_experts(model_type: str, targets: list[str]) -> list[str]:
    """The `targets` PEFT (0.21's `_convert_peft_config_moe`) reads, for an adapter of a
    `model_type` whose experts transformers fuses, as transformers 4's per-expert module
    names (DeepSeek-V3, GLM-4.5, OLMoE, Qwen3-MoE: gate_proj, up_proj, down_proj) and
    moves onto the fused experts, dropping them as trained; [] where PEFT is not installed
    or keeps no such table (its private one, read as it is)."""
    try:
        from peft.utils import transformers_weight_conversion as conversion

        base = conversion._MODEL_TO_CONVERSION_PATTERN.get(model_type)
        old_names = conversion._MOE_TARGET_MODULE_MAPPING.get(base, {})
    except (ImportError, AttributeError):
        return []
    return [t for t in targets if any(t == old or t.endswith(f".{old}") for old in old_names)]


@dataclass
class ExpertPEFTTensors:
    """A checkpoint's expert adapters as PEFT holds them, each made when written: PEFT key
    -> its info and a function making it; the ranks, and the `target_parameters`."""

    infos: dict[str, TensorInfo]
    tensors: dict[str, Callable[[], torch.Tensor]]
    ranks: set[int]
    targets: list[str]


def expert_peft_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, transposed: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT's lora_A [r*E, in] and lora_B [out, r*E] of freetx's expert adapter A [E, r,
    cols], B [E, rows, r] (`transposed`: the tensor is stored [E, in, out], GPT-OSS's, so B
    is the input side)."""
    if transposed:
        lora_a, lora_b = lora_b.transpose(1, 2), lora_a.transpose(1, 2)
    experts, rank, inputs = lora_a.shape
    return (
        lora_a.reshape(experts * rank, inputs).contiguous(),
        lora_b.permute(1, 2, 0).reshape(lora_b.shape[1], rank * experts).contiguous(),
    )


def expert_peft_tensors(source: TensorSource, layout: HFLayout) -> ExpertPEFTTensors:
    """The checkpoint's expert adapters under PEFT's keys (`expert_peft_factors`): the
    experts module as transformers' model names it (its own conversion rules applied to
    the stored name of the tensor's first expert), a `base_layer.` for each adapted
    parameter the module registers after this one (PEFT nests them so)."""
    adapters = expert_adapter_tensors(source)
    found = ExpertPEFTTensors({}, {}, set(), [])
    if not adapters:
        return found
    hf, model = models_of(source, layout)
    by_module: dict[str, list[str]] = {}
    for module, param in adapters:
        by_module.setdefault(module, []).append(param)
    for module, params in by_module.items():
        params.sort(key=EXPERT_PARAMETERS.index)
        for depth, param in enumerate(reversed(params)):
            keys = adapters[(module, param)]
            a, b = source.infos[keys["lora_a"]], source.infos[keys["lora_b"]]
            (experts, rank, cols), rows = a.shape, b.shape[1]
            base = next(  # the first tensor of the module the adapter updates (w1: gate_up)
                name
                for name, _ in model.get_submodule(module).named_parameters(recurse=False)
                if adapted_by(f"{module}.{name}") == (module, param)
            )
            stored = layout.to_hf_names(f"{module}.{base}", experts, source.model_config)[0]
            hf_name = hf.names.place(stored)[0]
            hf_module = hf_name.rpartition(".")[0]
            transposed = bool(getattr(hf.model.get_submodule(hf_module), "is_transposed", False))
            inputs, outputs = (rows, cols) if transposed else (cols, rows)
            prefix = f"base_model.model.{hf_module}.{'base_layer.' * depth}"
            found.infos[prefix + "lora_A.weight"] = TensorInfo((rank * experts, inputs), a.dtype)
            found.infos[prefix + "lora_B.weight"] = TensorInfo((outputs, rank * experts), b.dtype)

            def factors(keys=keys, transposed=transposed):
                a, b = source.get(keys["lora_a"]), source.get(keys["lora_b"])
                return expert_peft_factors(a, b, transposed)

            found.tensors[prefix + "lora_A.weight"] = lambda f=factors: f()[0]
            found.tensors[prefix + "lora_B.weight"] = lambda f=factors: f()[1]
            found.ranks.add(rank)
            found.targets.append(re.sub(r"^.*\.\d+\.", "", hf_name))
    found.targets = sorted(set(found.targets))
    return found


@dataclass
class HFModel:
    """transformers' model of a checkpoint's config (on the meta device) and its rules."""

    model: torch.nn.Module
    names: ConvertedNames


def models_of(source: TensorSource, layout: HFLayout) -> tuple[HFModel, torch.nn.Module]:
    """transformers' model of the checkpoint's config with its conversion rules, and
    freetx's model, both on the meta device."""
    from freetx.models.hf_generic import build_hf, converted_names
    from freetx.models.protocol import build_model

    hf_config = layout.to_hf_config(source.model_config, "float32")
    with torch.device("meta"):
        hf = build_hf(hf_config)
        model = build_model(source.meta["model_class"], source.model_config)
    return HFModel(hf, converted_names(hf, hf_config)), model


class MergedSource(TensorSource):
    """A base model's tensors with a checkpoint's adapters merged in, one at a time."""

    kind = "merged"

    def __init__(
        self, base: TensorSource, adapters: TensorSource, lora: LoRASettings | None
    ) -> None:
        super().__init__(base.path)
        self.base, self.adapters = base, adapters
        if MODEL_PREFIX + "score.weight" in adapters.infos:  # a reward model's trained head
            raise CheckpointError(
                f"{adapters.path} is a LoRA reward model's: its trained score head is not in "
                "the base, and a merge onto it would drop it. Export it for PEFT instead "
                "(freetx checkpoint convert RUN DST --to peft: a SEQ_CLS adapter with the head), "
                "or train the reward model's every weight for an HF folder."
            )
        self.modules = adapter_tensors(adapters)
        self.experts = expert_adapter_tensors(adapters)
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
        for name in self.model_names():
            parts = self.experts.get(adapted_by(name))
            if parts is not None:
                a = adapters.infos[parts["lora_a"]].shape
                b = adapters.infos[parts["lora_b"]].shape
                self._check_experts(name, (a[0], b[1], a[2]))

    def _check_experts(self, name: str, adapted: tuple[int, int, int]) -> None:
        """The adapter of grouped tensor `name` updates [E, rows, cols] (a native w1 / w3
        is half of gate_up_proj's rows)."""
        shape = tuple(self.infos[MODEL_PREFIX + name].shape)
        _, parts = part_of(name)
        wanted = [adapted[0], adapted[1] // parts, adapted[2]]
        if tuple(wanted) != shape:
            raise CheckpointError(
                f"the expert adapter of {name} is for a {wanted} tensor but the base "
                f"{self.base.path} has {list(shape)}: it is a base of another shape. Merge "
                "onto the base the adapters were trained on."
            )

    @property
    def model_config(self) -> dict[str, Any] | None:
        return self._config

    def get(self, name: str) -> torch.Tensor:
        tensor = self.base.get(name)
        experts = self.experts.get(adapted_by(name[len(MODEL_PREFIX) :]))
        if experts is not None:
            a = self.adapters.get(experts["lora_a"]).float()
            delta = expert_delta(
                a, self.adapters.get(experts["lora_b"]).float(), self.alpha / a.shape[1]
            )
            return merge_weight(tensor, updated_part(name, delta)).to(tensor.dtype)
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
