"""LoRA and DoRA: a frozen Linear plus a trainable low-rank update, applied to a meta model.

    LoRA  y = W x + b + s * B A dropout(x),                     s = alpha / rank
    DoRA  y = m / ||W + s B A||_row * (W x + s B A dropout(x)) + b

A [rank, in] starts Kaiming-uniform, B [out, rank] at zero, so a fresh adapter
leaves the model's output unchanged; DoRA's magnitude m [out] starts at the row
norms of W (set once W is known: `init_from_weights`). The norm in DoRA's
forward is detached, as in the DoRA paper (section 4.3) and PEFT, so the
gradient flows through m and the direction only.

`LoRALinear` subclasses `nn.Linear` and keeps its `weight` and `bias`, so the
base weights keep their names (`layers.0.attention.wq.weight`) and load from
the same files as the plain model; the adapter adds `lora_a.weight`,
`lora_b.weight` and (DoRA) `lora_magnitude` under the same module. The base
may also be an NF4 tensor (QLoRA, `freetx.models.peft.nf4`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ADAPTER_PARAMETERS = ("lora_a.weight", "lora_b.weight", "lora_magnitude")


class LoRALinear(nn.Linear):
    """`nn.Linear` with a frozen base and a trainable LoRA (or DoRA) update."""

    own_parameters = ADAPTER_PARAMETERS  # initialized here (reset_parameter), never loaded
    frozen_in_compute_dtype = True  # the frozen base needs no fp32 master copy

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        rank: int,
        alpha: float,
        dropout: float = 0.0,
        use_dora: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.rank, self.alpha, self.scale = rank, alpha, alpha / rank
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_magnitude = nn.Parameter(torch.ones(out_features)) if use_dora else None
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @property
    def use_dora(self) -> bool:
        return self.lora_magnitude is not None

    def base_weight(self) -> torch.Tensor:
        """W as a dense tensor (an NF4 base is dequantized)."""
        weight = self.weight
        dequantize = getattr(weight, "get_original_weight", None)
        return dequantize() if dequantize is not None else weight

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """W x without the bias (an NF4 base is dequantized on the fly, and no dequantized
        copy is kept for backward)."""
        if type(self.weight).__name__ == "NF4Tensor":
            from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

            return linear_nf4(x, self.weight)
        return F.linear(x, self.base_weight().to(x.dtype))

    def stores_parameter(self, name: str) -> bool:
        """Whether this module stores parameter `name` its own way (an NF4 base)."""
        return name == "weight" and hasattr(self, "nf4_blocks")

    def set_full_parameter(self, name: str, full: torch.Tensor) -> bool:
        """Set parameter `name` from its full value when this module stores it its own way
        (an NF4 base: quantized whole, then each rank keeps its rows); else False."""
        if not self.stores_parameter(name):
            return False
        from freetx.models.peft.nf4 import set_full_weight

        set_full_weight(self, full)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        update = self.lora_b(self.lora_a(self.lora_dropout(x))) * self.scale
        out = self.base_output(x)
        if self.use_dora:
            norm = self.direction_norm().detach()
            out = (out + update) * (self.lora_magnitude / norm).to(out.dtype)
        else:
            out = out + update
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def delta(self) -> torch.Tensor:
        """s B A [out, in]: the adapter's change of W."""
        return (self.lora_b.weight @ self.lora_a.weight) * self.scale

    def direction_norm(self) -> torch.Tensor:
        """||W + s B A|| per output row [out] (DoRA)."""
        weight = self.base_weight()
        return (weight.float() + self.delta().float()).norm(dim=1).to(weight.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The dense weight that computes the same function without an adapter."""
        weight = self.base_weight().float() + self.delta().float()
        if self.use_dora:
            weight = weight * (self.lora_magnitude.float() / weight.norm(dim=1))[:, None]
        return weight

    # -- initialization: a fresh adapter changes nothing ---------------------
    def reset_parameter(self, name: str, tensor: torch.Tensor, generator) -> None:
        """Fill one of the adapter's parameters (its full tensor); the base's are the
        model's to initialize, or a file's to provide."""
        if name == "lora_a.weight":  # Kaiming-uniform with a = sqrt(5), as nn.Linear
            bound = 1.0 / math.sqrt(self.in_features)
            tensor.uniform_(-bound, bound, generator=generator)
        elif name == "lora_b.weight":
            tensor.zero_()
        elif name == "lora_magnitude":
            tensor.fill_(1.0)  # the real value needs W: init_from_weights
        else:
            raise KeyError(name)

    @torch.no_grad()
    def init_from_weights(self) -> None:
        """DoRA: m = the row norms of W (+ s B A, zero for a fresh adapter), once W is set.
        Under FSDP2 W and m are sharded by rows alike, so each rank sets its own rows."""
        if not self.use_dora:
            return
        local = getattr(self.lora_magnitude, "to_local", lambda: self.lora_magnitude)()
        weight = self.weight
        weight = getattr(weight, "to_local", lambda: weight)()
        dequantize = getattr(weight, "get_original_weight", None)
        dense = dequantize() if dequantize is not None else weight
        local.copy_(dense.float().norm(dim=1).to(local.dtype))

    def extra_repr(self) -> str:
        kind = "DoRA" if self.use_dora else "LoRA"
        return f"{super().extra_repr()}, {kind} rank={self.rank}, alpha={self.alpha}"
