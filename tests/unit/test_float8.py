"""distributed.float8 without a GPU: the refusals before launch (the CPU, tensor
parallelism, an older GPU at run start), which Linears of a meta model torchao's
conversion swaps, the key through a recipe's config."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torchao.float8.float8_linear import Float8Linear

from freetx.cli.common import load_recipe
from freetx.config.run_config import load_recipe_config
from freetx.distributed import DistributedConfig, Processes, check_distributed
from freetx.distributed.float8 import check_float8_device, convert_to_float8, float8_filter
from freetx.errors import ConfigError
from freetx.models.peft import apply_lora
from freetx.models.transformer import decoder
from tests.conftest import flat, run_freetx_here


def test_float8_on_the_cpu_is_refused_by_validate():
    result = run_freetx_here("validate", "llm/tiny", "device=cpu", "distributed.float8=rowwise")
    message = flat(result.stdout + result.stderr)
    assert result.returncode == 1, message
    assert "distributed.float8=rowwise: float8 matmuls need an H100-class GPU (CUDA " \
        "capability 8.9+), and this run is on the CPU" in message  # fmt: skip
    assert "Set distributed.float8=none" in message


def test_float8_with_tensor_parallelism_is_refused():
    cfg = DistributedConfig(float8="tensorwise", tp=2)
    with pytest.raises(ConfigError) as refused:
        check_distributed(cfg, Processes(4, 4, "cuda"))
    assert "float8 tensor-parallel styles" in str(refused.value)
    assert "distributed.tp=1" in refused.value.fix


def test_float8_on_a_gpu_without_float8_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ConfigError) as refused:
        check_float8_device("tensorwise", torch.device("cuda", 0))
    message = flat(str(refused.value))
    assert "the NVIDIA A100-SXM4-80GB (CUDA capability 8.0) has no float8 matmuls" in message
    check_float8_device("none", torch.device("cuda", 0))  # off: nothing to refuse


def converted(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]


def test_only_the_blocks_plain_linears_divisible_by_16_convert():
    """An untied head, a MLP of 200 hidden units (not divisible by 16) and LoRA (rank 16)
    on q and the head: only k, v's and o's Linears convert; LoRA's layers, their A and B,
    the head and the MLP stay."""
    with torch.device("meta"):
        model = decoder(preset="tiny", tie_embeddings=False, ffn_hidden_dim=200, num_layers=2)
    apply_lora(model, ["q", "output"], rank=16, alpha=32)
    convert_to_float8(model, "tensorwise", float8_all_gather=False)
    blocks = [f"layers.{i}.attention.{p}" for i in range(2) for p in ("wk", "wv", "wo")]
    assert sorted(converted(model)) == sorted(blocks)
    assert not float8_filter(model)(model.layers[0].attention.wq.lora_a, "")


@pytest.mark.parametrize(
    "recipe, all_gather", [("tensorwise", True), ("tensorwise", False), ("rowwise", False)]
)
def test_the_recipes_scaling_and_float8_all_gather(recipe, all_gather):
    with torch.device("meta"):
        model = decoder(preset="tiny", num_layers=1)
    convert_to_float8(model, recipe, float8_all_gather=all_gather)
    layer = model.layers[0].feed_forward.w1
    assert layer.config.enable_fsdp_float8_all_gather is all_gather
    granularity = layer.config.cast_config_weight.scaling_granularity.value
    assert granularity == {"tensorwise": "tensorwise", "rowwise": "axiswise"}[recipe]


def test_the_float8_key_through_a_recipes_config():
    schema = load_recipe("full_finetune_fsdp2").schema
    assert load_recipe_config("llm/tiny", [], schema).distributed.float8 == "none"
    cfg = load_recipe_config("llm/tiny", ["distributed.float8=rowwise"], schema)
    assert cfg.distributed.float8 == "rowwise"
    result = run_freetx_here("validate", "llm/tiny", "distributed.float8=fp8")
    assert "'distributed.float8' must be one of 'none', 'tensorwise', 'rowwise'" in flat(
        result.stdout
    )
