"""`freetx estimate` counts every rung of the memory ladder (freetx/planning/estimate.py,
rungs.py, ladder.py): each rung's figure on llm/tiny's model, in exact bytes against its
parameters (torchao's low-bit states against torchao's own buffers), the `--ladder`
table, and the two single-GPU Llama 3.1 8B configs fitting their device."""

from __future__ import annotations

import json

import pytest

from benchmarks.shapes import HF_SHAPES
from freetx import registry
from freetx.cli.common import load_recipe
from freetx.cli.estimate import DEVICE_NAMES, build_parser
from freetx.cli.estimate import main as estimate_main
from freetx.config.instantiate import import_component
from freetx.config.run_config import load_recipe_config
from freetx.distributed.parallelize import find_blocks
from freetx.errors import ConfigError
from freetx.planning.config import estimate_config
from freetx.planning.estimate import DEVICES, GIB, float8_elements
from freetx.planning.ladder import ladder
from freetx.registry import recipe_for_config

BF16 = "distributed.mixed_precision.param_dtype=bfloat16"


def tiny(*overrides: str):
    return load_recipe_config(
        "llm/tiny", list(overrides), load_recipe("full_finetune_fsdp2").schema
    )


def rows(*overrides: str, world_size: int = 2, device: str = "cpu"):
    found = estimate_config(tiny(*overrides), world_size, device)
    return {r.strategy: r for r in found.rows}, found


def sizes(model) -> list[int]:
    return [p.numel() for p in model.parameters() if p.requires_grad]


def test_adamw_keeps_8_bytes_per_trained_element_sharded_as_the_strategy_shards():
    by, found = rows()
    trained = sum(sizes(found.model))
    assert by["ddp"].optimizer == 8 * trained and by["zero1"].optimizer == 4 * trained
    assert by["fsdp"].optimizer == 4 * trained and by["ddp"].host == 0


def test_bf16_state_dtype_keeps_4_bytes_per_element():
    by, found = rows("optimizer.state_dtype=bfloat16")
    assert by["ddp"].optimizer == 4 * sum(sizes(found.model))


def torchao_state_bytes(target: str, model) -> int:
    """The bytes of the two moments torchao's optimizer makes for `model` (its own
    `_new_buffer`, on the meta device: codes, block scales and lookup table, or fp32)."""
    optimizer = import_component(target, "optimizer")(model.parameters())
    total = 0
    for p in model.parameters():
        for signed in (True, False):
            state = optimizer._new_buffer(p, signed)
            names = state.__tensor_flatten__()[0] if hasattr(state, "__tensor_flatten__") else []
            parts = [getattr(state, n) for n in names] or [state]
            total += sum(t.numel() * t.element_size() for t in parts)
    return total


@pytest.mark.parametrize(
    "target", ["torchao.optim.AdamW8bit", "torchao.optim.AdamW4bit", "torchao.optim.AdamWFp8"]
)
def test_torchao_low_bit_states_are_counted_as_torchao_makes_them(target):
    by, found = rows(f"optimizer._component_={target}")
    expected = torchao_state_bytes(target, found.model)
    assert by["ddp"].optimizer == expected
    trained = sum(sizes(found.model))
    assert expected < 4 * trained  # quantized: tok_embeddings and the norms stay fp32


@pytest.mark.parametrize("momentum, per_element", [(0.9, 4), (0.0, 0)])
def test_sgd_keeps_4_bytes_with_momentum_and_none_without(momentum, per_element):
    by, found = rows(f"optimizer={{_component_: torch.optim.SGD, lr: 0.1, momentum: {momentum}}}")
    assert by["ddp"].optimizer == per_element * sum(sizes(found.model))


def test_an_optimizer_class_the_table_lacks_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as raised:
        rows("optimizer={_component_: torch.optim.LBFGS, lr: 0.1}")
    assert "torch.optim.LBFGS" in str(raised.value)
    assert "optimizer._component_=torch.optim.AdamW" in raised.value.fix


