"""The crosscoder's loss on one process: its BatchTopK bookkeeping (dead-feature counters,
the threshold EMA) advances in training only, and its output is typed."""

from __future__ import annotations

import torch

from freetx.distributed import materialize
from freetx.models.crosscoder import CrosscoderLoss, CrosscoderStats, LocalReducer, crosscoder


def batchtopk_model():
    with torch.device("meta"):
        model = crosscoder(num_sources=2, source_dim=8, dict_size=32, activation="batchtopk", k=2)
    materialize(model, torch.device("cpu"), seed=0)
    return model


def test_evaluation_leaves_the_loss_state_as_it_is():
    model, loss_fn = batchtopk_model(), CrosscoderLoss(LocalReducer())
    x = torch.randn(16, 2, 8, generator=torch.Generator().manual_seed(0))
    model.eval()
    model(x, loss_fn)
    assert int(model.rows_since_fired.max()) == 0 and float(model.inference_threshold) == 0.0
    model.train()
    output = model(x, loss_fn)
    assert int(model.rows_since_fired.max()) == 16 and float(model.inference_threshold) > 0.0
    assert sorted(output.log_sums()) == ["aux_loss", "l0", "recon_loss", "sparsity_loss"]
    stats = CrosscoderStats(2, 8, 32)
    stats.add(output.stats)
    metrics = stats.read(lambda tensors: tensors)
    assert metrics["window_rows"] == 16.0 and 0.0 <= metrics["dead_fraction"] < 1.0
