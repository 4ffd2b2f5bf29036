"""Optimizers from the config, with ZeRO-1 and fused AdamW where they apply."""

from __future__ import annotations

import torch
from omegaconf import DictConfig
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from freetx.config.instantiate import COMPONENT, import_component, instantiate, node_path

_FUSABLE = (torch.optim.AdamW, torch.optim.Adam)


def build_optimizer(node: DictConfig, model: nn.Module, strategy: str, device: torch.device):
    """Build `node` over the model's parameters.

    - zero1: the optimizer class runs inside ZeroRedundancyOptimizer, so each
      rank keeps the state of its share of the parameters (DeepSpeed ZeRO-1).
    - On CUDA, torch's Adam/AdamW get `fused=True` unless the config says.
    Any optimizer class works, torchao's low-bit ones included
    (`_component_: torchao.optim.AdamW8bit`).
    """
    target = import_component(node[COMPONENT], f"{node_path(node)}._component_")
    extra = {}
    if device.type == "cuda" and target in _FUSABLE and "fused" not in node:
        extra["fused"] = True
    params = [p for p in model.parameters() if p.requires_grad]
    if strategy == "zero1":
        kwargs = {k: v for k, v in node.items() if k != COMPONENT}
        return ZeroRedundancyOptimizer(params, optimizer_class=target, **kwargs, **extra)
    return instantiate(node, params, **extra)
