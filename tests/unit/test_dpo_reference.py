"""DPO's reference under adapters: the base model itself, with the adapters disabled."""

from __future__ import annotations

import pytest
import torch

from freetx.models.peft import adapter_layers, adapters_disabled
from tests.unit.test_peft import ALL, IDS, built, perturb, plain


@pytest.mark.parametrize("use_dora", [False, True])
def test_adapters_disabled_is_the_base_model_exactly(use_dora):
    model = built(use_dora=use_dora)
    perturb(model)  # trained adapters: the policy differs from its base
    with torch.no_grad():
        policy = model(IDS)
        with adapters_disabled(model):
            reference = model(IDS)
        base = plain()(IDS)  # the same seed: the same base weights, no adapters
        assert torch.equal(reference, base)
        assert not torch.allclose(policy, base)
        assert torch.equal(model(IDS), policy)  # enabled again after the block


def test_adapters_are_enabled_again_after_an_error():
    model = built(targets=ALL)
    with pytest.raises(RuntimeError), adapters_disabled(model):
        raise RuntimeError("in the forward")
    assert all(layer.adapter_enabled for layer in adapter_layers(model).values())
