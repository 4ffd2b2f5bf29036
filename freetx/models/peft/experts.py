"""LoRA on the experts of MoE blocks: each expert's own low-rank update of a grouped
expert tensor (all experts' projections of a block in one parameter [E, rows, cols]).

    ExpertLoRA          A [E, r, cols], B [E, rows, r]: expert e's slice W[e] [rows, cols]
                        becomes W[e] + s B[e] A[e] (s = alpha / rank); one factor starts at
                        zero, so a fresh adapter leaves the output unchanged
    LoRAGroupedExperts  freetx's `GroupedExperts` (native Mixtral, Qwen3-MoE) with one
                        adapter per tensor transformers holds: `lora_gate_up_proj` for w1
                        and w3 as transformers' gate_up_proj [E, 2F, H] (B's rows :F are
                        w1's, F: w3's) and `lora_down_proj` for w2. The forward adds the
                        update through `grouped_linear` on the tokens sorted by expert
                        (x -> A -> B), never a dense [E, rows, cols] update.
    transformers' experts  a module holding 3-D expert parameters (`EXPERT_PARAMETERS`:
                        gate_up_proj, up_proj, down_proj; Qwen2-MoE, DeepSeek-V3, GLM-4.5,
                        OLMoE, GPT-OSS, ... on the generic path) gets a `lora_<name>` adapter
                        per parameter and computes with W + s B A in place of W (each
                        expert's), as PEFT's `ParamWrapper` does: the dense update of every
                        expert is made for each forward. GPT-OSS stores its experts
                        transposed ([E, in, out], `is_transposed`): the adapter is kept in
                        the stored orientation, B on the input side.

Each adapter is kept in the orientation of the tensor it updates (rows, cols as stored), so
a merge is `W + s B A` per expert whatever the model (`expert_delta`); PEFT's orientation
([out, in]) is the export's business (`freetx.checkpoint.adapters`). PEFT refuses dropout
and DoRA on expert parameters (`ParamWrapper`), and so does freetx: `expert_option_problems`.
A base is read through `base_weight` / `base_output`, which QLoRA's subclasses
(`freetx.models.peft.nf4`: the bases in NF4) override.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from freetx.errors import ConfigError
from freetx.models.moe import GroupedExperts, grouped_linear, local_rows

# transformers' names for the 3-D expert parameters it holds (in the order its experts
# modules register them: PEFT nests its wrappers in that order, the first innermost)
EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")
# an adapter's parameters (under `<experts module>.lora_<parameter>`)
EXPERT_ADAPTER_PARAMETERS = ("lora_a", "lora_b")
# a native GroupedExperts' tensors -> (the transformers parameter whose adapter updates it,
# its part, of how many along the rows): w1 and w3 are gate_up_proj's halves
NATIVE_PARTS = {
    "w1": ("gate_up_proj", 0, 2),
    "w3": ("gate_up_proj", 1, 2),
    "w2": ("down_proj", 0, 1),
}
EXPERTS = "experts"  # the LoRA target that names the experts' tensors
# a checkpoint key of an expert adapter: (experts module, transformers parameter, factor)
EXPERT_ADAPTER_KEY = re.compile(r"^(.+)\.lora_(\w+)\.(lora_a|lora_b)$")


def adapter_name(parameter: str) -> str:
    """The adapter module of a transformers expert parameter: `lora_gate_up_proj`."""
    return f"lora_{parameter}"


def expert_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """s B A per expert [E, rows, cols]: an expert adapter's change of its tensor."""
    return torch.bmm(lora_b, lora_a) * scale


def adapted_by(name: str) -> tuple[str, str]:
    """(experts module, transformers parameter) whose adapter updates grouped tensor `name`
    (`layers.1.feed_forward.experts.w3` -> gate_up_proj's; transformers' own by name)."""
    module, _, local = name.rpartition(".")
    return module, NATIVE_PARTS[local][0] if local in NATIVE_PARTS else local


def part_of(name: str) -> tuple[int, int]:
    """(part, of how many) of its adapter's rows grouped tensor `name` is: a native w1 / w3
    the first / second half of gate_up_proj's; any other (0, 1), the whole."""
    _, part, parts = NATIVE_PARTS.get(name.rsplit(".", 1)[-1], (None, 0, 1))
    return part, parts


