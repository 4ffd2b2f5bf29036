"""Parameter-efficient fine-tuning, applied to a model on the meta device before
`parallelize`: LoRA / DoRA adapters (`lora.py`), an NF4 base for QLoRA (`nf4.py`),
and Spectrum's choice of which modules to train (`spectrum.py`).

    apply_lora(model, targets=["q", "v"], rank=16, alpha=32)   # adapters; the base frozen
    train_only(model, modules)                                 # Spectrum: these train

Targets are the model's own short names (`adapter_targets` of the model class:
q, k, v, o, gate, up, down, output for the decoder, qkv and gate_up where its
projections are fused (Phi-3); HF names like q_proj work too) or suffixes of module names. Adapters are sharded with the block they sit
in, their parameters are the only trainable ones, and a fresh adapter leaves
the model's output unchanged. `experts` names the grouped expert tensors of MoE blocks
(per-expert adapters, `experts.py`), which `all-linear` includes too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.fields import at_least, refuse_meaningless
from freetx.models.moe import Router
from freetx.models.peft.experts import (
    EXPERT_ADAPTER_PARAMETERS,
    EXPERTS,
    ExpertLoRA,
    adapt_experts,
    expert_adapter_layers,
    expert_modules,
    expert_option_problems,
    expert_tensors,
    merge_expert_adapters,
    refuse_expert_options,
)
from freetx.models.peft.lora import ADAPTER_PARAMETERS, LoRALinear
from freetx.models.protocol import AdapterTargets, AlwaysTrained, ReplacesLanguageHead


@dataclass
class PEFTConfig:
    """The `peft:` section: what of a model trains (names as PEFT users know them)."""

    method: Literal["none", "lora", "spectrum"] = "none"  # none: full fine-tuning
    # lora: adapters on these Linear modules (q, k, v, o, gate, up, down, output, or HF names;
    # experts: the grouped expert tensors of MoE blocks; all-linear: every Linear but the
    # output head, and the experts). A list, or one name as PEFT takes it: all-linear, q_proj
    # (typed Any so that the config may hold either; a list once built)
    target_modules: Any = field(default_factory=lambda: ["q", "k", "v", "o", "gate", "up", "down"])
    rank: int = at_least(1, default=16)  # PEFT's r
    alpha: float = 32.0  # PEFT's lora_alpha: the update is scaled by alpha / rank
    dropout: float = 0.0  # PEFT's lora_dropout, on the adapter's input
    use_dora: bool = False  # DoRA: a trained magnitude per output row
    quantize_base: Literal["none", "nf4"] = "none"  # nf4: QLoRA (the adapted bases in NF4)
    # spectrum: the selection `freetx spectrum scan` wrote; those modules train fully
    spectrum_selection: Optional[str] = None

    def __post_init__(self) -> None:
        refuse_meaningless(self)
        self.target_modules = module_names(self.target_modules)

    @staticmethod
    def meaningless(values: dict[str, Any]) -> dict[str, str]:
        """Values that leave a knob nothing to do (freetx.fields: checked by `freetx validate`,
        before a run, and here), by key: why, and the fix."""
        found = {}
        method = values["method"]
        targets = module_names(values["target_modules"])
        if targets is None:
            return {
                "target_modules": (
                    "it names the modules LoRA adapts: a list of names ([q, k, v]), or one "
                    "name as PEFT takes it (all-linear, q_proj)."
                )
            }
        if method == "lora":
            if values["alpha"] <= 0:
                found["alpha"] = (
                    "LoRA scales each update by alpha / rank, so the adapters could never "
                    "change the output; set it above 0 (commonly twice the rank, e.g. 32 for "
                    "rank 16)."
                )
            if EXPERTS in targets:  # LoRA on experts does not do these
                found.update(expert_option_problems(values["dropout"], values["use_dora"]))
            if not targets:
                found["target_modules"] = (
                    "LoRA adapts these modules and freezes the rest, so nothing would train; "
                    "name some (q, k, v, o, gate, up, down)."
                )
        if not 0 <= values["dropout"] < 1:
            found["dropout"] = (
                "it is the probability of dropping an adapter's input; set it in [0, 1) "
                "(1 drops every input, so the adapters never act)."
            )
        if method != "lora":
            for key, off in (("use_dora", False), ("quantize_base", "none")):
                if values[key] != off:
                    found[key] = (
                        f"it applies to LoRA adapters and peft.method is {method}; set "
                        "peft.method=lora (QLoRA: peft.quantize_base=nf4) or leave it out."
                    )
        if method == "spectrum" and not values["spectrum_selection"]:
            found["spectrum_selection"] = (
                "peft.method=spectrum trains the modules of a selection: make one with "
                "`freetx spectrum scan MODEL --top-percent 25` and set "
                "peft.spectrum_selection=FILE."
            )
        return found


def module_names(targets: Any) -> list[str] | None:
    """`peft.target_modules` as a list of names: a list (or a config's list node) as it is,
    one name (PEFT's `target_modules="all-linear"`) as a list of it; None when it is
    neither."""
    if isinstance(targets, str):
        return [targets]
    if isinstance(targets, Sequence) and all(isinstance(t, str) for t in targets):
        return list(targets)  # a config's ListConfig is a Sequence too
    return None


__all__ = [
    "ADAPTER_PARAMETERS",
    "PEFTConfig",
    "apply_peft",
    "LoRALinear",
    "adapter_layers",
    "adapters_disabled",
    "apply_lora",
    "is_adapter_parameter",
    "merge_adapters",
    "resolve_targets",
    "train_only",
]


def linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]


def _named(names: list[str], suffix: str) -> list[str]:
    """The module names that are `suffix` or end in `.suffix`."""
    return [n for n in names if n == suffix or n.endswith("." + suffix)]


ALL_LINEAR = "all-linear"


def resolve_targets(model: nn.Module, targets: list[str]) -> dict[str, list[str]]:
    """target -> the names of the Linear modules it means (`all-linear`: all but the output
    head and the MoE routers, as PEFT means it on transformers' models), and `experts` -> the modules holding MoE experts as grouped
    tensors (`expert_modules`); an error lists what exists."""
    aliases = (model.adapter_targets or {}) if isinstance(model, AdapterTargets) else {}
    linears = linear_names(model)
    # MoE routers (freetx's `Router` is a Linear; transformers' are not, so PEFT's all-linear
    # leaves them, and an adapter on one could not be exported to PEFT)
    routers = {name for name, module in model.named_modules() if isinstance(module, Router)}
    found: dict[str, list[str]] = {}
    head = aliases.get("lm_head", "lm_head")  # the output head, as the model names it
    # a head that replaces a language model's (a reward model's score) trains whole
    new_heads = (
        {n.rpartition(".")[0] for n in model.NEW_HEAD}
        if isinstance(model, ReplacesLanguageHead)
        else set()
    )
    for target in targets:
        if aliases.get(target, target) in new_heads:
            raise ConfigError(
                f"peft.target_modules names {target}: {type(model).__name__}'s head, which "
                "trains whole beside the adapters (PEFT's modules_to_save), not through one.",
                fix=f"Leave {target} out of peft.target_modules.",
            )
        if target == ALL_LINEAR:  # PEFT's meaning: every Linear module but the output head
            found[target] = [
                n for n in linears if n != head and n not in routers and n not in new_heads
            ]
        elif target == EXPERTS:
            found[target] = expert_modules(model)
        else:
            found[target] = _named(linears, aliases.get(target, target))
    if not any(t in (ALL_LINEAR, EXPERTS) for t in targets):
        _refuse_expert_targets(model, {t: aliases.get(t, t) for t in targets}, aliases)
    missing = [t for t, names in found.items() if not names]
    if missing:
        kinds = sorted({n.rsplit(".", 1)[-1] for n in linears})
        # only the names this model's modules answer to (a decoder with fused projections
        # has qkv and gate_up, not q, k, v, gate, up)
        known = [alias for alias, suffix in aliases.items() if _named(linears, suffix)]
        known += [EXPERTS] if expert_modules(model) else []
        raise ConfigError(
            f"peft target(s) {', '.join(repr(t) for t in missing)} match no Linear module of "
            f"{type(model).__name__}"
            + (" (`experts`: it has no MoE block)" if EXPERTS in missing else "")
            + f". Targets it knows: {', '.join(known) or '(none)'}; its Linear modules end "
            f"in: {', '.join(kinds)}."
        )
    return found


def _refuse_expert_targets(
    model: nn.Module, suffixes: dict[str, str], aliases: dict[str, str]
) -> None:
    """An MoE block holds its experts' projections as grouped tensors
    (`freetx.models.moe.GroupedExperts`, transformers' 3-D gate_up_proj / down_proj), which
    a Linear target does not reach: a target naming one of them is refused, pointing at
    the `experts` target (unless `experts` or all-linear is a target too, which adapts
    them)."""
    grouped = expert_tensors(model)
    attention = "q,k,v,o" if "q" in aliases else "q_proj,k_proj,v_proj,o_proj"  # HF's names
    for target, suffix in suffixes.items():
        # a bare name (`down`, `down_proj`) means these too; a path only where it names
        # them (`shared_expert.down_proj` is a Linear)
        hits = _named(grouped, suffix if "." in target else suffix.rsplit(".", 1)[-1])
        if hits:
            raise ConfigError(
                f"peft target {target!r} names an MLP projection, which this model's MoE "
                f"blocks hold as one grouped tensor of all experts ({hits[0]}); a Linear "
                "target does not reach them. Adapt the experts with the target `experts` "
                f"(peft.target_modules=[{attention},experts], or all-linear), or the "
                f"attention alone: peft.target_modules=[{attention}]."
            )


def apply_lora(
    model: nn.Module,
    targets: list[str],
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    use_dora: bool = False,
) -> list[str]:
    """Replace the targeted Linear modules by `LoRALinear`, give the targeted experts
    modules per-expert adapters (`experts` or all-linear: `adapt_experts`), and freeze
    everything else (but a new head: `ReplacesLanguageHead`). Returns the adapted module names. Works on a meta model (nothing is
    allocated)."""
    found = resolve_targets(model, targets)
    experts = expert_modules(model) if ALL_LINEAR in found else found.pop(EXPERTS, [])
    found.pop(EXPERTS, None)
    if experts:
        refuse_expert_options(dropout, use_dora)
    names = sorted({n for linears in found.values() for n in linears})
    # all-linear adapts every Linear as PEFT does, one narrower than the rank too (Qwen2-
    # and Qwen3.5-MoE's shared_expert_gate, hidden -> 1); a target naming one is refused
    named = {n for target, linears in found.items() if target != ALL_LINEAR for n in linears}
    for name in names:
        linear = model.get_submodule(name)
        if name in named and not 0 < rank <= min(linear.in_features, linear.out_features):
            raise ConfigError(
                f"peft.rank={rank} does not fit {name} ({linear.in_features} -> "
                f"{linear.out_features}): a LoRA rank is at least 1 and at most the smaller "
                f"side, {min(linear.in_features, linear.out_features)}."
            )
        with torch.device(linear.weight.device):
            adapted = LoRALinear(
                linear.in_features,
                linear.out_features,
                linear.bias is not None,
                rank,
                alpha,
                dropout,
                use_dora,
            )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, adapted)
    adapt_experts(model, experts, rank, alpha)
    # a head that replaces a language model's (a reward model's score) is new: it trains
    # whole beside the adapters (PEFT's modules_to_save)
    head = set(model.NEW_HEAD) if isinstance(model, ReplacesLanguageHead) else set()
    for pname, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(model, pname) or pname in head)
    return sorted(names + experts)


def adapter_layers(model: nn.Module) -> dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def adapted_modules(model: nn.Module) -> list[nn.Module]:
    """Every module of `model` with adapters: LoRA layers and experts modules."""
    return [*adapter_layers(model).values(), *expert_adapter_layers(model).values()]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Within it, every adapter layer of `model` computes its base alone (W x + b): the
    base model, without a second copy of its weights (DPO's reference under LoRA, QLoRA,
    DoRA). The adapters' parameters are untouched; FSDP2 still gathers them with their
    block."""
    layers = adapted_modules(model)
    for layer in layers:
        layer.adapter_enabled = False
    try:
        yield
    finally:
        for layer in layers:
            layer.adapter_enabled = True


def is_adapter_parameter(model: nn.Module, name: str) -> bool:
    """Whether parameter `name` belongs to an adapter (never in a base model's file)."""
    for suffix in ADAPTER_PARAMETERS:
        if name.endswith("." + suffix):
            owner = model.get_submodule(name[: -len(suffix) - 1])
            return isinstance(owner, LoRALinear)
    owner, _, local = name.rpartition(".")
    return local in EXPERT_ADAPTER_PARAMETERS and isinstance(model.get_submodule(owner), ExpertLoRA)


def train_only(model: nn.Module, modules: list[str], always: list[str] = ()) -> list[str]:
    """Freeze every parameter except those of `modules` and `always` (Spectrum's choice,
    plus what it always trains); returns the trainable parameter names."""
    known = dict(model.named_modules())
    missing = [m for m in modules if m not in known]
    if missing:
        raise ConfigError(
            f"the selection names {len(missing)} module(s) this model does not have, e.g. "
            f"{missing[0]}; it was made for another model. Scan this model again."
        )
    keep = tuple(f"{m}." for m in (*modules, *always))
    trainable = []
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith(keep))
        if param.requires_grad:
            trainable.append(name)
    return trainable


@torch.no_grad()
def merge_adapters(model: nn.Module) -> nn.Module:
    """Replace every LoRALinear by a plain Linear holding its merged weight, and add every
    expert adapter's update to its grouped tensor (in place)."""
    for name, layer in adapter_layers(model).items():
        merged = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        weight = layer.merged_weight()
        merged.weight.data = weight.to(layer.lora_a.weight.dtype)
        if layer.bias is not None:
            merged.bias.data = layer.bias.detach().clone()
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, merged)
    merge_expert_adapters(model)
    return model


def check_nf4_experts_slices(cfg: PEFTConfig, axis: str = "tp") -> None:
    """QLoRA on experts (`experts` or all-linear targeted) is refused with tensor
    parallelism (`axis` "tp"), as an NF4 Linear base is, and with expert parallelism
    ("ep": its experts would be spread over a 2-D mesh) (`freetx.training.check_layout`,
    before anything is launched): torchao's NF4 tensors shard over fsdp's ranks only."""
    targets = {EXPERTS, ALL_LINEAR} & set(cfg.target_modules)
    if cfg.method == "lora" and cfg.quantize_base == "nf4" and targets:
        held = "under tensor parallelism (it refuses NF4 Linear bases there too)"
        if axis == "ep":
            held = "spread over ep ranks and sharded by fsdp within them (a 2-D mesh)"
        raise ConfigError(
            f"distributed.{axis}: QLoRA keeps the MoE experts' bases as NF4 tensors, which "
            f"shard over fsdp's ranks only, and freetx does not hold them {held}.",
            fix=f"Use LoRA on the experts with {axis} (peft.quantize_base=none), or set "
            f"distributed.{axis}=1 (fsdp shards NF4 bases).",
        )


def apply_peft(model: nn.Module, cfg: PEFTConfig, world_size: int = 1) -> str:
    """Apply the `peft:` section to a meta model (before it is parallelized over
    `world_size` ranks); returns a line for the banner."""
    if cfg.method == "none":  # PEFTConfig refused LoRA's knobs without LoRA
        return "full"
    if cfg.method == "lora":
        names = apply_lora(
            model, list(cfg.target_modules), cfg.rank, cfg.alpha, cfg.dropout, cfg.use_dora
        )
        if cfg.quantize_base == "nf4":
            from freetx.models.peft.nf4 import quantize_bases

            quantize_bases(model, world_size)
        kind = "DoRA" if cfg.use_dora else "LoRA"
        kind = f"Q{kind}" if cfg.quantize_base == "nf4" else kind
        return f"{kind} r={cfg.rank} alpha={cfg.alpha:g} on {len(names)} modules"
    from freetx.models.peft.spectrum import read_selection

    selection = read_selection(cfg.spectrum_selection)
    always = model.always_trained if isinstance(model, AlwaysTrained) else ()
    train_only(model, selection["modules"], always=always)
    return f"Spectrum: {len(selection['modules'])} modules (top {selection['top_percent']:g}%)"
