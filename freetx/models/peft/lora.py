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
`lora_b.weight` and (DoRA) `lora_magnitude` under the same module
(`ADAPTER_PARAMETERS`, with PEFT's names for them). A subclass may keep the base
in another form (QLoRA: `freetx.models.peft.nf4.NF4LoRALinear`) by overriding
`dense` and `base_output`.

`merge_weight` is the one merge of W with its adapter (W + s B A; DoRA: each row
rescaled to m): training's `merged_weight`, `merge_adapters` and the checkpoint
package's streaming merge all use it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from freetx.errors import ConfigError

# freetx's adapter parameters (under the adapted module) -> PEFT's names for them
PEFT_NAMES = {
    "lora_a.weight": "lora_A.weight",
    "lora_b.weight": "lora_B.weight",
    "lora_magnitude": "lora_magnitude_vector",
}
ADAPTER_PARAMETERS = tuple(PEFT_NAMES)


def lora_delta(lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float) -> torch.Tensor:
    """s B A [out, in]: an adapter's change of W."""
    return (lora_b @ lora_a) * scale


def merge_weight(
    weight: torch.Tensor, delta: torch.Tensor, magnitude: torch.Tensor | None = None
) -> torch.Tensor:
    """W + s B A (`delta`) in fp32: the dense weight that computes what W and its adapter
    do; with DoRA's `magnitude` m, each row rescaled to m (m / ||W + s B A||_row)."""
    merged = weight.float() + delta.float()
    if magnitude is not None:
        merged = merged * (magnitude.float() / merged.norm(dim=1))[:, None]
    return merged


def check_dora_slices(use_dora: bool) -> None:
    """DoRA is refused with tensor parallelism: its norm is over whole rows, which a
    rowwise slice splits (when the adapters are sliced, and `freetx.training.check_layout`
    before anything is launched)."""
    if use_dora:
        raise ConfigError(
            "distributed.tp: DoRA's magnitudes divide by the norm of each whole weight "
            "row, and tensor parallelism slices the rows of some layers; freetx does not "
            "compute that norm over the tp ranks yet.",
            fix="Use LoRA (peft.use_dora=false) with tp, or set distributed.tp=1.",
        )


class LoRALinear(nn.Linear):
    """`nn.Linear` with a frozen base and a trainable LoRA (or DoRA) update."""

    # the hooks of freetx.models.protocol: SelfInitialized, DerivedFromWeights,
    # FrozenInComputeDtype
    own_parameters = ADAPTER_PARAMETERS  # initialized here (reset_parameter), never loaded
    frozen_in_compute_dtype = True  # the frozen base needs no fp32 master copy
    # False: forward computes the base alone, W x + b (a preference loss's reference:
    # `freetx.models.peft.adapters_disabled`)
    adapter_enabled = True

    @classmethod
    def on_meta_like(cls, layer: LoRALinear, **more: object):
        """An empty layer of this class on the meta device with `layer`'s shape and adapter
        settings (rank, alpha, dropout, DoRA), `more` its own: a LoRA layer swapped for a
        kind that stores or computes its base its own way (NF4, QAT)."""
        dropout = layer.lora_dropout.p if isinstance(layer.lora_dropout, nn.Dropout) else 0.0
        with torch.device("meta"):
            return cls(
                layer.in_features, layer.out_features, layer.bias is not None, layer.rank,
                layer.alpha, dropout, layer.use_dora, **more,
            )  # fmt: skip

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

    def tensor_parallel_dims(self, role: str) -> dict[str, int | None]:
        """`SlicesWithLinear`: a colwise base's rows are sliced, and so are B's (A is whole:
        each rank's B A covers its rows); a rowwise base's columns, and A's (each rank's B A
        x is a part of the sum tensor parallelism adds up)."""
        check_dora_slices(self.use_dora)
        if role == "colwise":
            return {"weight": 0, "bias": 0, "lora_a.weight": None, "lora_b.weight": 0}
        if role.startswith("rowwise"):  # its output summed (and scattered by sequence)
            return {"weight": 1, "bias": None, "lora_a.weight": 1, "lora_b.weight": None}
        raise ConfigError(
            f"distributed.tp: freetx slices LoRA adapters on attention and MLP projections, not "
            f"on a {role} layer (the embedding or the head).",
            fix="Leave the embedding and head out of peft.target_modules, or set distributed.tp=1.",
        )

    def dense(self, weight: torch.Tensor) -> torch.Tensor:
        """The base weight (the whole one, or a local shard of it) as a dense tensor."""
        return weight

    def base_weight(self) -> torch.Tensor:
        """W as a dense tensor."""
        return self.dense(self.weight)

    def base_output(self, x: torch.Tensor) -> torch.Tensor:
        """W x without the bias."""
        return F.linear(x, self.base_weight().to(x.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.adapter_enabled:
            out = self.base_output(x)
            return out if self.bias is None else out + self.bias.to(out.dtype)
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
        return lora_delta(self.lora_a.weight, self.lora_b.weight, self.scale)

    def direction_norm(self) -> torch.Tensor:
        """||W + s B A|| per output row [out] (DoRA)."""
        weight = self.base_weight()
        return merge_weight(weight, self.delta()).norm(dim=1).to(weight.dtype)

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """The dense weight that computes the same function without an adapter."""
        return merge_weight(self.base_weight(), self.delta(), self.lora_magnitude)

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
    def init_from_weights(self, local: dict[str, torch.Tensor]) -> None:
        """DoRA: m = the row norms of W (+ s B A, zero for a fresh adapter), once W is set.
        `local`: this module's parameters' local shards; W and m are sharded by rows
        alike, so each rank sets its own rows."""
        if not self.use_dora:
            return
        magnitude = local["lora_magnitude"]
        magnitude.copy_(self.dense(local["weight"]).float().norm(dim=1).to(magnitude.dtype))

    def extra_repr(self) -> str:
        kind = "DoRA" if self.use_dora else "LoRA"
        return f"{super().extra_repr()}, {kind} rank={self.rank}, alpha={self.alpha}"
