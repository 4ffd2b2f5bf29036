"""LoRA targets on MoE models. `all-linear` as PEFT means it on transformers' MoE models:
every Linear module but the output head, a gate narrower than the rank included (Qwen2-
and Qwen3.5-MoE's shared_expert_gate, hidden -> 1), the MoE routers left out
(transformers' are no Linear modules); a target naming a Linear narrower than the rank is
refused; a target naming the shared expert's down_proj by its path adapts that Linear."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from freetx.errors import ConfigError
from freetx.models.moe import Router
from freetx.models.peft import apply_lora


class Block(nn.Module):
    """An MoE block's Linear modules beside its experts: a router and a shared expert
    with its 1-wide gate."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = Router(16, 4)
        self.shared_expert = nn.Linear(16, 16)
        self.shared_expert_gate = nn.Linear(16, 1, bias=False)


def test_all_linear_adapts_a_gate_narrower_than_the_rank_as_peft_does():
    with torch.device("meta"):
        block = Block()
    names = apply_lora(block, ["all-linear"], rank=2, alpha=4)
    assert names == ["shared_expert", "shared_expert_gate"]
    assert block.shared_expert_gate.lora_b.weight.shape == (1, 2)


def test_all_linear_leaves_the_moe_router():
    with torch.device("meta"):
        block = Block()
    apply_lora(block, ["all-linear"], rank=2, alpha=4)
    assert type(block.gate) is Router and not block.gate.weight.requires_grad


def test_a_target_naming_a_linear_narrower_than_the_rank_is_refused():
    with torch.device("meta"):
        block = Block()
    with pytest.raises(ConfigError, match=r"peft.rank=2 does not fit shared_expert_gate "
                       r"\(16 -> 1\).*at most the smaller side, 1"):  # fmt: skip
        apply_lora(block, ["shared_expert_gate"], rank=2, alpha=4)


def test_a_target_naming_the_shared_experts_down_proj_by_its_path_adapts_that_linear():
    """Not refused as naming the experts' 3-D down_proj (a bare `down_proj` is)."""
    from tests.unit.test_expert_lora import hf_moe_block

    block = hf_moe_block("qwen2_moe")
    names = apply_lora(block, ["shared_expert.down_proj", "shared_expert_gate"], rank=1, alpha=2)
    assert names == ["shared_expert.down_proj", "shared_expert_gate"]
