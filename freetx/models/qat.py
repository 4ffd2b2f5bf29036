"""Quantization-aware training (QAT) on torchao: fake-quantized linears while training, real
quantized weights after (the `qat:` section of the SFT recipes).

    apply_qat(model, QATConfig(scheme="int8_dynamic_act_int4_weight"))   # before FSDP2
    set_fake_quantization(model, step >= cfg.start_step)                 # qat.start_step
    convert_qat(model, cfg)                                              # after training
    quantize_ptq(model, QuantScheme("int4_weight", 32))                  # PTQ, for comparison

The schemes are torchao's (0.18: `QATConfig(base_config, step="prepare")`, which infers the fake
quantization from the post-training config it names):

    int4_weight                   weights int4 per group of `group_size` input columns,
                                  asymmetric (a scale and a zero per group), activations
                                  unquantized: torchao's `Int4WeightOnlyConfig`
    int8_dynamic_act_int4_weight  weights int4 per group, symmetric; activations int8 per token,
                                  asymmetric, scaled at run time (torchtune's "8da4w"):
                                  torchao's `Int8DynamicActivationIntxWeightConfig(int4)`

What is quantized: every Linear of the decoder blocks, the embedding and the output head not
(`qat_targets`). torchao's `quantize_` and torchtune's QAT quantizers take every `nn.Linear`,
the head too; freetx leaves it in full precision as transformers' TorchAoConfig does when it
loads or quantizes a model (its `modules_to_not_convert` holds the output embeddings), so an
export quantizes the same modules here and there, a tied head stays tied to its embedding, and
the layer whose error reaches every logit directly keeps its precision (as GPTQ and AWQ leave
lm_head). An MoE router (`MoEFeedForward.gate`) is not quantized either: int4 scores would
reroute tokens. A LoRA layer (`freetx.models.peft.LoRALinear`) becomes a `QATLoRALinear`: its
frozen base fake-quantized, the adapters in full precision on the unquantized input
(torchtune's `qat_lora`); `convert_qat` merges the adapters into the base, then quantizes.

Which kernels hold the real weights depends on the device of the weights (`real_config`):

    scheme                        CPU                                CUDA
    int4_weight                   torchao.prototype Int4OpaqueTensor Int4Tensor (mslk installed)
                                  (`_weight_int4pack_mm_for_cpu`,    or tinygemm's
                                  group 32/64/128)                   Int4TilePackedTo4dTensor (bf16,
                                                                     sm80+): the model cast to bf16
    int8_dynamic_act_int4_weight  IntxUnpackedToInt8Tensor (int4 values held as int8, any device:
                                  dequantized to run; ExecuTorch's format)

Measured on CPU, torch 2.13 / torchao 0.18, fp32: the real-quantized linear equals its
fake-quantized one to 7e-7 (int4_weight) and exactly (int8_dynamic_act_int4_weight).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetx.errors import ConfigError
from freetx.fields import at_least, refuse_meaningless
from freetx.models.moe import MoEFeedForward
from freetx.models.peft import ALL_LINEAR, merge_adapters, resolve_targets
from freetx.models.peft.lora import LoRALinear
from freetx.models.peft.nf4 import NF4LoRALinear

INT4_WEIGHT = "int4_weight"
INT8_DYNAMIC_ACT_INT4_WEIGHT = "int8_dynamic_act_int4_weight"
# scheme -> what it quantizes, for messages
SCHEMES = {
    INT4_WEIGHT: "int4 weights per group, activations unquantized",
    INT8_DYNAMIC_ACT_INT4_WEIGHT: "int4 weights per group, int8 activations per token",
}
# the names torchtune's and torchao's users know a scheme by (lower case, no underscores;
# torchao's config classes and torchtune's QAT quantizers without "config" / "qatquantizer")
KNOWN_AS = {
    "8da4w": INT8_DYNAMIC_ACT_INT4_WEIGHT,
    "int8dynamicactivationint4weight": INT8_DYNAMIC_ACT_INT4_WEIGHT,
    "int8dynamicactivationintxweight": INT8_DYNAMIC_ACT_INT4_WEIGHT,
    "int8dynactint4weight": INT8_DYNAMIC_ACT_INT4_WEIGHT,
    "4w": INT4_WEIGHT,
    "int4weightonly": INT4_WEIGHT,
}
# int4_weight's real kernels take these group sizes: the CPU one (Int4OpaqueTensor) 32, 64
# and 128; CUDA's tinygemm also 256, which a CPU could not convert
INT4_GROUP_SIZES = (32, 64, 128)


def scheme_named(name: str) -> str | None:
    """The scheme `name` means (freetx's name, or torchtune's or torchao's for it), or None."""
    key = str(name).lower()
    if key in SCHEMES or key == "none":
        return key
    flat = key.replace("_", "").replace("-", "").removesuffix("config")
    return KNOWN_AS.get(flat.removesuffix("qatquantizer"))


@dataclass
class QATConfig:
    """The `qat:` section: fake quantization while training, real quantized weights after."""

    scheme: str = "none"  # none | int4_weight | int8_dynamic_act_int4_weight
    group_size: int = at_least(1, default=32)  # input columns sharing a weight scale
    start_step: int = at_least(0, default=0)  # fake quantization from this optimizer step on

    def __post_init__(self) -> None:
        refuse_meaningless(self)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values torchao could not train or convert, by key: why, and the fix."""
        found = {}
        scheme = values.get("scheme", "none")
        known = "; ".join(f"{name} ({what})" for name, what in SCHEMES.items())
        if scheme not in (*SCHEMES, "none"):
            meant = scheme_named(scheme)
            close = [meant] if meant else difflib.get_close_matches(str(scheme), list(SCHEMES), 1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            found["scheme"] = f"there is no such QAT scheme{hint}; set one of: {known}, or none."
        size = values.get("group_size", 32)
        if scheme == INT4_WEIGHT and size not in INT4_GROUP_SIZES:
            found["group_size"] = (
                "torchao's int4 weight-only kernels take groups of 32, 64 or 128 input columns "
                "(the CPU one; CUDA's tinygemm 256 too); set one of them (32 is torchtune's)."
            )
        elif scheme == INT8_DYNAMIC_ACT_INT4_WEIGHT and not (size >= 16 and size & (size - 1) == 0):
            found["group_size"] = (
                "int4 weight groups are a power of 2 of 16 or more input columns (the sizes "
                "ExecuTorch's and torchao's CPU kernels take); set 32 (torchtune's) or 64, 128, 256."
            )
        if scheme == "none" and values.get("start_step", 0):
            found["start_step"] = (
                "it starts fake quantization, and qat.scheme is none; set qat.scheme="
                f"{INT8_DYNAMIC_ACT_INT4_WEIGHT} or {INT4_WEIGHT}, or leave start_step out."
            )
        return found

    def quant_scheme(self) -> QuantScheme:
        """The real quantization this QAT trains for (`convert_qat`, the final export)."""
        return QuantScheme(self.scheme, self.group_size)


def _refused(scheme: str, group_size: int) -> str | None:
    """What QATConfig refuses of `scheme` in groups of `group_size` (a scheme that is none
    of freetx's, a group size torchao's kernels do not take), or None."""
    try:
        QATConfig(scheme=scheme, group_size=group_size)
    except ValueError as error:
        return str(error)
    return None


@dataclass(frozen=True)
class QuantScheme:
    """Real quantized weights: a scheme and its group size, checked once, when made (QATConfig's
    checks; none quantizes nothing), so what takes one (`quantize_ptq`, `real_config`,
    `hf_quantization_config`, an export) checks nothing. `QuantScheme.named` reads a user's
    name for a scheme (`--quantize`); `QATConfig.quant_scheme` a QAT run's."""

    scheme: str  # freetx's name: int4_weight | int8_dynamic_act_int4_weight
    group_size: int = 32  # input columns sharing a weight scale

    def __post_init__(self) -> None:
        refused = _refused(self.scheme, self.group_size)
        if refused:
            raise ConfigError(f"quantize: {refused}")
        if self.scheme not in SCHEMES:
            raise ConfigError(
                f"quantize: scheme {self.scheme} quantizes nothing; set one of {', '.join(SCHEMES)}."
            )

    @classmethod
    def named(cls, given: str, group_size: int) -> QuantScheme:
        """`--quantize given --group-size group_size`: freetx's scheme `given` names (its own,
        or torchtune's / torchao's for it), checked; a scheme that is none of them, `none`, or a
        group size its kernels do not take is refused with the fix."""
        scheme = scheme_named(given) or given
        if scheme == "none":
            raise ConfigError(
                f"--quantize none quantizes nothing; name a scheme: {', '.join(SCHEMES)}, or "
                "convert without --quantize."
            )
        refused = _refused(scheme, group_size)
        if refused:
            raise ConfigError(f"--quantize {given} --group-size {group_size}: {refused}")
        return cls(scheme, group_size)


def _ptq_config(scheme: str, group_size: int) -> Any:
    """torchao's post-training config of a scheme, as QAT's prepare step infers from it."""
    from torchao.quantization import Int4WeightOnlyConfig, Int8DynamicActivationIntxWeightConfig
    from torchao.quantization.granularity import PerGroup

    if scheme == INT4_WEIGHT:
        return Int4WeightOnlyConfig(group_size=group_size)
    return Int8DynamicActivationIntxWeightConfig(
        weight_dtype=torch.int4, weight_granularity=PerGroup(group_size)
    )


def real_config(quant: QuantScheme, device: torch.device) -> Any:
    """torchao's config making real quantized weights of `quant` that run on `device` (the
    table in the module's docstring)."""
    scheme, group_size = quant.scheme, quant.group_size
    if scheme == INT4_WEIGHT and device.type == "cpu":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        return PrototypeInt4WeightOnlyConfig(group_size=group_size)
    if scheme == INT4_WEIGHT and device.type == "cuda":
        import importlib.util

        from torchao.quantization import Int4WeightOnlyConfig
        from torchao.quantization.quantize_.workflows import Int4PackingFormat

        # mslk's kernels take torchao's default (plain) format; without them, tinygemm's
        plain = importlib.util.find_spec("mslk") is not None
        packing = Int4PackingFormat.PLAIN if plain else Int4PackingFormat.TILE_PACKED_TO_4D
        return Int4WeightOnlyConfig(group_size=group_size, int4_packing_format=packing)
    if scheme == INT4_WEIGHT:
        raise ConfigError(
            f"torchao 0.18 has int4 weight-only kernels for CPU and CUDA, not {device.type}; "
            f"quantize on one of those, or use {INT8_DYNAMIC_ACT_INT4_WEIGHT} (any device)."
        )
    return _ptq_config(scheme, group_size)


def qat_targets(model: nn.Module, group_size: int, key: str = "qat.group_size") -> list[str]:
    """The Linear modules a scheme quantizes: all but the output head and MoE routers. One
    whose input is no whole number of groups is refused, naming it and the fix (`key`: where
    the group size was set)."""
    modules = dict(model.named_modules())
    # routers, and a LoRA layer's adapters (its base is the target)
    skipped = {f"{n}.gate" for n, m in modules.items() if isinstance(m, MoEFeedForward)}
    skipped |= {
        f"{n}.{c}" for n, m in modules.items() if isinstance(m, LoRALinear) for c in m._modules
    }
    names = [n for n in resolve_targets(model, [ALL_LINEAR])[ALL_LINEAR] if n not in skipped]
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, NF4LoRALinear):
            raise ConfigError(
                f"{name} has an NF4 base (QLoRA), which torchao's QAT cannot fake-quantize: "
                "set peft.quantize_base=none to train LoRA with qat:, or leave qat: out."
            )
        if layer.in_features % group_size:
            sizes = [s for s in (16, 32, 64, 128, 256) if layer.in_features % s == 0]
            raise ConfigError(
                f"{key}={group_size} does not divide the {layer.in_features} input "
                f"columns of {name}, and every group of a weight needs {group_size} of them. Set "
                f"{key} to one that divides it ({', '.join(map(str, sizes)) or 'none'})."
            )
    return names


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


