"""QLoRA: the frozen base weights of LoRA layers stored as torchao NF4 tensors.

NF4 (Dettmers et al., 2023) keeps 4 bits per weight in blocks of 64 with
double-quantized scales (blocks of `scaler_block_size`, 256 by default):
about 0.26x the bytes of bf16. The forward dequantizes to the input's dtype
(`linear_nf4`, which keeps no dequantized copy for backward); the base gets no
gradient, the adapters train in full precision.

`quantize_bases` swaps every `LoRALinear` of a meta model for an `NF4LoRALinear`
(the same layer with its base in NF4) before the model is parallelized. Under
FSDP2 an NF4 parameter must exist before `fully_shard` (on the meta device),
with `requires_grad=False`, and every rank's shard must hold whole scale
blocks. The layer keeps its base in its own form (`StoredInOwnForm` of
`freetx.models.protocol`): set from a full tensor, quantized whole once (so
every rank shares the same scales), of which each rank keeps its chunk of rows
(`freetx.distributed.parameters` makes it the DTensor FSDP2 expects). torchao's NF4
shards on a 1-D mesh and works replicated; a 2-D mesh is refused. At world
size 1 the model is not sharded.

Adapted MoE experts (`freetx.models.peft.experts`) get NF4 bases too (`quantize_experts`).
torchao's NF4 tensor is 2-D only (`to_nf4` and FSDP2's all-gather of it), so each adapted
grouped tensor [E, rows, cols] (a native w1 / w3 / w2, transformers' gate_up_proj /
down_proj, GPT-OSS's stored [E, in, out]) is kept as one NF4 tensor [E * rows, cols]: its
rows are the experts' rows one expert after the other, FSDP2 shards them by rows like a
Linear's (whole experts where the ranks divide E), and `block_sizes` makes every rank's
share whole blocks (else refused, naming the tensor). Set from the file's [E, rows, cols]
(`NF4Experts.stored_value`: reshaped, quantized whole once). Each forward dequantizes the
whole grouped tensor to the compute dtype, E * rows * cols elements at a time (2 bytes each
in bf16; a 30B-A3B block's w1, 128 x 768 x 2048: 0.4 GB): the native experts
(`NF4LoRAGroupedExperts`) feed `grouped_linear` through `NF4GroupedLinear`, which keeps
no dense copy for backward (it dequantizes again there, as `linear_nf4` does); transformers'
experts compute with the dense W + s B A in place of W (`NF4HFExperts`), which autograd
keeps until backward, as their LoRA with a bf16 base does (activation checkpointing frees
it).
"""

from __future__ import annotations

import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.models.moe import grouped_linear
from freetx.models.peft.experts import (
    NATIVE_PARTS,
    AdaptedHFExperts,
    LoRAGroupedExperts,
    adapted_class,
    expert_adapter_layers,
    original_class,
)
from freetx.models.peft.lora import LoRALinear

BLOCK_SIZE = 64  # weights per absmax block: QLoRA's
SCALER_BLOCKS = (256, 128, 64, 32, 16, 8)  # double-quantization blocks, largest that fits
NF4_DTYPE = torch.bfloat16  # what the base dequantizes to: QLoRA computes in bf16


def block_sizes(shape: tuple[int, int], world_size: int, name: str) -> tuple[int, int]:
    """NF4 (block, scaler block) for a weight whose rows are split over `world_size` ranks:
    every rank's rows must hold whole blocks of both."""
    rows, cols = shape
    if rows % world_size == 0:
        per_rank = rows // world_size * cols
        for scaler in SCALER_BLOCKS:
            if per_rank % (BLOCK_SIZE * scaler) == 0:
                return BLOCK_SIZE, scaler
    raise ConfigError(
        f"QLoRA cannot quantize {name} {list(shape)} for {world_size} rank(s): NF4 needs every "
        f"rank's rows to hold whole blocks of {BLOCK_SIZE} x 8 weights. Use another number of "
        "processes, leave this module out of peft.target_modules, or use LoRA without "
        "peft.quantize_base."
    )


BYTES_PER_WEIGHT = 0.516  # 4 bits, a bf16 absmax per 64 weights, double-quantized


