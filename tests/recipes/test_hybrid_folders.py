"""Hybrid and linear-attention models through the generic path: Qwen3.5 dense and MoE
(Gated DeltaNet layers beside full attention), LFM2 (short convolutions) and Mamba
(state-space layers only), from tiny folders transformers wrote. Their logits are
transformers'; generation with the cache transformers gives them (`DynamicCache` of the
config: a linear-attention layer per recurrent layer) equals the full forward, left-padded
rows included; Mamba's cached steps read the mask on the prompt alone, as its `generate`
does; a model with no attention layer, whose forward asks the cache for a length only an
attention layer keeps, is refused a KV cache by name before any weight is read; and Qwen3.5
MoE fine-tunes on 2 processes under FSDP2 per layer with activation checkpointing."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import flat, run_freetx_here
from tests.hf_folders import hf_logits, make_folder

transformers = pytest.importorskip("transformers")

HYBRIDS = ["qwen3_5_text", "qwen3_5_moe_text", "lfm2_conv", "mamba"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid_folders")
    return {family: make_folder(root / family, family) for family in HYBRIDS}


@pytest.fixture(scope="module")
def models(folders):
    from freetx.checkpoint import load_model

    return {family: load_model(folder, "cpu") for family, folder in folders.items()}


def ids(seed=1, length=12):
    return torch.randint(3, 384, (2, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family", HYBRIDS)
def test_each_hybrid_folder_gives_transformers_logits(folders, models, family):
    model_type = family.removesuffix("_conv")  # lfm2_conv: an lfm2 folder
    assert models[family].describe().startswith(f"generic transformers path for {model_type}")
    with torch.no_grad():
        assert (models[family](ids()) - hf_logits(folders[family], ids())).abs().max() <= 1e-4


def cached_vs_full(model) -> tuple[float, float]:
    """The largest difference between the logits of a prompt of 8 tokens then 4 cached steps
    and one full forward; and that of a row left-padded by 3 against it alone."""
    tokens = ids()
    with torch.no_grad():
        full = model(tokens)
        cache = model.new_cache(torch.zeros(2, dtype=torch.long), 16)
        steps = [model(tokens[:, :8], cache=cache)]
        steps += [model(tokens[:, i : i + 1], cache=cache) for i in range(8, 12)]
        stepped = (torch.cat(steps, 1) - full).abs().max().item()
        padded = tokens[:, :9].clone()
        padded[1] = torch.cat([torch.zeros(3, dtype=torch.long), tokens[1, :6]])
        last = model(padded, cache=model.new_cache(torch.tensor([0, 3]), 16))[1, -1]
        alone = model(tokens[1:, :6])[0, -1]
    return stepped, (last - alone).abs().max().item()


def test_cached_steps_of_qwen3_5_equal_the_full_forward(models):
    stepped, padded = cached_vs_full(models["qwen3_5_text"])
    assert stepped <= 1e-5 and padded <= 1e-5, (stepped, padded)


@pytest.mark.slow  # transformers' reference kernels (no fla / causal_conv1d): ~15 s on CPU
@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "lfm2_conv"])
def test_cached_generation_of_a_hybrid_equals_the_full_forward(models, family):
    from freetx.models.generation import Draws, Sampling, generate

    model = models[family]
    stepped, padded = cached_vs_full(model)
    assert stepped <= 1e-5 and padded <= 1e-5, (stepped, padded)
    greedy = Sampling(temperature=0)
    prompts, draws = ids(2, 6).tolist(), Draws.seeded([0, 1], 6)
    cached = generate(model, prompts, 6, greedy, [], draws)
    full = generate(model, prompts, 6, greedy, [], draws, use_cache=False)
    assert torch.equal(cached.tokens, full.tokens)


def test_mamba_cached_steps_equal_the_full_forward(models):
    """MambaForCausalLM reads the attention mask on the prompt alone (its
    prepare_inputs_for_generation drops it after): a mask on later steps changed its state
    (logits off by 0.68 at the second step before)."""
    stepped, padded = cached_vs_full(models["mamba"])
    assert stepped <= 1e-5 and padded <= 1e-5, (stepped, padded)


@pytest.mark.parametrize("family", ["qwen3_5_text", "qwen3_5_moe_text"])
def test_hf_to_dcp_to_hf_gives_a_qwen3_5_folder_back_bit_for_bit(tmp_path, folders, family):
    """Its rules hold a PrefixChange (a multimodal folder's `language_model.`), which a text
    folder's names never had: the export writes them as they were."""
    from safetensors.torch import load_file

    from freetx.checkpoint import convert

    convert(folders[family], tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", to="hf")

    def stored(folder):
        return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}

    before, after = stored(folders[family]), stored(tmp_path / "hf")
    assert set(after) == set(before)
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in before.items())