class QATLoRALinear(LoRALinear):
    """`LoRALinear` whose frozen base computes with fake-quantized weights (and, with an
    activation quantizer, fake-quantized inputs); the adapters see the unquantized input, as in
    torchtune's `qat_lora`. Its parameters and hooks are LoRALinear's."""

    @classmethod
    def from_lora(cls, layer: LoRALinear, base_config: Any) -> QATLoRALinear:
        """The same layer (meta or not: its parameters are taken over) with the fake quantizers
        torchao's prepare step gives a Linear of its shape for `base_config`."""
        from torchao.quantization import quantize_
        from torchao.quantization.qat import QATConfig as TorchaoQATConfig

        prepared = cls.on_meta_like(layer)
        with torch.device("meta"):
            probe = nn.Sequential(nn.Linear(layer.in_features, layer.out_features, bias=False))
        prepared.load_state_dict(layer.state_dict(keep_vars=True), assign=True)
        quantize_(probe, TorchaoQATConfig(base_config, step="prepare"))
        prepared.activation_fake_quantizer = probe[0].activation_fake_quantizer
        prepared.weight_fake_quantizer = probe[0].weight_fake_quantizer
        return prepared

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """W x with W (and x) fake-quantized."""
        if self.activation_fake_quantizer is not None:
            x = self.activation_fake_quantizer(x)
        return F.linear(x, self.weight_fake_quantizer(self.base_weight()).to(x.dtype))