def test_optimizer_offload_moves_states_and_an_fp32_copy_with_its_gradients_to_the_host():
    by, found = rows("optimizer.offload=cpu")
    trained = sum(sizes(found.model))
    block = sum(sizes(find_blocks(found.model)[0]))
    for strategy in ("fsdp", "zero2", "hsdp"):  # gradients copied and freed in backward
        assert by[strategy].optimizer == 0 and by[strategy].host == (8 + 8) * trained / 2
        assert by[strategy].gradients == block * 4 / 2
    assert by["ddp"].gradients == 4 * trained and by["ddp"].host == 16 * trained  # at the step
    assert by["zero1"].gradients == 4 * trained and by["zero1"].host == 8 * trained


def test_optimizer_offload_on_one_process_keeps_the_gradients_it_accumulates():
    one, found = rows("optimizer.offload=cpu", world_size=1)
    block = sum(sizes(find_blocks(found.model)[0]))
    assert one["fsdp"].gradients == block * 4
    accumulating, _ = rows("optimizer.offload=cpu", "gradient_accumulation_steps=2", world_size=1)
    assert accumulating["fsdp"].gradients == 4 * sum(sizes(found.model))


def test_optimizer_in_backward_holds_the_largest_parameters_gradient_only():
    by, found = rows("optimizer.in_backward=true", "max_grad_norm=null")
    assert by["fsdp"].gradients == max(sizes(found.model)) * 4 / 2
    assert by["fsdp"].optimizer == 4 * sum(sizes(found.model))  # still on the device
    assert "ddp" not in by and "all-reduce" in found.refused["ddp"]  # a run refuses it


def test_optimizer_in_backward_with_gradient_clipping_is_refused_with_the_fix():
    with pytest.raises(ConfigError) as raised:
        rows("optimizer.in_backward=true")
    assert "max_grad_norm=null" in raised.value.fix


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_activation_offloading_keeps_two_blocks_on_the_device(checkpointing):
    ac = f"distributed.activation_checkpointing={checkpointing}"
    base, found = rows(ac)
    by, _ = rows(ac, "distributed.activation_offloading=true")
    blocks = len(find_blocks(found.model))
    kept = base["fsdp"].activations
    recomputed = 0.0
    if checkpointing == "full":  # one block's whole activations, recomputed on the device
        recomputed = rows()[0]["fsdp"].activations / blocks
    device = recomputed + (kept - recomputed) * 2 / blocks
    assert by["fsdp"].activations == pytest.approx(device)
    assert by["fsdp"].host == pytest.approx(kept - device) and by["fsdp"].host > 0
    assert by["fsdp"].peak == pytest.approx(base["fsdp"].peak - by["fsdp"].host)


def test_float8_runs_the_blocks_linears_at_the_float8_peak_and_gathers_them_in_one_byte():
    base, found = rows(BF16, device="h100")
    tensorwise, _ = rows(BF16, "distributed.float8=tensorwise", device="h100")
    rowwise, _ = rows(BF16, "distributed.float8=rowwise", device="h100")
    model, h100 = found.model, DEVICES["h100"]
    fast = 6 * sum(float8_elements(model, b) for b in find_blocks(model))
    flops = model.flops_per_token(found.seq_len)
    ratio = ((flops - fast) / h100.peak + fast / h100.float8_peak) / (flops / h100.peak)
    assert tensorwise["fsdp"].compute_s == pytest.approx(base["fsdp"].compute_s * ratio)
    assert rowwise["fsdp"].compute_s == tensorwise["fsdp"].compute_s
    unit = float8_elements(model, find_blocks(model)[0])  # two blocks gathered, bf16 -> 1 byte
    assert tensorwise["fsdp"].gathered == base["fsdp"].gathered - 2 * unit
    assert rowwise["fsdp"].gathered == base["fsdp"].gathered


def test_float8_on_a_device_without_float8_matmuls_is_refused_by_name():
    with pytest.raises(ConfigError) as raised:
        rows(BF16, "distributed.float8=tensorwise", device="a100")
    assert "a100 has no float8" in str(raised.value)


