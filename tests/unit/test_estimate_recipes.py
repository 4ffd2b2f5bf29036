"""`freetx estimate` on the crosscoder's and AD's configs: model states counted as the real
model holds them, the crosscoder's activations bounding what a real step keeps, its source
models read from their recorded shapes without their weights, and the CLI's answers."""

from __future__ import annotations

import json

import pytest
import torch
from torch.distributed._tools.mem_tracker import MemTracker

from freetx.cli.common import load_recipe
from freetx.config.run_config import load_recipe_config
from freetx.models.ad import ad_transformer
from freetx.models.crosscoder import CrosscoderLoss, crosscoder
from freetx.models.memory import TrainingShape
from freetx.planning.config import estimate_config
from freetx.registry import recipe_for_config
from tests.conftest import flat, run_freetx_here

GPT2 = dict(
    model_type="gpt2", vocab_size=50257, n_embd=768, n_layer=12, n_head=12, n_positions=1024
)


def config_estimate(config: str, world_size: int = 2, device: str = "cpu"):
    schema = load_recipe(recipe_for_config(config).name).schema
    return estimate_config(load_recipe_config(config, [], schema), world_size, device)


def adam_state_bytes(model: torch.nn.Module) -> int:
    """The bytes of Adam's moments after a real step of `model` (its step counters left out)."""
    optimizer = torch.optim.Adam(model.parameters())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    return sum(
        t.numel() * t.element_size()
        for state in optimizer.state.values()
        for name, t in state.items()
        if name != "step"
    )


@pytest.mark.parametrize(
    "config, build",
    [
        # crosscoder/synthetic_tiny: 2 sources x d 32 (its synthetic rows), dict_size 256
        ("crosscoder/synthetic_tiny",
         lambda: crosscoder(num_sources=2, source_dim=32, dict_size=256, activation="relu")),
        # ad/darkroom_tiny's model section, written out
        ("ad/darkroom_tiny",
         lambda: ad_transformer(n_transit=100, hidden_dim=64, num_layers=4, num_heads=4,
                                ffn_hidden_dim=256, dropout=0.1, state_encoding="xy",
                                grid_size=9)),
    ],
    ids=["crosscoder", "ad"],
)  # fmt: skip
def test_estimate_counts_the_states_the_real_model_holds(config, build):
    torch.manual_seed(0)
    model = build()  # real tensors on the CPU
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    rows = {r.strategy: r for r in config_estimate(config).rows}
    assert rows["ddp"].parameters == fp32 and rows["ddp"].gradients == fp32
    assert rows["ddp"].optimizer == adam_state_bytes(model)
    assert (
        rows["fsdp"].parameters == fp32 / 2 and rows["fsdp"].optimizer == rows["ddp"].optimizer / 2
    )
    assert rows["ddp"].activations > 0


class _OneRank:
    dp_size = 1

    def all_gather_varying(self, t):
        return t

    def all_reduce(self, t):
        return t


@pytest.mark.parametrize("activation", ["relu", "jumprelu", "batchtopk"])
def test_crosscoder_activation_bytes_bound_a_real_step(activation):
    """A float32 step of 4096 rows (m 512, 2 x 64) under torch's MemTracker: what it holds
    besides parameters, gradients and Adam's state at its peak is at most the estimate,
    and the estimate is within 1.5x of it."""
    torch.manual_seed(0)
    model = crosscoder(num_sources=2, source_dim=64, dict_size=512, activation=activation)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    optimizer, loss = torch.optim.Adam(model.parameters()), CrosscoderLoss(_OneRank())
    x = torch.randn(4096, 2, 64)

    def step():
        model(x, loss, 1.0).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    peak = {getattr(k, "value", k): v for k, v in next(iter(tracker.get_tracker_snapshot("peak").values())).items()}  # fmt: skip
    held = peak["Total"] - sum(peak[k] for k in ("Parameter", "Gradient", "Optstate", "Buffer"))
    held += x.numel() * 4  # the batch, made before the tracker
    estimated = model.activation_bytes(TrainingShape(4096, 1, 4, blocks=0)).kept
    assert held <= estimated <= 1.5 * held, (activation, held, estimated)


def test_the_cli_estimates_a_crosscoder():
    result = run_freetx_here("estimate", "crosscoder/synthetic_tiny", "--world-size", "2",
                             "--device", "cpu")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "micro-batch 512 rows" in result.stdout
    for strategy in ("ddp", "zero1", "zero2", "fsdp", "hsdp"):
        row = next(line for line in result.stdout.splitlines() if line.startswith(strategy + " "))
        assert row.split()[-3] == "yes", row


def test_the_cli_counts_a_crosscoders_source_model_from_its_config_json(tmp_path):
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps(GPT2))
    result = run_freetx_here("estimate", "crosscoder/gpt2_layers", "--world-size", "8",
                             f"activations.sources.0.model={tmp_path / 'gpt2'}")  # fmt: skip
    assert result.returncode == 0, result.stderr
    # 12 hooks of d 768; GPT-2 small: 124,439,808 parameters in bf16 = 0.23 GiB
    assert "12 sources x d 768" in result.stdout
    assert "the source models' weights 0.23 GiB" in flat(result.stdout)
    assert result.stdout.splitlines()[1].split()[7] == "sources"


def test_the_cli_asks_for_the_source_dim_of_a_source_not_made_yet(tmp_path):
    missing = f"activations.sources.0.model={tmp_path / 'not_yet'}"
    args = ["estimate", "crosscoder/lm_layers_tiny", "--world-size", "2", "--device", "cpu"]
    refused = run_freetx_here(*args, missing)
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    message = flat(refused.stderr)
    assert "cannot read the shape of the source model(s)" in message
    assert "Give --source-dim D" in message
    given = run_freetx_here(*args, missing, "--source-dim", "64")
    assert given.returncode == 0, given.stderr
    assert "3 sources x d 64" in given.stdout
    assert "not counted: the source models" in flat(given.stdout)


def test_the_cli_refuses_a_config_that_trains_nothing():
    result = run_freetx_here("estimate", "free_transformer/generate")
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "trains nothing" in flat(result.stderr)