def updated_part(name: str, delta: torch.Tensor) -> torch.Tensor:
    """The rows of an adapter's update (`expert_delta`) that update grouped tensor `name`
    (`part_of`)."""
    part, parts = part_of(name)
    return delta.chunk(parts, dim=1)[part]


def expert_option_problems(dropout: float, use_dora: bool) -> dict[str, str]:
    """The `peft:` keys whose value LoRA on experts does not do -> why, and the fix (PEFT's
    `ParamWrapper` refuses dropout and DoRA too)."""
    leave_out = "or leave `experts` (and all-linear) out of peft.target_modules"
    found = {}
    if dropout > 0:
        found["dropout"] = (
            "LoRA on MoE experts adapts the grouped expert tensors themselves (PEFT's "
            "target_parameters), which drops no input, and PEFT refuses lora_dropout on "
            f"them too; set peft.dropout=0, {leave_out}."
        )
    if use_dora:
        found["use_dora"] = (
            "DoRA rescales each row of a Linear weight, and PEFT defines no DoRA for the "
            "grouped expert tensors of an MoE block (its target_parameters refuse it), nor "
            f"does freetx; use LoRA on the experts (peft.use_dora=false), {leave_out}."
        )
    return found


def refuse_expert_options(dropout: float, use_dora: bool) -> None:
    """What LoRA on experts does not do (`expert_option_problems`), refused by name before
    any work."""
    values = {"dropout": dropout, "use_dora": use_dora}
    problems = expert_option_problems(dropout, use_dora)
    if problems:
        raise ConfigError([f"'peft.{k}' is {values[k]!r}: {why}" for k, why in problems.items()])


