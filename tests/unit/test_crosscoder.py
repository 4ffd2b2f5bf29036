"""The crosscoder on one process: its loss's BatchTopK bookkeeping (dead-feature counters,
the threshold EMA) advances in training only, its output is typed, and its export computes
what the model does."""

from __future__ import annotations

import pytest
import torch

from freetx.distributed import materialize
from freetx.models.crosscoder import (
    CrosscoderLoss,
    CrosscoderStats,
    LocalReducer,
    crosscoder,
    exported_tensors,
)


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


@pytest.mark.parametrize(
    "activation, centered",
    [("relu", False), ("relu", True), ("jumprelu", True), ("batchtopk", True)],
)
def test_the_export_computes_what_the_model_does(activation, centered):
    """`exported_tensors` folds the input scale and the centering (the encoder reading
    x - b_dec) into plain weights: act(x @ W_enc + b_enc) at the threshold, then @ W_dec +
    b_dec, on raw activations, is the model's own reconstruction."""
    with torch.device("meta"):
        model = crosscoder(num_sources=2, source_dim=8, dict_size=32, activation=activation,
                           apply_b_dec_to_input=centered, log_threshold_init=-2.0, k=4)  # fmt: skip
    materialize(model, torch.device("cpu"), seed=0)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        model.b_dec.copy_(torch.randn(2, 8, generator=g))
        model.b_enc.copy_(torch.randn(32, generator=g) * 0.1)
        model.input_scale.copy_(torch.tensor([0.5, 3.0]))
        if activation == "batchtopk":
            model.inference_threshold.fill_(0.05)
    x = torch.randn(64, 2, 8, generator=g) * 2
    out = exported_tensors(dict(model.state_dict()), centered)
    pre = torch.einsum("bsd,sdm->bm", x, out["W_enc"]) + out["b_enc"]
    f = torch.relu(pre) * (pre > out["threshold"]) if "threshold" in out else torch.relu(pre)
    assert bool((f > 0).any()) and bool((f == 0).any())
    x_hat = torch.einsum("bm,msd->bsd", f, out["W_dec"]) + out["b_dec"]
    torch.testing.assert_close(x_hat, model.reconstruct(x).detach(), rtol=1e-4, atol=1e-4)
    if centered:  # and the model reads x - b_dec: its pre-activations move with b_dec
        scaled = model.scale(x)
        moved = model.pre_activations(scaled + model.b_dec.detach())
        plain = torch.einsum("bsd,msd->bm", scaled, model.W_enc) + model.b_enc
        torch.testing.assert_close(moved, plain.detach())