def test_ladder_each_rung_changes_what_it_says():
    rungs = ladder(tiny(BF16, "max_grad_norm=null"), 1, "h100")
    names = [r.name for r in rungs]
    assert names[0] == "baseline" and names[-1] == "+ float8" and len(names) == 8
    assert all(r.row is not None for r in rungs), [r.refused for r in rungs]
    base, ac, chunked, low_bit, in_backward, offload, act_offload, float8 = (r.row for r in rungs)
    assert ac.activations < base.activations and ac.step_s == pytest.approx(base.step_s * 4 / 3)
    assert chunked.loss < ac.loss
    assert low_bit.optimizer < chunked.optimizer
    assert in_backward.gradients < low_bit.gradients
    assert offload.optimizer == 0 and offload.host > 0
    assert offload.gradients > in_backward.gradients  # a block's, not one parameter's
    assert act_offload.activations < offload.activations and act_offload.host > offload.host
    assert float8.step_s < act_offload.step_s and float8.peak == act_offload.peak
    peaks = [r.peak for r in (base, ac, chunked, low_bit, in_backward)]
    assert peaks == sorted(peaks, reverse=True)


def test_ladder_says_a_refused_rung_and_leaves_it_off_the_rows_after_it():
    rungs = ladder(tiny("gradient_accumulation_steps=2"), 1, "cpu")
    refused = {r.name: r.refused for r in rungs if r.row is None}
    assert list(refused) == ["+ optimizer in backward"]
    assert "gradient_accumulation_steps=2" in refused["+ optimizer in backward"]
    assert "+ float8" not in [r.name for r in rungs]  # no float8 matmuls on this CPU
    offload = next(r.row for r in rungs if r.name.startswith("+ optimizer offload"))
    assert offload.optimizer == 0


def estimate_cli(capsys, *argv: str) -> str:
    assert estimate_main(build_parser().parse_args(list(argv))) == 0
    return capsys.readouterr().out


def test_cli_ladder_prints_a_row_per_rung_with_ratios_to_the_baseline(capsys):
    out = estimate_cli(capsys, "llm/tiny", "--world-size", "1", "--device", "h100", "--ladder")
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("rung"))
    assert lines[header].split() == ["rung", "peak", "GiB", "x", "base", "host", "GiB", "fits",
                                     "step", "s", "x", "base"]  # fmt: skip
    table = lines[header + 1 : header + 9]
    assert [line.split("  ")[0] for line in table][:2] == [
        "baseline",
        "+ activation checkpointing (full)",
    ]
    assert table[0].split()[2] == "1.00" and table[-1].startswith("+ float8")


def test_cli_prints_the_host_column_for_an_offloaded_optimizer(capsys):
    out = estimate_cli(
        capsys, "llm/tiny", "optimizer.offload=cpu", "--world-size", "2", "--device", "cpu"
    )
    assert "host GiB" in out and "(host: CPU memory per rank" in out
    plain = estimate_cli(capsys, "llm/tiny", "--world-size", "2", "--device", "cpu")
    assert "host GiB" not in plain


def test_cli_devices_are_the_estimates_and_ladder_excludes_measure(capsys):
    assert set(DEVICE_NAMES) == set(DEVICES) and DEVICES["rtx4090"].memory_gib == 24
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["llm/tiny", "--ladder", "--measure"])
    assert raised.value.code == 2 and "not allowed with" in capsys.readouterr().err


@pytest.mark.parametrize(
    "config, device",
    [("llm/llama3_1_8b_full_1gpu", "h100"), ("llm/llama3_1_8b_lora_24gb", "rtx4090")],
)
def test_llama3_1_8b_single_gpu_configs_fit_their_device(config, device, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_SHAPES["Llama-3.1-8B"]))
    schema = load_recipe(recipe_for_config(config).name).schema
    cfg = load_recipe_config(config, [f"model_dir={tmp_path}"], schema)
    row = next(r for r in estimate_config(cfg, 1, device).rows if r.strategy == "fsdp")
    assert row.peak / GIB < DEVICES[device].memory_gib * 0.9, row.peak / GIB
    header = registry.config_file(config).read_text().split("\nmodel_dir")[0]
    assert f"{row.peak / GIB:.2f} GiB on the GPU" in header  # the figure it says it fits by