def apply_qat(model: nn.Module, cfg: QATConfig) -> list[str]:
    """Prepare `model` (on the meta device or not, before FSDP2) for fake quantization by
    `cfg.scheme`: torchao's prepare step on every target Linear (`qat_targets`), a LoRA layer
    made a `QATLoRALinear`. Returns the prepared modules' names ([] for scheme none).
    Parameter names do not change, so checkpoints load as before."""
    if cfg.scheme == "none":
        return []
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    names = qat_targets(model, cfg.group_size)
    base = _ptq_config(cfg.scheme, cfg.group_size)
    for name in names:
        layer = model.get_submodule(name)
        if isinstance(layer, LoRALinear):
            _replace(model, name, QATLoRALinear.from_lora(layer, base))
    chosen = set(names)
    quantize_(
        model,
        TorchaoQATConfig(base, step="prepare"),
        filter_fn=lambda m, fqn: fqn in chosen and not isinstance(m, LoRALinear),
    )
    return names


def set_fake_quantization(model: nn.Module, enabled: bool) -> None:
    """Turn every fake quantizer of a prepared model on or off (off: the model computes as
    the unprepared one, exactly; `qat.start_step`)."""
    from torchao.quantization.qat import FakeQuantizerBase

    for module in model.modules():
        if isinstance(module, FakeQuantizerBase):
            module.enabled = enabled


