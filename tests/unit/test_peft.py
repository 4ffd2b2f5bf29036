"""LoRA / DoRA adapters, merging and Spectrum's selection, on small models in one process."""

from __future__ import annotations

import math

import pytest
import torch

from freetx.distributed import fill_parameters, materialize
from freetx.errors import ConfigError
from freetx.models.peft import adapter_layers, apply_lora, merge_adapters
from freetx.models.peft.spectrum import score_matrix, select
from freetx.models.transformer import decoder

ALL = ["q", "k", "v", "o", "gate", "up", "down"]


def tiny(**fields):
    return decoder(vocab_size=64, hidden_dim=32, num_layers=2, num_heads=4, num_kv_heads=2,
                   ffn_hidden_dim=48, max_seq_len=16, **fields)  # fmt: skip


def built(targets=ALL, use_dora=False, untied=False):
    with torch.device("meta"):
        model = tiny(tie_embeddings=not untied)
        apply_lora(model, targets, rank=4, alpha=8, use_dora=use_dora)
    materialize(model, torch.device("cpu"), seed=3)
    return model


def plain():
    with torch.device("meta"):
        model = tiny(tie_embeddings=True)
    materialize(model, torch.device("cpu"), seed=3)
    return model


IDS = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("use_dora", [False, True])
def test_a_fresh_adapter_leaves_the_base_model_unchanged(use_dora):
    model = built(use_dora=use_dora)
    with torch.no_grad():
        assert torch.equal(model(IDS), plain()(IDS))  # same seed: the same base weights
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(adapter_layers(model)) == 14 and all(".lora_" in n for n in trainable)
    expected = 2 * 7 * (2 if not use_dora else 3)
    assert len(trainable) == expected


def test_dora_magnitude_starts_at_the_row_norms_of_the_base():
    model = built(use_dora=True)
    layer = model.layers[0].attention.wq
    assert torch.allclose(layer.lora_magnitude, layer.weight.norm(dim=1))


def perturb(model):
    def weights(name, param):
        value = torch.randn(param.shape, generator=torch.Generator().manual_seed(len(name)))
        return value * 0.3 + (param.detach() if "magnitude" in name else 0)

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    fill_parameters(model, lambda n, p: weights(n, p) if n in trainable else p.detach().clone())


@pytest.mark.parametrize("use_dora", [False, True])
def test_merged_model_equals_the_adapter_model(use_dora):
    model = built(use_dora=use_dora, untied=True, targets=[*ALL, "output"])
    perturb(model)
    with torch.no_grad():
        before = model(IDS)
        merged = merge_adapters(model)
        assert not adapter_layers(merged)
        # fp32 rounding of W + sBA against x W + s (x A) B: relative to the logits (up to
        # ~6 here), whose last bits the CPU's matmul kernels order differently
        assert (merged(IDS) - before).abs().max() < 1e-5 * max(1.0, before.abs().max())


def test_dora_forward_is_the_magnitude_times_the_normalized_direction():
    model = built(use_dora=True)
    perturb(model)
    layer = model.layers[1].feed_forward.w2
    x = torch.randn(3, layer.in_features)
    direction = layer.weight + layer.scale * layer.lora_b.weight @ layer.lora_a.weight
    expected = x @ (layer.lora_magnitude[:, None] * direction / direction.norm(dim=1)[:, None]).T
    with torch.no_grad():
        assert (layer(x) - expected).abs().max() < 1e-5


def test_unknown_targets_list_what_exists():
    with torch.device("meta"):
        model = tiny()
    with pytest.raises(ConfigError) as error:
        apply_lora(model, ["q", "qq_proj"], rank=4, alpha=8)
    message = str(error.value)
    assert "'qq_proj' match no Linear module" in message and "gate_proj" in message
    assert "wq, wk, wv" in message or "w1" in message  # the modules' own names
    with torch.device("meta"):
        tied = tiny(tie_embeddings=True)
    with pytest.raises(ConfigError, match="match no Linear"):
        apply_lora(tied, ["output"], rank=4, alpha=8)  # tied: no output layer of its own


@pytest.mark.parametrize("rank", [0, 33])
def test_a_rank_that_does_not_fit_is_refused(rank):
    with torch.device("meta"):
        model = tiny()
    with pytest.raises(ConfigError, match="at most the smaller side"):
        apply_lora(model, ["q"], rank=rank, alpha=8)


def test_spectrum_ranks_a_planted_signal_first_and_its_snr_is_the_formula():
    g = torch.Generator().manual_seed(0)
    noise = [torch.randn(64, 48, generator=g) for _ in range(4)]
    signal = torch.randn(64, 3, generator=g) @ torch.randn(3, 48, generator=g) * 2.0
    matrices = {f"layers.{i}.attention.wq": m for i, m in enumerate(noise)}
    matrices["layers.2.attention.wq"] = noise[2] + signal
    # the score divides by the largest singular value: compare at equal spectral norm
    matrices = {n: m / torch.linalg.matrix_norm(m, ord=2) for n, m in matrices.items()}
    scores = {n: score_matrix(m)["score"] for n, m in matrices.items()}
    assert max(scores, key=scores.get) == "layers.2.attention.wq"
    assert select(scores, 25) == ["layers.2.attention.wq"]
    # the hand computation for one matrix
    s = torch.linalg.svdvals(matrices["layers.0.attention.wq"])
    q25, q75 = torch.quantile(s, 0.25).item(), torch.quantile(s, 0.75).item()
    tau = (q75 - q25) / 1.349 * (1 + math.sqrt(48 / 64))
    below = s[s <= tau].sum().item() or 1.0
    expected = s[s > tau].sum().item() / below / s.max().item()
    assert scores["layers.0.attention.wq"] == pytest.approx(expected, rel=1e-6)


def test_spectrum_keeps_the_top_share_of_each_kind():
    scores = {f"layers.{i}.{kind}": float(i) for i in range(8) for kind in ("a.w", "b.w")}
    chosen = select(scores, 25)
    assert chosen == ["layers.6.a.w", "layers.6.b.w", "layers.7.a.w", "layers.7.b.w"]


def test_target_modules_takes_one_name_as_peft_does():
    """`target_modules: all-linear` (PEFT's, TRL's and axolotl's string) and one module name
    are lists of one once the config is built; anything else is refused by validate."""
    from freetx.config.run_config import load_recipe_config
    from freetx.models.peft import PEFTConfig, apply_peft
    from recipes.full_finetune_fsdp2 import FullFinetuneConfig

    cfg = load_recipe_config(
        "llm/tiny", ["peft.method=lora", "peft.target_modules=all-linear"], FullFinetuneConfig
    )
    assert cfg.peft.target_modules == ["all-linear"]
    with torch.device("meta"):
        model = tiny()
        apply_peft(model, cfg.peft, 1)
    assert len(adapter_layers(model)) == 2 * 7  # every Linear of both blocks, not the head
    assert PEFTConfig(method="lora", target_modules="q_proj").target_modules == ["q_proj"]
    with pytest.raises(ValueError, match="a list of names"):
        PEFTConfig(method="lora", target_modules=3)