class ExpertLoRA(nn.Module):
    """One grouped tensor's adapters: A [E, r, cols], B [E, rows, r] (rows, cols as the
    tensor is stored). The factor on the input side starts Kaiming-uniform (as nn.Linear's
    weight), the other at zero, as LoRA's A and B; `transposed`: the tensor is stored
    [E, in, out] (GPT-OSS), so B is the input side."""

    own_parameters = EXPERT_ADAPTER_PARAMETERS  # SelfInitialized: never in a base file

    def __init__(
        self, experts: int, rows: int, cols: int, rank: int, alpha: float, transposed: bool
    ) -> None:
        super().__init__()
        self.rank, self.alpha, self.scale, self.transposed = rank, alpha, alpha / rank, transposed
        self.lora_a = nn.Parameter(torch.empty(experts, rank, cols))
        self.lora_b = nn.Parameter(torch.empty(experts, rows, rank))

    def delta(self) -> torch.Tensor:
        """s B A [E, rows, cols]."""
        return expert_delta(self.lora_a, self.lora_b, self.scale)

    def grouped(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """s B A x for rows of `x` [N, cols] sorted by expert: [N, rows], through the rank
        (two grouped matmuls, no [E, rows, cols] update)."""
        lora_a, lora_b = local_rows(self.lora_a), local_rows(self.lora_b)  # ep: this rank's
        return grouped_linear(grouped_linear(x, lora_a, counts), lora_b, counts) * self.scale

    def reset_parameter(self, name: str, tensor: torch.Tensor, generator) -> None:
        """Fill `lora_a` or `lora_b` (its full tensor)."""
        if name not in self.own_parameters:
            raise KeyError(name)
        input_side = "lora_b" if self.transposed else "lora_a"
        if name == input_side:  # Kaiming-uniform with a = sqrt(5), fan-in = the input size
            fan_in = self.lora_b.shape[1] if self.transposed else self.lora_a.shape[2]
            bound = 1.0 / math.sqrt(fan_in)
            tensor.uniform_(-bound, bound, generator=generator)
        else:
            tensor.zero_()

    def extra_repr(self) -> str:
        return f"LoRA per expert rank={self.rank}, alpha={self.alpha}"


class LoRAGroupedExperts(GroupedExperts):
    """`GroupedExperts` with frozen w1, w3, w2 and trainable adapters per expert: one for
    gate_up_proj (w1 and w3 joined along the rows, as transformers holds them) and one for
    down_proj (w2). The base keeps its names, so it loads from the same files; it is read
    through `base_output` and `base_weight` (QLoRA's subclass keeps it in NF4)."""

    frozen_in_compute_dtype = True  # FrozenInComputeDtype: no fp32 master of the base
    adapter_enabled = True  # False: the base alone (`freetx.models.peft.adapters_disabled`)

    def __init__(self, experts: GroupedExperts, rank: int, alpha: float) -> None:
        num_experts, ffn, hidden = experts.w1.shape
        super().__init__(num_experts, hidden, ffn)
        self.lora_gate_up_proj = ExpertLoRA(num_experts, 2 * ffn, hidden, rank, alpha, False)
        self.lora_down_proj = ExpertLoRA(num_experts, hidden, ffn, rank, alpha, False)
        for param in (self.w1, self.w3, self.w2):
            param.requires_grad_(False)

    def base_output(self, x: torch.Tensor, name: str, counts: list[int]) -> torch.Tensor:
        """The base tensor `name` (w1, w3, w2) applied to the rows of `x` sorted by expert
        (under expert parallelism this rank's experts: the DTensor's local rows)."""
        return grouped_linear(x, local_rows(self.get_parameter(name)), counts)

    def base_weight(self, name: str) -> torch.Tensor:
        """The base tensor `name` dense, [E, rows, cols]."""
        return self.get_parameter(name)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        gate, up = self.base_output(x, "w1", counts), self.base_output(x, "w3", counts)
        if self.adapter_enabled:
            update = self.lora_gate_up_proj.grouped(x, counts).to(gate.dtype)
            gate, up = gate + update[:, : gate.shape[1]], up + update[:, gate.shape[1] :]
        hidden = F.silu(gate) * up
        out = self.base_output(hidden, "w2", counts)
        if self.adapter_enabled:
            out = out + self.lora_down_proj.grouped(hidden, counts).to(out.dtype)
        return out

    def adapters(self) -> dict[str, ExpertLoRA]:
        return {"gate_up_proj": self.lora_gate_up_proj, "down_proj": self.lora_down_proj}

    @torch.no_grad()
    def merged(self) -> dict[str, torch.Tensor]:
        """w1, w3, w2 with their updates added (fp32)."""
        return {
            name: self.base_weight(name).float()
            + updated_part(name, self.adapters()[part].delta()).float()
            for name, (part, _, _) in NATIVE_PARTS.items()
        }


def expert_parameters(module: nn.Module) -> list[str]:
    """The 3-D expert parameters a transformers module holds itself (`EXPERT_PARAMETERS`,
    in registration order); [] for any other module, and for freetx's GroupedExperts."""
    if isinstance(module, GroupedExperts):
        return []
    return [
        name
        for name, param in module.named_parameters(recurse=False)
        if name in EXPERT_PARAMETERS and param.dim() == 3
    ]


class AdaptedHFExperts:
    """Mixed into a transformers experts class (`adapt_experts`): its forward computes
    with each adapted parameter W replaced by W + s B A (the base alone while the adapters
    are disabled), its base frozen and read through `base_weight`."""

    frozen_in_compute_dtype = True  # FrozenInComputeDtype: no fp32 master of the base
    adapter_enabled = True  # False: the base alone (`freetx.models.peft.adapters_disabled`)

    def adapters(self) -> dict[str, ExpertLoRA]:
        """The adapters by the parameter each updates, in the order they were added."""
        return {
            child.removeprefix("lora_"): module
            for child, module in self.named_children()
            if isinstance(module, ExpertLoRA)
        }

    def base_weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The base parameter `name` dense, as stored (`dtype`: what QLoRA dequantizes to)."""
        return self.get_parameter(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _parameters_replaced(self, self._computed()):
            return super().forward(*args, **kwargs)

    def _computed(self) -> dict[str, torch.Tensor]:
        """What each adapted parameter computes as: W + s B A, or W while disabled."""
        found = {}
        for name, adapter in self.adapters().items():
            weight = self.base_weight(name, adapter.lora_a.dtype)
            found[name] = (
                weight + adapter.delta().to(weight.dtype) if self.adapter_enabled else weight
            )
        return found


@contextmanager
def _parameters_replaced(module: nn.Module, values: dict[str, torch.Tensor]) -> Iterator[None]:
    """Within it, `module.<name>` is `values[name]` (a tensor with a gradient to the
    adapters) in place of the parameter; the parameters are back after, also on an error."""
    kept = {name: module._parameters.pop(name) for name in values}
    try:
        for name, value in values.items():
            object.__setattr__(module, name, value)
        yield
    finally:
        for name, param in kept.items():
            object.__delattr__(module, name)
            module._parameters[name] = param


_ADAPTED_CLASSES: dict[tuple[type, type], type] = {}  # (experts class, mixin) -> adapted
_ORIGINAL_CLASSES: dict[type, type] = {}  # and back


def adapted_class(cls: type, mixin: type = AdaptedHFExperts, prefix: str = "LoRA") -> type:
    """`cls` with `mixin` (`AdaptedHFExperts` or a subclass) mixed in, named `prefix` +
    its name (one class per experts class and mixin)."""
    if (cls, mixin) not in _ADAPTED_CLASSES:
        adapted = type(f"{prefix}{cls.__name__}", (mixin, cls), {})
        _ADAPTED_CLASSES[cls, mixin], _ORIGINAL_CLASSES[adapted] = adapted, cls
    return _ADAPTED_CLASSES[cls, mixin]


def original_class(adapted: type) -> type:
    """The transformers experts class an adapted one (`adapted_class`) was made from."""
    return _ORIGINAL_CLASSES[adapted]


def expert_modules(model: nn.Module) -> list[str]:
    """The names of the modules holding a block's experts as grouped tensors: freetx's
    `GroupedExperts`, and transformers' experts modules (`expert_parameters`)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, GroupedExperts) or expert_parameters(module)
    ]