def quantize_ptq(model: nn.Module, quant: QuantScheme) -> nn.Module:
    """Real quantized weights of `quant` in the target Linears of a full-precision model, in
    place, for the device its weights are on: post-training quantization (and `convert_qat`'s
    last step). LoRA adapters are merged first. On CUDA, int4_weight casts the model to bf16
    (tinygemm's kernel computes in bf16)."""
    from torchao.quantization import quantize_

    merge_adapters(model)
    chosen = set(qat_targets(model, quant.group_size))
    device = next(model.parameters()).device
    if quant.scheme == INT4_WEIGHT and device.type == "cuda":
        model.to(torch.bfloat16)
    quantize_(
        model,
        real_config(quant, device),
        filter_fn=lambda m, fqn: fqn in chosen and isinstance(m, nn.Linear),
    )
    return model


def convert_qat(model: nn.Module, cfg: QATConfig) -> nn.Module:
    """torchao's convert step: the fake-quantized linears back to plain ones (adapters merged),
    then the same real quantization as `quantize_ptq`. A whole (unsharded) model, in place."""
    from torchao.quantization import quantize_
    from torchao.quantization.qat import FakeQuantizedLinear
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    if cfg.scheme == "none":
        return model
    quantize_(
        model,
        TorchaoQATConfig(step="convert"),
        filter_fn=lambda m, fqn: isinstance(m, FakeQuantizedLinear),
    )
    return quantize_ptq(model, cfg.quant_scheme())


# -- export: what transformers loads (its TorchAoConfig) ------------------------------------
# torchao 0.18 serializes these tensor classes to safetensors (its ALLOWED_TENSORS_SUBCLASSES);
# the CPU's int4 Int4OpaqueTensor is not among them
SERIALIZED = ("IntxUnpackedToInt8Tensor", "Int4Tensor", "Int4TilePackedTo4dTensor")


def hf_quantization_config(quant: QuantScheme, device: torch.device) -> dict[str, Any]:
    """The `quantization_config` of config.json that makes transformers load a quantized
    export (`TorchAoConfig` of the config `real_config` gives; the output head and embedding
    are not quantized, as its default `modules_to_not_convert` has them)."""
    from transformers import TorchAoConfig

    return TorchAoConfig(real_config(quant, device)).to_dict()


def flat_quantized(
    state: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A quantized model's state dict (its keys already the exported names) as safetensors'
    tensors and metadata: each torchao tensor `a.weight` stored as `a._weight_qdata`,
    `a._weight_scale`, ... and described in the metadata (torchao's format, which
    transformers reads back)."""
    from torchao.prototype.safetensors.safetensors_support import flatten_tensor_state_dict

    for name, tensor in state.items():
        kind = type(tensor).__name__
        if type(tensor) is not torch.Tensor and kind not in SERIALIZED:
            raise ConfigError(
                f"{name} is a torchao {kind}, which torchao {_torchao_version()} cannot write to "
                "safetensors (the CPU's int4 kernel format). Export int4_weight from a CUDA "
                f"machine, or train and export {INT8_DYNAMIC_ACT_INT4_WEIGHT} (any device)."
            )
    return flatten_tensor_state_dict(state)


def _torchao_version() -> str:
    import torchao

    return torchao.__version__
