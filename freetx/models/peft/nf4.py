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

Adapted MoE experts (`freetx.models.peft.experts`) are refused: torchao's NF4 tensor is
2-D only (`to_nf4` asserts dim <= 2) and an expert base is one 3-D grouped tensor.
"""

from __future__ import annotations

import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.models.peft.experts import expert_adapter_layers, refuse_expert_options
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
        from torchao.quantization import to_nf4

        dropout = layer.lora_dropout.p if isinstance(layer.lora_dropout, nn.Dropout) else 0.0
        with torch.device("meta"):
            quantized = cls(
                layer.in_features, layer.out_features, layer.bias is not None, layer.rank,
                layer.alpha, dropout, layer.use_dora, nf4_blocks=nf4_blocks,
            )  # fmt: skip
        empty = torch.empty(layer.weight.shape, dtype=NF4_DTYPE, device="meta")
        quantized.weight = nn.Parameter(to_nf4(empty, *nf4_blocks), requires_grad=False)
        return quantized

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

    @torch.no_grad()
    def stored_value(
        self, name: str, full: torch.Tensor, shard: tuple[int, int] | None
    ) -> torch.Tensor:
        """Quantize the full base weight once; keep all of it, or chunk `index` of
        `count` (rows) when the weight is sharded."""
        from torchao.quantization import to_nf4

        if not self.stores_parameter(name):
            raise KeyError(name)
        dense = full.to(dtype=NF4_DTYPE).contiguous().clone()  # storage offset 0
        quantized = to_nf4(dense, *self.nf4_blocks)
        if shard is not None:
            index, count = shard
            quantized = torch.chunk(quantized, count, dim=0)[index]
        return quantized


def quantize_bases(model: nn.Module, world_size: int = 1) -> None:
    """Swap every LoRA layer of a meta model for an `NF4LoRALinear` (its base an empty NF4
    tensor), before the model is parallelized over `world_size` ranks. Adapted experts
    are refused (the module's docstring)."""
    if expert_adapter_layers(model):
        refuse_expert_options(0.0, False, "nf4")
    for name, layer in list(model.named_modules()):
        if not isinstance(layer, LoRALinear):
            continue
        if layer.weight.device.type != "meta":
            raise ConfigError("QLoRA quantizes the base on the meta device, before parallelize.")
        blocks = block_sizes(tuple(layer.weight.shape), world_size, name)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child,
                NF4LoRALinear.from_lora(layer, blocks))  # fmt: skip