def test_a_multimodal_qwen3_5_folder_gives_its_text_models_logits_and_back_bit_for_bit(tmp_path):
    """Qwen3.5's releases are `qwen3_5` folders written by Qwen3_5ForConditionalGeneration:
    the text model under `model.language_model.` (transformers' PrefixChange), a vision
    tower beside it. transformers' causal LM reads the text model and leaves the tower; so
    does freetx (a note names it), and an export writes the text model's tensors back
    under their prefixed names."""
    from safetensors.torch import load_file

    from freetx.checkpoint import convert, load_model
    from freetx.checkpoint.formats import open_tensors, skipped_note
    from tests.hf_folders import QWEN3_5, SHAPE

    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2,
                  out_hidden_size=64, patch_size=14, spatial_merge_size=2)  # fmt: skip
    config = transformers.AutoConfig.for_model(
        "qwen3_5", text_config=dict(SHAPE, **QWEN3_5), vision_config=vision
    )
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(config).save_pretrained(tmp_path / "mm")
    model = load_model(tmp_path / "mm", "cpu")
    with torch.no_grad():
        assert (model(ids()) - hf_logits(tmp_path / "mm", ids())).abs().max() <= 1e-4
    assert "model.* (" in skipped_note(open_tensors(tmp_path / "mm"))[0]  # the vision tower
    convert(tmp_path / "mm", tmp_path / "dcp", to="dcp")
    convert(tmp_path / "dcp", tmp_path / "hf", to="hf")
    before, after = (
        load_file(tmp_path / "mm" / "model.safetensors"),
        load_file(tmp_path / "hf" / "model.safetensors"),
    )
    text = {k: v for k, v in before.items() if not k.startswith("model.visual.")}
    assert set(after) == set(text) and any(k.startswith("model.language_model.") for k in text)
    assert all(torch.equal(after[k], v) and after[k].dtype == v.dtype for k, v in text.items())


def test_a_model_with_no_attention_layer_is_refused_a_kv_cache_by_name_before_any_weight_is_read(
    tmp_path,
):
    """Qwen3.5 with every layer linear attention: transformers' forward asks the cache for its
    length, which only an attention layer keeps (a raw ValueError inside the forward before).
    `freetx validate` refuses kv_cache=true naming it and the fix, the weights file never
    opened (it is not even safetensors); kv_cache=false passes."""
    folder = make_folder(tmp_path / "all_linear", "qwen3_5_text_all_linear")
    (folder / "model.safetensors").write_bytes(b"not read")
    result = run_freetx_here("validate", "llm/hf_generate", f"checkpoint={folder}")
    message = flat(result.stdout + result.stderr)
    assert result.returncode == 1 and "Traceback" not in message, message
    assert "kv_cache" in message and "every layer of this 'qwen3_5_text' model is " in message
    assert "Generate with a full forward per token: kv_cache=false" in message
    fine = run_freetx_here("validate", "llm/hf_generate", f"checkpoint={folder}", "kv_cache=false")
    assert fine.returncode == 0, fine.stdout + fine.stderr


def test_new_cache_of_a_model_with_no_attention_layer_is_refused_by_name(tmp_path):
    """A run's checkpoint is not looked into before it is loaded: `new_cache` refuses."""
    from freetx.checkpoint import load_model
    from freetx.errors import ConfigError
    from freetx.models.generation import Draws, Sampling, generate

    model = load_model(make_folder(tmp_path / "all_linear", "qwen3_5_text_all_linear"), "cpu")
    with pytest.raises(ConfigError, match="no attention layer.*kv_cache=false"):
        model.new_cache(torch.zeros(1, dtype=torch.long), 8)
    full = generate(model, [[5, 6]], 2, Sampling(0), [], Draws.seeded([0], 2), use_cache=False)
    assert full.tokens.shape == (1, 2)


@pytest.mark.slow  # three 2-process runs, ~60 s on 2 CPU cores
def test_a_qwen3_5_moe_folder_finetunes_on_2_processes_with_checkpointing_and_resumes_exactly(
    tmp_path,
):
    from tests.recipes.test_moe_folders import finetunes_and_resumes

    finetunes_and_resumes(tmp_path, "qwen3_5_moe_text", "generic transformers path")