def empty_nf4(shape: tuple[int, int], blocks: tuple[int, int]) -> nn.Parameter:
    """A frozen NF4 parameter of `shape` on the meta device (values come from `quantized`)."""
    from torchao.quantization import to_nf4

    empty = torch.empty(shape, dtype=NF4_DTYPE, device="meta")
    return nn.Parameter(to_nf4(empty, *blocks), requires_grad=False)


@torch.no_grad()
def quantized(
    full: torch.Tensor, blocks: tuple[int, int], shard: tuple[int, int] | None
) -> torch.Tensor:
    """A full 2-D weight as NF4 in `blocks`, quantized whole once (so every rank shares the
    same scales): all of it, or chunk `index` of `count` (rows) when sharded (`shard`)."""
    from torchao.quantization import to_nf4

    dense = full.to(dtype=NF4_DTYPE).contiguous().clone()  # storage offset 0
    result = to_nf4(dense, *blocks)
    if shard is not None:
        index, count = shard
        result = torch.chunk(result, count, dim=0)[index]
    return result


class NF4LoRALinear(LoRALinear):
    """`LoRALinear` whose frozen base weight is an NF4 tensor (QLoRA)."""

    def __init__(self, *args, nf4_blocks: tuple[int, int], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.nf4_blocks = nf4_blocks  # (block, scaler block) of the quantization

    def tensor_parallel_dims(self, role: str) -> dict[str, int | None]:
        raise ConfigError(
            "distributed.tp: a QLoRA base is an NF4 tensor quantized in blocks of whole rows, "
            "and freetx does not slice it over tensor-parallel ranks.",
            fix="Use LoRA (peft.quantize_base=null: its bf16 base slices) with tp, or set "
            "distributed.tp=1 (fsdp shards NF4 bases).",
        )

    @classmethod
    def from_lora(cls, layer: LoRALinear, nf4_blocks: tuple[int, int]) -> NF4LoRALinear:
        """The same (meta) layer with an empty NF4 base; values come from `stored_value`."""
        layer_nf4 = cls.on_meta_like(layer, nf4_blocks=nf4_blocks)
        layer_nf4.weight = empty_nf4(tuple(layer.weight.shape), nf4_blocks)
        return layer_nf4

    def dense(self, weight: torch.Tensor) -> torch.Tensor:
        """The NF4 base (whole, or a local shard) dequantized."""
        return weight.get_original_weight()

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """W x, dequantized on the fly: no dequantized copy is kept for backward."""
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return linear_nf4(x, self.weight)

    # -- StoredInOwnForm (freetx.models.protocol) ---------------------------------
    def stores_parameter(self, name: str) -> bool:
        """The base weight is kept quantized."""
        return name == "weight"

    def stored_element_bytes(self, name: str) -> float:
        return BYTES_PER_WEIGHT

    def stored_value(
        self, name: str, full: torch.Tensor, shard: tuple[int, int] | None
    ) -> torch.Tensor:
        """The full base weight quantized once (`quantized`): all of it, or this rank's
        rows."""
        if not self.stores_parameter(name):
            raise KeyError(name)
        return quantized(full, self.nf4_blocks, shard)


class NF4Experts:
    """The NF4 bases of an adapted experts module (`quantize_experts`): each adapted grouped
    tensor [E, rows, cols] (`nf4_shapes`) kept as one NF4 tensor [E * rows, cols] in its
    blocks (`nf4_blocks`). `StoredInOwnForm` (`freetx.models.protocol`)."""

    nf4_shapes: dict[str, tuple[int, int, int]]  # by parameter: its grouped shape
    nf4_blocks: dict[str, tuple[int, int]]  # by parameter: (block, scaler block)

    def dequantized(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The NF4 base `name` (whole: FSDP2 has gathered it) dense, [E, rows, cols]."""
        return dense_experts(self.get_parameter(name), self.nf4_shapes[name], dtype)

    def stores_parameter(self, name: str) -> bool:
        return name in self.nf4_shapes

    def stored_element_bytes(self, name: str) -> float:
        return BYTES_PER_WEIGHT

    def stored_value(
        self, name: str, full: torch.Tensor, shard: tuple[int, int] | None
    ) -> torch.Tensor:
        """The full grouped tensor (as the file holds it, [E, rows, cols]) as its NF4
        [E * rows, cols], quantized once (`quantized`): all of it, or this rank's rows."""
        if not self.stores_parameter(name):
            raise KeyError(name)
        experts, rows, cols = self.nf4_shapes[name]
        return quantized(full.reshape(experts * rows, cols), self.nf4_blocks[name], shard)


def dense_experts(
    weight: torch.Tensor, shape: tuple[int, int, int], dtype: torch.dtype
) -> torch.Tensor:
    """An NF4 grouped tensor [E * rows, cols] dequantized to `dtype`, [E, rows, cols]."""
    return weight.get_original_weight().to(dtype).view(shape)


class NF4GroupedLinear(torch.autograd.Function):
    """`grouped_linear` of rows sorted by expert with an NF4 grouped weight: dequantized
    for the forward and again for the backward, so no dense copy lives between them (as
    torchao's `linear_nf4`); the weight gets no gradient."""

    @staticmethod
    def forward(ctx, x, weight, shape, counts):
        ctx.save_for_backward(weight)  # the NF4 parameter itself, as linear_nf4 saves it
        ctx.shape, ctx.counts = shape, counts
        return grouped_linear(x, dense_experts(weight, shape, x.dtype), counts)

    @staticmethod
    def backward(ctx, grad):
        dense = dense_experts(ctx.saved_tensors[0], ctx.shape, grad.dtype)
        return grouped_linear(grad, dense.transpose(1, 2), ctx.counts), None, None, None


class NF4LoRAGroupedExperts(NF4Experts, LoRAGroupedExperts):
    """`LoRAGroupedExperts` whose w1, w3 and w2 are NF4 (QLoRA on native experts)."""

    def base_output(self, x: torch.Tensor, name: str, counts: list[int]) -> torch.Tensor:
        return NF4GroupedLinear.apply(x, self.get_parameter(name), self.nf4_shapes[name], counts)

    def base_weight(self, name: str) -> torch.Tensor:
        return self.dequantized(name, NF4_DTYPE)


class NF4HFExperts(NF4Experts, AdaptedHFExperts):
    """Mixed into a transformers experts class: `AdaptedHFExperts` with its adapted
    parameters NF4, dequantized to the adapters' dtype (the compute dtype) per forward."""

    def base_weight(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        return self.dequantized(name, dtype)


def quantize_experts(module: nn.Module, name: str, world_size: int) -> None:
    """Give the adapted experts module `name` NF4 bases (empty, on the meta device), in
    place: a `LoRAGroupedExperts` becomes an `NF4LoRAGroupedExperts`, an adapted
    transformers experts module an instance of its class with `NF4HFExperts` mixed in. A
    tensor whose rows do not split into whole blocks over `world_size` ranks is refused
    (`block_sizes`)."""
    if isinstance(module, LoRAGroupedExperts):
        params, cls = list(NATIVE_PARTS), NF4LoRAGroupedExperts
    else:
        params = list(module.adapters())
        cls = adapted_class(original_class(type(module)), NF4HFExperts, prefix="NF4LoRA")
    shapes = {param: tuple(module.get_parameter(param).shape) for param in params}
    blocks = {
        param: block_sizes(
            (experts * rows, cols),
            world_size,
            f"{name}.{param} (its {experts} experts' rows one after the other)",
        )
        for param, (experts, rows, cols) in shapes.items()
    }
    module.__class__ = cls
    module.nf4_shapes, module.nf4_blocks = shapes, blocks
    for param, (experts, rows, cols) in shapes.items():
        setattr(module, param, empty_nf4((experts * rows, cols), blocks[param]))


def quantize_bases(model: nn.Module, world_size: int = 1) -> None:
    """Swap every LoRA layer of a meta model for an `NF4LoRALinear` (its base an empty NF4
    tensor) and give every adapted experts module NF4 bases (`quantize_experts`), before
    the model is parallelized over `world_size` ranks."""
    experts = expert_adapter_layers(model)
    for name, layer in list(model.named_modules()):
        if not (isinstance(layer, LoRALinear) or name in experts):
            continue
        if any(p.device.type != "meta" for p in layer.parameters(recurse=False)):
            raise ConfigError("QLoRA quantizes the base on the meta device, before parallelize.")
        if name in experts:
            quantize_experts(layer, name, world_size)
            continue
        blocks = block_sizes(tuple(layer.weight.shape), world_size, name)
        parent, _, child = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        setattr(owner, child, NF4LoRALinear.from_lora(layer, blocks))
