"""QLoRA: the frozen base weights of LoRA layers stored as torchao NF4 tensors.

NF4 (Dettmers et al., 2023) keeps 4 bits per weight in blocks of 64 with
double-quantized scales (blocks of `scaler_block_size`, 256 by default):
about 0.26x the bytes of bf16. The forward dequantizes to the input's dtype
(`linear_nf4`, which keeps no dequantized copy for backward); the base gets no
gradient, the adapters train in full precision.

Under FSDP2 an NF4 parameter must exist before `fully_shard` (on the meta
device), with `requires_grad=False`, and every rank's shard must hold whole
scale blocks. Weights are set from a full tensor: quantized whole once (so
every rank shares the same scales), then each rank keeps its chunk of rows as
a DTensor. torchao's NF4 shards on a 1-D mesh (fsdp, zero2) and works under
DDP; an HSDP mesh is refused. At world size 1 the model is not sharded.
"""

from __future__ import annotations

import torch
from torch import nn

from freetx.errors import ConfigError
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


def quantize_bases(model: nn.Module, world_size: int = 1) -> None:
    """Turn the base weight of every LoRA layer of a meta model into an (empty) NF4 tensor,
    before the model is parallelized; its values come from `set_full_weight`."""
    from torchao.quantization import to_nf4

    for name, layer in model.named_modules():
        if not isinstance(layer, LoRALinear):
            continue
        if layer.weight.device.type != "meta":
            raise ConfigError("QLoRA quantizes the base on the meta device, before parallelize.")
        block, scaler = block_sizes(tuple(layer.weight.shape), world_size, name)
        empty = torch.empty(layer.weight.shape, dtype=NF4_DTYPE, device="meta")
        layer.weight = nn.Parameter(to_nf4(empty, block, scaler), requires_grad=False)
        layer.nf4_blocks = (block, scaler)


def is_nf4(tensor: torch.Tensor) -> bool:
    local = getattr(tensor, "_local_tensor", tensor)
    return type(local).__name__ == "NF4Tensor"


@torch.no_grad()
def set_full_weight(layer: LoRALinear, full: torch.Tensor) -> None:
    """Quantize the full base weight once and keep this rank's rows of it (as the DTensor
    FSDP2 made, or whole when the model is not sharded)."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torchao.quantization import to_nf4

    param = layer.weight
    device = getattr(param, "_local_tensor", param).device
    if device.type == "meta":
        device = torch.device("cpu")
    dense = full.to(device=device, dtype=NF4_DTYPE).contiguous().clone()  # storage offset 0
    quantized = to_nf4(dense, *layer.nf4_blocks)
    if isinstance(param, DTensor):
        mesh = param.device_mesh
        if mesh.ndim != 1:
            raise ConfigError(
                "QLoRA's NF4 weights shard on a 1-D mesh only (fsdp, zero2); this run uses a "
                f"{mesh.ndim}-D mesh (hsdp). Use distributed.strategy=fsdp."
            )
        chunk = torch.chunk(quantized, mesh.size(), dim=0)[mesh.get_local_rank()]
        spec = DTensorSpec(
            mesh, param.placements, TensorMeta(param.size(), param.stride(), param.dtype)
        )
        quantized = DTensor(local_tensor=chunk, spec=spec, requires_grad=False)
    layer.weight = nn.Parameter(quantized, requires_grad=False)


def nf4_bytes(model: nn.Module) -> int:
    """Bytes the NF4 base weights hold (their quantized data and scales, local shards)."""
    total = 0
    for param in model.parameters():
        local = getattr(param, "_local_tensor", param)
        if is_nf4(local):
            names, _ = local.__tensor_flatten__()
            total += sum(
                getattr(local, n).numel() * getattr(local, n).element_size() for n in names
            )
    return total