def expert_tensors(model: nn.Module) -> list[str]:
    """Every grouped expert tensor of `model` by name (`layers.1.feed_forward.experts.w1`,
    `model.layers.1.mlp.experts.gate_up_proj`), for messages."""
    found = []
    for name in expert_modules(model):
        module = model.get_submodule(name)
        params = (
            ["w1", "w3", "w2"] if isinstance(module, GroupedExperts) else expert_parameters(module)
        )
        found += [f"{name}.{p}" for p in params]
    return found


def adapt_experts(model: nn.Module, names: list[str], rank: int, alpha: float) -> None:
    """Give each experts module of `names` (`expert_modules`) its adapters, in place, on the
    meta device: a GroupedExperts becomes a `LoRAGroupedExperts`; a transformers experts
    module an instance of its class with `AdaptedHFExperts` mixed in."""
    for name in names:
        module = model.get_submodule(name)
        if isinstance(module, GroupedExperts):
            _check_rank(name, rank, module.w2.shape[1:])
            with torch.device(module.w1.device):
                adapted = LoRAGroupedExperts(module, rank, alpha)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, adapted)
            continue
        transposed = bool(getattr(module, "is_transposed", False))  # transformers' flag
        for param in expert_parameters(module):
            weight = module.get_parameter(param)
            experts, rows, cols = weight.shape
            _check_rank(f"{name}.{param}", rank, (rows, cols))
            with torch.device(weight.device):
                adapter = ExpertLoRA(experts, rows, cols, rank, alpha, transposed)
            module.add_module(adapter_name(param), adapter)
            weight.requires_grad_(False)
        module.__class__ = adapted_class(type(module))


def _check_rank(name: str, rank: int, shape: tuple[int, ...]) -> None:
    if not 0 < rank <= min(shape):
        raise ConfigError(
            f"peft.rank={rank} does not fit the experts of {name} ({list(shape)} each): a LoRA "
            f"rank is at least 1 and at most the smaller side, {min(shape)}."
        )


def expert_adapter_layers(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules of `model` that carry adapters, by name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, (LoRAGroupedExperts, AdaptedHFExperts))
    }


@torch.no_grad()
def merge_expert_adapters(model: nn.Module) -> None:
    """Add every expert adapter's update to its tensor and drop the adapters (in place): a
    LoRAGroupedExperts becomes a GroupedExperts, a transformers experts module its class."""
    for name, module in expert_adapter_layers(model).items():
        if isinstance(module, LoRAGroupedExperts):
            merged = module.merged()
            num_experts, ffn, hidden = merged["w1"].shape
            with torch.device(merged["w1"].device):
                plain = GroupedExperts(num_experts, hidden, ffn)
            for param, value in merged.items():
                getattr(plain, param).data = value.to(module.base_weight(param).dtype)
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, plain)
            continue
        for param, adapter in module.adapters().items():
            weight = module.base_weight(param, adapter.lora_a.dtype)
            merged = (weight.float() + adapter.delta().float()).to(weight.dtype)
            setattr(module, param, nn.Parameter(merged, requires_grad=False))
            delattr(module, adapter_name(param))
        module.__class__ = original_class(type(module))
